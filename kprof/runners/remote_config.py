"""`remote.yaml`: the named remotes of `run --remote NAME`, read and validated field by field (an unknown or bad
field is a UsageError naming the file, the remote, the field and the fix), with `--remote-set KEY=VALUE` overrides
for one call. `remote.example.yaml` lists every field.

    remote = load_remote("h200", "remote.yaml", ["launch.slurm.time=30"])
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import msgspec

from ..errors import UsageError

__all__ = ["Remote", "RaySettings", "SlurmSettings", "load_remote", "where", "FIELDS", "CONFIG", "EXAMPLE", "engine"]

CONFIG = "remote.yaml"
CONFIG_VERSION = 1
EXAMPLE = "remote.example.yaml lists every field"


# ---- remote.yaml ------------------------------------------------------------------------------------------------

class RaySettings(msgspec.Struct, frozen=True):
    address: str  # "local" (start a cluster here), "auto" (the running one), or "ray://host:10001"
    num_cpus: int | None = None  # only with "local"
    gpus_per_worker: int | None = None  # None: what the specs need (CUDA), 0 (CPU)
    runtime_env: dict = {}


class SlurmSettings(msgspec.Struct, frozen=True):
    time: int  # minutes per job
    partition: str | None = None  # required with cluster "slurm"
    gpus_per_node: int | None = None  # GPUs each job asks for; None: what the specs need (CUDA), 0 (CPU)
    account: str | None = None
    folder: str | None = None  # submitit's logs and pickles; default OUTPUT_DIR/submitit
    cluster: str = "slurm"  # slurm | local (submitit's LocalExecutor) | debug (in this process)


class Remote(msgspec.Struct, frozen=True):
    name: str
    path: str
    kind: str  # ray | slurm
    workers: int | None = None  # chunks; None: every GPU/CPU slot of the Ray cluster, 1 Slurm job
    ray: RaySettings | None = None
    slurm: SlurmSettings | None = None
    overrides: list[str] = []


class _Field(msgspec.Struct, frozen=True):
    type: str  # str | int | mapping
    doc: str
    choices: tuple = ()
    minimum: int | None = None


# Every settable field, by its dotted name: the name in remote.yaml (nested) and in --remote-set KEY=VALUE.
FIELDS: dict[str, _Field] = {
    "kind": _Field("str", "the engine", choices=("ray", "slurm")),
    "workers": _Field("int", "how many chunks (Ray tasks or Slurm jobs)", minimum=1),
    "launch.ray.address": _Field("str", 'the cluster: "local", "auto" or "ray://HOST:10001"'),
    "launch.ray.num_cpus": _Field("int", 'CPUs of a cluster started here (address "local" only)', minimum=1),
    "launch.ray.gpus_per_worker": _Field("int", "GPUs per task (0 for CPU backends)", minimum=0),
    "launch.ray.runtime_env": _Field("mapping", "Ray runtime_env of the tasks, e.g. {env_vars: {A: b}}"),
    "launch.slurm.partition": _Field("str", "the Slurm partition"),
    "launch.slurm.gpus_per_node": _Field("int", "GPUs each job asks for (0 for CPU backends)", minimum=0),
    "launch.slurm.time": _Field("int", "each job's time limit in minutes", minimum=1),
    "launch.slurm.account": _Field("str", "the Slurm account"),
    "launch.slurm.folder": _Field("str", "submitit's folder for logs and pickles"),
    "launch.slurm.cluster": _Field("str", "submitit's executor", choices=("slurm", "local", "debug")),
}
_SECTIONS = {"launch", "launch.ray", "launch.slurm"}


def where(path: str, name: str, field: str, overrides: list[str] | tuple = ()) -> str:
    """Where a field's value was given: `--remote-set FIELD` where one of `overrides` set it, else the file's field."""
    if any(item.partition("=")[0].strip() == field for item in overrides):
        return f"--remote-set {field}"
    return f"{path}: remote {name!r}: field {field}"


def _flatten(path: str, name: str, doc: dict, prefix: str = "") -> dict[str, Any]:
    """The remote's mapping as {dotted field: value}; an unknown field is refused, naming the known ones there."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        dotted = f"{prefix}{key}"
        if dotted in _SECTIONS:
            if not isinstance(value, dict):
                raise UsageError(f"{where(path, name, dotted)} is {value!r}, not a mapping; nest its fields under "
                                 f"it ({EXAMPLE})")
            out.update(_flatten(path, name, value, dotted + "."))
        elif dotted in FIELDS:
            out[dotted] = value
        else:
            here = sorted({f[len(prefix):].split(".")[0] for f in [*FIELDS, *_SECTIONS] if f.startswith(prefix)})
            raise UsageError(f"{where(path, name, dotted)} is not a remote field; the fields there are "
                             f"{', '.join(here)} ({EXAMPLE})")
    return out


