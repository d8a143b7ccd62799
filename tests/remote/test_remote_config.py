"""remote.yaml and --remote-set: every bad file, remote, field or override is a UsageError (exit 2) naming it and
the fix, raised before anything is written; --db is refused with --remote and --output-dir is required."""

from __future__ import annotations

import os

import pytest

from kprof.cli._remote import run_remote_cli
from kprof.errors import UsageError
from kprof.runners.remote_config import FIELDS, load_remote

GOOD = """
remotes:
  ray1:
    kind: ray
    launch:
      ray: {address: local, num_cpus: 2}
  slurm1:
    kind: slurm
    launch:
      slurm: {partition: gpu, time: 60, gpus_per_node: 1}
"""


def _cli(**kw):
    args = dict(remote="r", remote_set=[], output_dir="out", mode="jit", gpu_name=None, db=None, timer=None,
                l2=None, cuda_graph=None, power=None, json=True, command="kprof run")
    args.update(kw)
    return run_remote_cli("single_gemm", "torch-cpu", [{"m": 1, "n": 64, "k": 64, "dtype": "fp32"}], **args)


def _refused(ledger, **kw) -> str:
    """Runs the CLI function, which must refuse with exit 2 and write nothing; the message."""
    with pytest.raises(UsageError) as info:
        _cli(**kw)
    assert info.value.exit_code == 2
    assert not os.path.exists("out") and not os.path.exists(ledger)
    return str(info.value)


def test_the_example_file_is_valid_and_lists_every_field():
    here = os.path.dirname(__file__)
    example = os.path.join(here, "..", "..", "remote.example.yaml")
    with open(example) as f:
        text = f.read()
    for field in FIELDS:
        assert field.rsplit(".", 1)[-1] + ":" in text and field in text, field
    for name in ("h200-ray", "local-ray", "h200-slurm"):
        assert load_remote(name, example).name == name


def test_overrides_apply_for_one_call(remote_yaml):
    path = remote_yaml(GOOD)
    r = load_remote("slurm1", path, ["launch.slurm.time=30", "workers=4", "launch.slurm.account=proj"])
    assert (r.slurm.time, r.workers, r.slurm.account, r.slurm.partition) == (30, 4, "proj", "gpu")
    assert r.overrides == ["launch.slurm.time=30", "workers=4", "launch.slurm.account=proj"]
    assert load_remote("slurm1", path).slurm.time == 60  # the file is unchanged
    assert load_remote("slurm1", path, ["launch.slurm.time= 010 "]).slurm.time == 10  # decimal, as YAML 1.2 reads it
    r = load_remote("ray1", path, ["launch.ray.runtime_env={env_vars: {A: b}}", "launch.ray.address=local"])
    assert r.ray.runtime_env == {"env_vars": {"A": "b"}}
    # a complete section of the other kind: the kind can be switched for one call
    both = GOOD + "  both:\n    kind: ray\n    launch:\n      ray: {address: auto}\n      slurm: {partition: p, time: 5}\n"
    assert load_remote("both", remote_yaml(both), ["kind=slurm"]).kind == "slurm"


