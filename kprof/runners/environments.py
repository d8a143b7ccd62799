"""The environments backends measure in: the Python, packages and CUDA a worker needs, checked before it measures.

Each registry entry names one by `Entry.subprocess_env`; `kprof list` shows it (`--environments`: each one and
whether this machine satisfies it). `require(entry)` is called by `worker.prepare_device`, so every path that
measures (in-process run, pool workers, remote chunks) refuses, before anything is opened or written, to measure
in an environment that differs, naming each difference and its fix. KPROF_SKIP_ENV_CHECK=1 skips the check: it
is for debugging a runner in an environment being put together, not for producing rows (nothing records that
it was skipped).

These are requirements on the interpreter a worker runs in, not `kprof.ledger.events.Environment` (the record
of what one row ran on). Package versions are read with importlib.metadata; only the CUDA requirement imports
torch (torch.version.cuda), and only when torch is installed.
"""

from __future__ import annotations

import importlib.metadata
import platform

import msgspec
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..settings import environ

__all__ = ["Package", "Environment", "ENVIRONMENTS", "DEFAULT", "CUDA", "lookup", "check", "require", "SKIP_VAR"]

SKIP_VAR = "KPROF_SKIP_ENV_CHECK"
# Where a CUDA build of torch comes from; the message of a CPU-only torch names it.
_TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"


class Package(msgspec.Struct, frozen=True):
    """One distribution a worker needs, by its pip name."""

    name: str  # the distribution name pip installs, e.g. "nvidia-ml-py" (which provides the module pynvml)
    specifier: str = ""  # PEP 440, e.g. ">=2.4"; "" accepts any version
    timers: tuple[str, ...] = ()  # only these timers need it (e.g. ("cupti",)); () every measurement does
    purpose: str = ""

    def __post_init__(self):
        SpecifierSet(self.specifier)  # raises InvalidSpecifier: a definition that does not parse fails at import


class Environment(msgspec.Struct, frozen=True):
    """What a backend needs to measure. `cuda` is a PEP 440 specifier on the CUDA version torch was built with
    (torch.version.cuda); None: any torch build, CPU-only included. `image` is the container image a container
    or remote runtime would run the worker in; None: the worker runs on the host interpreter (kprof has no
    container runtime yet, so nothing reads it but `kprof list`)."""

    name: str
    description: str
    python: str = ">=3.11"  # PEP 440 specifier on platform.python_version(); pyproject.toml's requires-python
    packages: tuple[Package, ...] = ()
    cuda: str | None = None
    image: str | None = None

    def __post_init__(self):
        SpecifierSet(self.python), SpecifierSet(self.cuda or "")  # as Package: a bad specifier fails at import


_TORCH = Package("torch", ">=2.4", purpose="builds the inputs and runs the kernels")

DEFAULT = Environment(
    name="default_env", description="CPU backends: torch of any build, timed by the wall clock",
    packages=(_TORCH,))

# nvidia-ml-py is required for every CUDA row: without NVML a row has no energy_j, no telemetry and no thermal and
# power protocol, which the CUDA contract (catalog.GPU_REVISION) states every row is timed under. cupti-python is
# needed by the cupti timer only; KPROF_TIMER=events times with CUDA events instead (rows under their own key).
CUDA = Environment(
    name="cuda_env", description="CUDA backends: a CUDA 12+ build of torch, NVML, and CUPTI for the cupti timer",
    packages=(_TORCH,
              Package("nvidia-ml-py", ">=12", purpose="GPU identity, telemetry, energy and the power protocol"),
              Package("cupti-python", ">=12", timers=("cupti",), purpose="per-kernel GPU time (the cupti timer)")),
    cuda=">=12")

ENVIRONMENTS: dict[str, Environment] = {e.name: e for e in (DEFAULT, CUDA)}


def lookup(name: str) -> Environment | None:
    """The environment called `name`, or None when none is defined."""
    return ENVIRONMENTS.get(name)