def _checked(where: str, field: _Field, value: Any, raw: bool) -> Any:
    """The value of one field, checked (and parsed when `raw`: a --remote-set string)."""
    example = f"e.g. {field.choices[0]}" if field.choices else f"({field.doc})"
    if field.type == "mapping":
        if raw:
            yaml = _yaml()
            try:
                value = yaml.load(value, Loader=_loader())
            except yaml.YAMLError as exc:  # the value as typed, and why it does not parse (not "None")
                raise UsageError(f"{where} is {value!r}, not valid YAML ({getattr(exc, 'problem', None) or exc}); "
                                 f"give a mapping, e.g. {{env_vars: {{KPROF_TIMER: cupti}}}} {example}") from None
            _bounded(value, where)
        if not isinstance(value, dict):
            raise UsageError(f"{where} is {value!r}, not a mapping; give one, e.g. {{env_vars: {{KPROF_TIMER: "
                             f"cupti}}}} {example}")
        return value
    if field.type == "int":
        if raw and re.fullmatch(r"[+-]?[0-9]+", value.strip()):  # int() takes "1_0" for 10, and non-ASCII digits
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{where} is {value!r}, not a whole number; give one {example}")
        if field.minimum is not None and value < field.minimum:
            raise UsageError(f"{where} is {value}; give a number >= {field.minimum} {example}")
        return value
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where} is {value!r}, not a non-empty string; give one {example}")
    if field.choices and value not in field.choices:
        raise UsageError(f"{where} is {value!r}, not one of {', '.join(field.choices)}; {example}")
    return value


def _override(item: str) -> tuple[str, str]:
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise UsageError(f"--remote-set {item!r} is not KEY=VALUE; e.g. --remote-set launch.slurm.time=30")
    if key not in FIELDS:
        raise UsageError(f"--remote-set {key}: not a field of a remote; the fields are {', '.join(FIELDS)} "
                         f"({EXAMPLE})")
    return key, value


# Values a remote.yaml may hold once its aliases are expanded: a remote has a dozen, a runtime_env a few hundred.
MAX_VALUES = 100_000


def _bounded(doc: Any, where: str) -> None:
    """A UsageError where YAML's aliases (`*name`) expand `doc` past MAX_VALUES values, or an alias names a mapping
    or list that holds it: ten lists of ten aliases of the last, nine deep (a "billion laughs"), load in a few lines,
    and naming or sending one (an error's repr, Ray's runtime_env, remote-run.json) took hours or all memory; an
    alias of itself recursed without end. Counted, never expanded, and stopped at the bound."""
    stack, count = [doc], 0
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise UsageError(f"{where} holds more than {MAX_VALUES:,} values once its aliases (*name) are expanded, or "
                             f"an alias names a mapping or list that holds it; write the values out, without aliases "
                             f"of aliases ({EXAMPLE})")
        if isinstance(value, dict):
            stack += [*value, *value.values()]
        elif isinstance(value, list):
            stack += value