@pytest.mark.parametrize("text, overrides, expected", [
    (None, [], ["remote.yaml not found", "copy remote.example.yaml"]),
    ("remotes: [1, 2\n", [], ["remote.yaml is not valid YAML at line", "fix the file"]),
    ("- a\n", [], ["remote.yaml is not a mapping with a `remotes:` section"]),
    # PyYAML kept the last of a key given twice: a remote copied under its old name replaced it unseen
    ("remotes:\n  r: {kind: ray, launch: {ray: {address: local}}}\n  r: {kind: ray, launch: {ray: {address: auto}}}\n",
     [], ["remote.yaml is not valid YAML at line 3 ('r' is given twice in one mapping (lines 2 and 3); keep one)"]),
    ("remotes: {r: {kind: ray, workers: 2, workers: 3, launch: {ray: {address: local}}}}\n", [],
     ["'workers' is given twice in one mapping"]),
    ("version: 2\nremotes: {r: {kind: ray}}\n", [], ["version 2", "set version: 1"]),
    ("remote: {}\n", [], ["top-level field remote is not known"]),
    ("remotes: {}\n", [], ["`remotes:` is missing or empty"]),
    ("remotes: {other: {kind: ray}}\n", [], ["has no remote 'r'", "'other'", "pass one of those to --remote"]),
    ("remotes: {r: 3}\n", [], ["remote 'r' is 3, not a mapping"]),
    ("remotes: {r: {launch: {ray: {address: auto}}}}\n", [], ["remote 'r': field kind is missing", "kind: ray"]),
    ("remotes: {r: {kind: k8s}}\n", [], ["field kind is 'k8s', not one of ray, slurm"]),
    ("remotes: {r: {kind: ray}}\n", [], ["field launch.ray.address is missing", '"local", "auto"']),
    ("remotes: {r: {kind: ray, launch: {ray: {adress: auto}}}}\n", [],
     ["field launch.ray.adress is not a remote field", "address, gpus_per_worker, num_cpus, runtime_env"]),
    ("remotes: {r: {kind: ray, lanch: {}}}\n", [], ["field lanch is not a remote field", "kind, launch, workers"]),
    ("remotes: {r: {kind: ray, launch: 5}}\n", [], ["field launch is 5, not a mapping"]),
    ("remotes: {r: {kind: ray, launch: {ray: {address: 7}}}}\n", [],
     ["field launch.ray.address is 7, not a non-empty string"]),
    ("remotes: {r: {kind: ray, launch: {ray: {address: local, num_cpus: two}}}}\n", [],
     ["field launch.ray.num_cpus is 'two', not a whole number"]),
    ("remotes: {r: {kind: ray, launch: {ray: {address: auto, num_cpus: 2}}}}\n", [],
     ["field launch.ray.num_cpus applies only to address \"local\"", "remove num_cpus"]),
    ("remotes: {r: {kind: ray, launch: {ray: {address: auto, gpus_per_worker: -1}}}}\n", [],
     ["field launch.ray.gpus_per_worker is -1; give a number >= 0"]),
    ("remotes: {r: {kind: ray, launch: {ray: {address: auto, runtime_env: [a]}}}}\n", [],
     ["field launch.ray.runtime_env is ['a'], not a mapping"]),
    ("remotes: {r: {kind: ray, workers: 0, launch: {ray: {address: auto}}}}\n", [],
     ["field workers is 0; give a number >= 1"]),
    ("remotes: {r: {kind: slurm, launch: {slurm: {partition: gpu}}}}\n", [],
     ["field launch.slurm.time is missing", "time: 60"]),
    ("remotes: {r: {kind: slurm, launch: {slurm: {partition: gpu, time: 1h}}}}\n", [],
     ["field launch.slurm.time is '1h', not a whole number"]),
    # YAML 1.1 read Slurm's 1:30:00 as 5400 (minutes, base 60) and 1_0 as 10
    ("remotes: {r: {kind: slurm, launch: {slurm: {partition: gpu, time: 1:30:00}}}}\n", [],
     ["field launch.slurm.time is '1:30:00', not a whole number"]),
    ("remotes: {r: {kind: ray, workers: 1_0, launch: {ray: {address: auto}}}}\n", [],
     ["field workers is '1_0', not a whole number"]),
    ("remotes: {r: {kind: slurm, launch: {slurm: {time: 5}}}}\n", [],
     ["field launch.slurm.partition is missing", "launch.slurm.cluster: local"]),
    ("remotes: {r: {kind: slurm, launch: {slurm: {time: 5, cluster: k8s}}}}\n", [],
     ["field launch.slurm.cluster is 'k8s', not one of slurm, local, debug"]),
    (GOOD.replace("ray1", "r"), ["launch.ray.address"], ["--remote-set 'launch.ray.address' is not KEY=VALUE"]),
    (GOOD.replace("ray1", "r"), ["launch.ray.adress=auto"],
     ["--remote-set launch.ray.adress: not a field of a remote", "launch.slurm.time"]),
    (GOOD.replace("ray1", "r"), ["launch.slurm.time=soon"],
     ["--remote-set launch.slurm.time is 'soon', not a whole"]),
    (GOOD.replace("ray1", "r"), ["kind=k8s"], ["--remote-set kind is 'k8s', not one of ray, slurm"]),
    (GOOD.replace("ray1", "r"), ["workers=1_0"], ["--remote-set workers is '1_0', not a whole number"]),  # int() took
    (GOOD.replace("ray1", "r"), ["workers=\u0663"], ["--remote-set workers is '\u0663', not a whole number"]),  # them
    (GOOD.replace("ray1", "r"), ["launch.ray.runtime_env={pip: [x]"],  # was "is None, not a mapping"
     ["--remote-set launch.ray.runtime_env is '{pip: [x]', not valid YAML", "give a mapping"]),
    (GOOD.replace("ray1", "r"), ["kind=slurm"], ["field launch.slurm.time is missing"]),
    (GOOD.replace("ray1", "r"), ["launch.slurm.time=30"],  # was taken, and changed nothing
     ["--remote-set launch.slurm.time applies to kind slurm, and remote 'r' is kind ray", "--remote-set kind=slurm"]),
    (GOOD.replace("ray1", "r"), ["kind=slurm", "launch.ray.num_cpus=2"],  # was told to pass kind=ray too
     ["--remote-set launch.ray.num_cpus applies to kind ray, and remote 'r' is kind slurm, which reads launch.slurm: "
      "--remote-set kind=slurm made it so; drop one of the two"]),
])
def test_a_bad_remote_is_refused_naming_the_field_and_the_fix(remote_yaml, db, text, overrides, expected):
    if text is not None:
        remote_yaml(text)
    message = _refused(db, remote_set=overrides)
    for fragment in expected:
        assert fragment in message, message
    if text is not None and "remotes:" in text and not overrides:
        assert message.startswith(os.path.abspath("remote.yaml")) or message.startswith("remote.yaml")