def check(name: str, *, timer: str | None = None, only_timer: bool = False) -> list[str]:
    """The differences between this process's environment and environment `name`, one sentence each, naming what
    is required, what is installed (or missing) and the fix; [] when it satisfies it. `timer`: the timer the
    measurement uses (packages only other timers need are skipped); None checks every package. `only_timer`: the
    caller times with `timer` alone (`kprof measure`: CUPTI), so another timer is not offered as a way round."""
    env = lookup(name)
    if env is None:
        return [f"environment {name!r} is not defined (defined: {', '.join(sorted(ENVIRONMENTS))}); name one of "
                f"those in the entry's subprocess_env, or define it in kprof.runners.environments.ENVIRONMENTS"]
    python = platform.python_version()
    diffs = []
    if not _satisfies(python, env.python):
        diffs.append(f"{name} needs Python {env.python} and this is Python {python}: run the worker on a Python "
                     f"{env.python} interpreter")
    installed = {}
    for package in env.packages:
        if package.timers and timer is not None and timer not in package.timers:
            continue
        installed[package.name] = version = _installed(package.name)
        diff = _package_difference(name, package, version, offer_other=not only_timer)
        if diff:
            diffs.append(diff)
    if env.cuda is not None and installed.get("torch") is not None:
        diff = _cuda_difference(name, env.cuda)
        if diff:
            diffs.append(diff)
    return diffs


def skipped() -> bool:
    """Whether KPROF_SKIP_ENV_CHECK=1 asks to skip the check; a value other than 0, 1 or unset is a UsageError (a
    `true` or `yes` would otherwise check silently)."""
    raw = environ().get(SKIP_VAR, "").strip()
    if raw not in ("", "0", "1"):
        from ..errors import UsageError

        raise UsageError(f"{SKIP_VAR}={raw!r} is not 0 or 1; {SKIP_VAR}=1 skips the environment check, or unset it")
    return raw == "1"


def require(entry, only_timer: str | None = None) -> None:
    """Raises UsageError naming every difference between this process and the entry's environment (see `check`),
    for the entry's timer (`only_timer`: the one timer the caller can use); a no-op when KPROF_SKIP_ENV_CHECK=1."""
    if skipped():
        return
    timer = entry.contract.timing.split(";")[0] or None  # catalog.parse_timing's timer (_entry imports this module)
    diffs = check(entry.subprocess_env, timer=only_timer or timer, only_timer=only_timer is not None)
    if diffs:
        from ..errors import UsageError

        raise UsageError(f"{entry.table}/{entry.backend} measures in environment {entry.subprocess_env!r}, and this "
                         f"one differs: " + "; ".join(diffs)
                         + f" (`kprof list --environments` shows each environment; {SKIP_VAR}=1 skips this check "
                           f"to debug a runner, not to produce rows)")


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _satisfies(version: str, specifier: str) -> bool:
    """Whether `version` meets the PEP 440 `specifier`. Pre-releases count (a torch nightly is a torch); a local
    label ("2.5.1+cu124") is ignored by the comparison, as PEP 440 says."""
    if not specifier:
        return True  # any version, even one that is not PEP 440
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _package_difference(env: str, package: Package, version: str | None, offer_other: bool = True) -> str | None:
    wanted = f"{package.name}{package.specifier}"
    only = ""
    if package.timers and offer_other:
        other = "events" if "events" not in package.timers else "cupti"
        only = f" (only the {'/'.join(package.timers)} timer needs it; KPROF_TIMER={other} times without it)"
    if version is None:
        return f"{env} needs {wanted} and {package.name} is not installed: pip install '{wanted}'{only}"
    if _satisfies(version, package.specifier):
        return None
    return f"{env} needs {wanted} and {package.name} {version} is installed: pip install '{wanted}'{only}"


def _cuda_difference(env: str, specifier: str) -> str | None:
    """The CUDA requirement against the CUDA version torch was built with (imports torch: workers have already)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a torch that does not import is the difference, reported as text
        from .._limits import hit  # a process limit (ulimit -v: its libraries cannot be mapped), not the build

        return f"{env} needs torch built with CUDA {specifier} and torch does not import" + (
            f" ({type(e).__name__}: {e}): reinstall a CUDA build of torch" if hit(e) is None else f": {hit(e)}")
    cuda = torch.version.cuda
    fix = f"install a CUDA {specifier} build of torch, e.g. pip install torch --index-url {_TORCH_CUDA_INDEX}"
    if cuda is None:
        return f"{env} needs torch built with CUDA {specifier} and torch {torch.__version__} is a build without CUDA " \
               f"(torch.version.cuda is None): {fix}"
    if not _satisfies(cuda, specifier):
        return f"{env} needs torch built with CUDA {specifier} and torch {torch.__version__} is built with CUDA " \
               f"{cuda}: {fix}"
    return None