@functools.lru_cache(maxsize=None)
def _loader():
    """PyYAML's safe loader, reading a whole number as YAML 1.2 does (decimal digits only): its YAML 1.1 reading
    took Slurm's `time: 1:30:00` for 5400 minutes (base 60), `010` for 8 and `1_0` for 10, numbers nobody wrote;
    any other form stays text, which a number field refuses. A key given twice in one mapping is an error, as YAML
    says: PyYAML kept the last, so a remote copied and left under its old name replaced that remote unseen."""
    yaml = _yaml()

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key, _value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{key.value!r} is given twice in one mapping (lines {seen[key.value] + 1} "
                                        f"and {key.start_mark.line + 1}); keep one", key.start_mark)
                    seen[key.value] = key.start_mark.line
            return super().construct_mapping(node, deep)

    int_tag = "tag:yaml.org,2002:int"
    Loader.yaml_implicit_resolvers = {c: [(tag, rx) for tag, rx in rules if tag != int_tag]
                                      for c, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(int_tag, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    Loader.add_constructor(int_tag, lambda loader, node: int(loader.construct_scalar(node)))
    return Loader


def engine(module: str, requirement: str, missing: str):
    """Module `module` of the [remote] extra (ray, submitit, yaml); where it is not installed, a UsageError, `missing`
    saying what needs it, and how to install it (it was a ModuleNotFoundError traceback): `requirement` is the
    extra's floor (kprof is not on PyPI)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"{missing} ({exc}); install it: pip install '{requirement}' (or every engine: pip install "
                         f"'.[remote]' in kprof's checkout)") from None


def _yaml():
    """PyYAML, which reads remote.yaml."""
    return engine("yaml", "pyyaml>=6", "--remote reads remote.yaml with PyYAML, which is not installed here")


def _read(path: str) -> dict:
    yaml = _yaml()
    if os.path.exists(path) and not os.path.isfile(path):  # a pipe's read waited for a writer for good
        raise UsageError(f"{path} is not a regular file (a directory, pipe or device); --remote reads its named "
                         f"remotes from a file: copy remote.example.yaml to {path} and fill in your remote")
    try:
        with open(path, "rb") as f:  # bytes: YAML's own decoding (UTF-8, or a BOM's), its error a YAMLError
            doc = yaml.load(f, Loader=_loader())
    except FileNotFoundError:
        raise UsageError(f"{path} not found: --remote reads its named remotes from it; copy remote.example.yaml "
                         f"to {path} and fill in your remote") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}; check its permissions") from None
    except yaml.reader.ReaderError as exc:  # a byte that is not UTF-8 (it was a UnicodeDecodeError traceback)
        if exc.encoding != "unicode":  # YAML's check of the decoded text names its encoding "unicode"
            raise UsageError(f"{path} is not UTF-8 text (byte {exc.position} is 0x{exc.character:02x}); save it as "
                             f"UTF-8 ({EXAMPLE})") from None
        raise UsageError(f"{path} holds the control character {chr(exc.character)!r} (character {exc.position}), "
                         f"which YAML does not allow; remove it ({EXAMPLE})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path} is not valid YAML{at} ({getattr(exc, 'problem', None) or exc}); fix the "
                         f"file ({EXAMPLE})") from None
    _bounded(doc, path)
    if not isinstance(doc, dict):
        raise UsageError(f"{path} is not a mapping with a `remotes:` section; {EXAMPLE}")
    unknown = sorted(set(doc) - {"version", "remotes"})
    if unknown:
        raise UsageError(f"{path}: top-level field {unknown[0]} is not known; the top level holds version and "
                         f"remotes ({EXAMPLE})")
    version = doc.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise UsageError(f"{path}: version {version!r}; this kprof reads version {CONFIG_VERSION}: set version: "
                         f"{CONFIG_VERSION}, or upgrade kprof")
    remotes = doc.get("remotes")
    if not isinstance(remotes, dict) or not remotes:
        raise UsageError(f"{path}: `remotes:` is missing or empty; add a mapping of named remotes ({EXAMPLE})")
    return remotes


def load_remote(name: str, path: str = CONFIG, overrides: list[str] | tuple = ()) -> Remote:
    """The remote `name` of the YAML file at `path`, with `overrides` (`--remote-set KEY=VALUE`, KEY one of FIELDS)
    applied for this call. Every field is checked: a bad one is a UsageError naming the file, remote, field and
    fix. Only the section of the remote's kind (launch.ray or launch.slurm) must be complete."""
    if not name or not name.strip():
        raise UsageError("--remote is empty; pass the name of a remote of remote.yaml")
    remotes = _read(path)
    if name not in remotes:
        raise UsageError(f"{path} has no remote {name!r}; it has {', '.join(map(repr, remotes))}: pass one of "
                         f"those to --remote, or add {name!r} to {path}")
    doc = remotes[name]
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: remote {name!r} is {doc!r}, not a mapping of its fields ({EXAMPLE})")
    values = {k: _checked(where(path, name, k), FIELDS[k], v, raw=False)
              for k, v in _flatten(path, name, doc).items()}
    for item in overrides:
        key, value = _override(item)
        values[key] = _checked(f"--remote-set {key}", FIELDS[key], value, raw=True)
    kind = values.get("kind")
    if kind is None:
        raise UsageError(f"{where(path, name, 'kind')} is missing; set kind: ray or kind: slurm")
    kind_given = any(_override(item)[0] == "kind" for item in overrides)
    for item in overrides:  # one for the other engine's section changed nothing this call uses
        key = _override(item)[0]
        if key.startswith("launch.") and key.split(".")[1] != kind:
            other = key.split(".")[1]
            fix = (f"--remote-set kind={kind} made it so; drop one of the two" if kind_given else
                   f"set launch.{kind} fields, or pass --remote-set kind={other} too")
            raise UsageError(f"--remote-set {key} applies to kind {other}, and remote {name!r} is kind {kind}, which "
                             f"reads launch.{kind}: {fix}")

    def section(engine: str, required: str, fix: str) -> dict | None:
        """The fields of launch.<engine>; the section of the remote's kind must have `required`. A section of the
        other kind is kept only when complete (so that --remote-set kind=... can switch to it)."""
        prefix = f"launch.{engine}."
        fields = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        if required not in fields:
            if kind == engine:
                raise UsageError(f"{where(path, name, prefix + required)} is missing; {fix}")
            return None
        return fields

    ray = section("ray", "address", 'set it to "local", "auto" or "ray://HOST:10001"')
    slurm = section("slurm", "time", "set each job's time limit in minutes, e.g. time: 60")
    if kind == "slurm" and slurm.get("cluster", "slurm") == "slurm" and "partition" not in slurm:
        raise UsageError(f"{where(path, name, 'launch.slurm.partition')} is missing; set the Slurm partition "
                         f"(or launch.slurm.cluster: local to run the jobs on this machine)")
    address = ray["address"] if kind == "ray" else "local"
    if address not in ("local", "auto") and not (address.startswith("ray://") and address[6:].strip()):
        field = "launch.ray.address"
        given = where(path, name, field, overrides)
        raise UsageError(f"{given} is {address!r}, not \"local\", \"auto\" or ray://HOST:PORT: Ray takes a bare "
                         f"HOST:PORT for a node of the cluster and waits for it for good (Ctrl-C does not stop it); "
                         f"give ray://HOST:10001 (Ray Client on the head), or \"auto\" on a node of the cluster")
    if kind == "ray" and "num_cpus" in ray and ray["address"] != "local":
        raise UsageError(f"{where(path, name, 'launch.ray.num_cpus')} applies only to address \"local\" (a cluster "
                         f"started here); {ray['address']!r} names a running cluster: remove num_cpus")
    return Remote(name, path, kind, values.get("workers"), RaySettings(**ray) if ray else None,
                  SlurmSettings(**slurm) if slurm else None, list(overrides))