def test_a_ray_address_of_another_form_is_refused(remote_yaml):
    """A bare HOST:PORT (ray:// left out) made Ray wait for that node for good, deaf to Ctrl-C and SIGTERM: refused,
    read from the file or from --remote-set, as is a ray:// with no host."""
    path = remote_yaml("remotes: {r: {kind: ray, launch: {ray: {address: 'head:6379'}}}}\n")
    with pytest.raises(UsageError, match="field launch.ray.address is 'head:6379', not \"local\", \"auto\" or "
                                         "ray://HOST:PORT.* give ray://HOST:10001"):
        load_remote("r", path)
    with pytest.raises(UsageError, match="^--remote-set launch.ray.address is 'ray://', not"):
        load_remote("r", path, ["launch.ray.address=ray://"])
    for good in ("local", "auto", "ray://head:10001"):
        assert load_remote("r", path, [f"launch.ray.address={good}"]).ray.address == good


def test_a_remote_yaml_that_is_not_utf8_text_or_not_a_file_is_refused(remote_yaml, db, tmp_path):
    """A byte that is not UTF-8 was a UnicodeDecodeError traceback (and a UTF-8 file one under a C locale, read in the
    locale's encoding), a pipe named remote.yaml waited for a writer for good, and a directory was said to need its
    permissions checked."""
    path = tmp_path / "remote.yaml"
    text = GOOD.replace("ray1", "r").encode()
    path.write_bytes(text + b"# caf\xe9\n")
    assert f"remote.yaml is not UTF-8 text (byte {len(text) + 5} is 0xe9); save it as UTF-8" in _refused(db)
    path.write_bytes(b"remotes: {r: {kind: ray}}\n\x01\n")
    assert "holds the control character '\\x01' (character 26), which YAML does not allow" in _refused(db)
    path.unlink()
    os.mkfifo(path)
    assert "remote.yaml is not a regular file (a directory, pipe or device)" in _refused(db)
    path.unlink()
    path.mkdir()
    assert "remote.yaml is not a regular file (a directory, pipe or device)" in _refused(db)


def test_db_is_refused_with_remote(remote_yaml, db):
    remote_yaml(GOOD.replace("ray1", "r"))
    message = _refused(db, db="other.db")
    assert "--db other.db cannot be used with --remote" in message and "KPROF_DB=other.db" in message
    assert not os.path.exists("other.db")
    message = _refused(db, db="my rows.db")  # as a shell takes it: `KPROF_DB=my rows.db` set it to `my`
    assert "set KPROF_DB='my rows.db' instead" in message and not os.path.exists("my rows.db")


def test_output_dir_is_required(remote_yaml, db):
    remote_yaml(GOOD.replace("ray1", "r"))
    assert "--remote needs --output-dir" in _refused(db, output_dir=None)


def test_a_bad_spec_is_refused_before_anything_is_written(remote_yaml, db):
    remote_yaml(GOOD.replace("ray1", "r"))
    with pytest.raises(UsageError) as info:
        run_remote_cli("single_gemm", "torch-cpu", [{"m": 1, "n": 64, "dtype": "fp32"}], remote="r",
                       output_dir="out", json=True)
    assert info.value.exit_code == 2 and "spec 0" in str(info.value)
    assert not os.path.exists("out") and not os.path.exists(db)


@pytest.mark.parametrize("where", ["environment", "runtime_env"])
def test_a_spec_timeout_is_refused_naming_what_bounds_a_remote_chunk(remote_yaml, db, monkeypatch, where):
    """KPROF_SPEC_TIMEOUT_S is kept by the local pool only (it kills the worker a spec hangs in): a remote run
    refuses it, here or in the Ray tasks' environment, rather than wait forever on a hung spec."""
    if where == "environment":
        monkeypatch.setenv("KPROF_SPEC_TIMEOUT_S", "30")
        remote_yaml(GOOD.replace("slurm1", "r"))
        assert "launch.slurm.time" in _refused(db)
    remote_yaml(GOOD.replace("ray1", "r"))
    overrides = ["launch.ray.runtime_env={env_vars: {KPROF_SPEC_TIMEOUT_S: '30'}}"] if where == "runtime_env" else []
    message = _refused(db, remote_set=overrides)
    assert message.startswith("KPROF_SPEC_TIMEOUT_S is set") and "no spec can be stopped" in message
    assert ("in launch.ray.runtime_env" in message) == (where == "runtime_env")


def test_slurm_on_a_machine_without_slurm_is_a_usage_error(remote_yaml, db, monkeypatch, tmp_path):
    pytest.importorskip("submitit")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no srun here
    remote_yaml(GOOD.replace("slurm1", "r"))
    message = _refused(db)
    assert message.startswith("remote 'r': cannot submit to Slurm from this machine") and "srun" in message
    assert "launch.slurm.cluster: local" in message and "\n" not in message


@pytest.mark.parametrize("folder, overrides, given", [
    ("logs", [], "remote.yaml: remote 'r': field launch.slurm.folder 'logs'"),
    (None, ["launch.slurm.folder=logs/sub"], "--remote-set launch.slurm.folder 'logs/sub'"),
])
def test_a_submitit_folder_that_cannot_be_made_is_refused_naming_it(remote_yaml, db, folder, overrides, given):
    """A file where the folder goes: it was submitit's FileExistsError traceback, exit 1."""
    pytest.importorskip("submitit")
    with open("logs", "w"):
        pass
    remote_yaml("remotes: {r: {kind: slurm, launch: {slurm: {time: 5, cluster: local%s}}}}\n"
                % (f", folder: {folder}" if folder else ""))
    message = _refused(db, remote_set=overrides)
    assert message.startswith(given) and "cannot be made" in message and "give a directory" in message, message


@pytest.mark.parametrize("module, text", [
    ("ray", GOOD.replace("ray1", "r")),
    ("submitit", "remotes: {r: {kind: slurm, launch: {slurm: {time: 5, cluster: local}}}}\n"),
    ("yaml", GOOD.replace("ray1", "r")),
])
def test_an_engine_not_installed_is_one_line_saying_how_to_install_it(remote_yaml, db, monkeypatch, module, text):
    """Without the remote extra, the engine's import (or PyYAML's) was a ModuleNotFoundError traceback (exit 1)."""
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # as where it is not installed: its import fails
    remote_yaml(text)
    message = _refused(db)
    assert message.startswith("--remote reads remote.yaml with PyYAML, which is not installed here" if module == "yaml"
                              else f"remote 'r' is kind {'ray' if module == 'ray' else 'slurm'}, and {module} is not "
                                   f"installed here") and "pip install '.[remote]'" in message, message
    assert {"yaml": "pip install 'pyyaml>=6'", "ray": "pip install 'ray[client]>=2.10'",
            "submitit": "pip install 'submitit>=1.5.4'"}[module] in message, message


def test_the_remote_extra_installs_the_ray_client():
    """A ray:// address connects through Ray Client, which the plain `ray` package lacks (Ray's docs: "Ray Client
    requires pip package ray[client]")."""
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.replace(" ", "").startswith("ray[client]") for r in extras["remote"]), extras["remote"]



# Nine lists of ten aliases of the one before: 10**9 strings expanded, in a few lines (a "billion laughs").
LAUGHS = ("{l0: &a0 [lol], " + ", ".join(f"l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10))
          + "}")
HOLDER = f"  holder: {{kind: ray, launch: {{ray: {{address: local, runtime_env: {LAUGHS}}}}}}}\n"


@pytest.mark.parametrize("text, overrides", [
    ("remotes:\n" + HOLDER + "  r: {kind: *a9}\n", []),  # its repr in the error took hours
    ("remotes:\n" + HOLDER.replace("holder", "r"), []),  # sent to Ray, and written to remote-run.json
    ("remotes: {r: {kind: ray, launch: {ray: {address: local, runtime_env: &c {a: [*c]}}}}}\n", []),  # holds itself
    (GOOD.replace("ray1", "r"), ["launch.ray.runtime_env=&c {a: [*c]}"]),
])
def test_aliases_that_expand_without_bound_are_refused_before_anything_walks_them(remote_yaml, text, overrides):
    """A remote.yaml whose aliases expand to a billion values loads in a few lines, and then hung the run for hours or
    took all memory; an alias of a mapping holding it was a RecursionError where it was sent. Refused, one line,
    nothing written."""
    path = remote_yaml(text)
    with pytest.raises(UsageError, match=r"values once its aliases \(\*name\) are expanded, or an alias names a "
                                         r"mapping or list that holds it; write the values out") as info:
        load_remote("r", path, overrides)
    assert info.value.exit_code == 2


def test_aliases_within_bounds_still_share_a_value(remote_yaml):
    ray = "{kind: ray, launch: {ray: {address: local, runtime_env: %s}}}"
    path = remote_yaml(f"remotes:\n  r: {ray % '&e {env_vars: {A: b}}'}\n  s: {ray % '*e'}\n")
    assert load_remote("s", path).ray.runtime_env == {"env_vars": {"A": "b"}}
