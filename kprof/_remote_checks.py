"""The checks `run --remote` makes before anything is written or submitted (kprof.remote.run_remote): settings the
remote would not keep or could not use, a Ray runtime_env Ray would refuse, an output directory that is not new."""

from __future__ import annotations

import os

from . import settings
from .errors import UsageError
from .runners.remote_config import where

__all__ = ["refuse_spec_timeout", "check_task_env", "check_runtime_env", "check_remote_output_dir"]


def _runtime_env(target) -> dict | None:
    """launch.ray.runtime_env of a Ray remote (None: none, or a Slurm remote)."""
    return target.ray.runtime_env if target.kind == "ray" and target.ray else None


def _env_vars(target) -> dict:
    """Its env_vars, where they are a mapping (else none: check_runtime_env names the mistake)."""
    env_vars = (_runtime_env(target) or {}).get("env_vars")
    return env_vars if isinstance(env_vars, dict) else {}


def refuse_spec_timeout(target) -> None:
    """KPROF_SPEC_TIMEOUT_S is kept by the local pool, which kills the worker process a spec hangs in; a remote
    chunk is measured in the engine's one process, where no spec can be stopped, so a remote run refuses it rather
    than ignore it."""
    there = "KPROF_SPEC_TIMEOUT_S" in _env_vars(target)
    if there or os.environ.get("KPROF_SPEC_TIMEOUT_S", "").strip():
        bound = ("each job's time limit, launch.slurm.time, bounds a chunk" if target.kind == "slurm" else
                 "Ray bounds no task: stop a hung run with Ctrl-C")
        raise UsageError(f"KPROF_SPEC_TIMEOUT_S is set{' in launch.ray.runtime_env' if there else ''}, but a remote "
                         f"run measures each chunk in one process, where no spec can be stopped ({bound}); unset "
                         f"KPROF_SPEC_TIMEOUT_S, or run locally")


def check_task_env(target) -> None:
    """The KPROF_* values of launch.ray.runtime_env's env_vars, which the Ray tasks see over the environment they
    inherit: checked as this machine's are (`check_settings`, the timing-method variables), before anything is
    submitted, not found by every chunk on the cluster."""
    from .method import check_method_env
    from .runners.fill import check_settings

    given = {k: v for k, v in _env_vars(target).items() if str(k).startswith("KPROF_")}
    if not given:  # the local values were checked already
        return
    for name, value in given.items():
        if not isinstance(value, str):
            raise UsageError(f"launch.ray.runtime_env env_vars {name} is {value!r}, not a string; Ray's env_vars take "
                             f"strings: quote it ({name}: '{value}')")
    try:
        with settings.given(given):  # the checks read these over this machine's environment, in this thread only
            check_settings(here=False)
            check_method_env()
    except UsageError as exc:
        raise UsageError(f"launch.ray.runtime_env env_vars: {exc}") from None


def check_runtime_env(target) -> None:
    """launch.ray.runtime_env as Ray's own RuntimeEnv reads it (env_vars a mapping of strings, pip a string or a list,
    ...), before a cluster is started or anything is written: Ray refused a bad one only as the first task was
    submitted, with a traceback (exit 1), after the output directory and the ledger had been made."""
    env = _runtime_env(target)
    if not env:
        return
    try:
        from ray.runtime_env import RuntimeEnv
    except ImportError:  # no Ray here: the executor says how to install it
        return
    try:
        RuntimeEnv(**env)
    except (TypeError, ValueError) as exc:
        field = "launch.ray.runtime_env"
        given = where(target.path, target.name, field, target.overrides)
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{given} is refused by Ray ({why}); fix it: a mapping of Ray's runtime_env fields, e.g. "
                         f"{{env_vars: {{A: b}}}}, as remote.example.yaml shows") from None


def check_remote_output_dir(output_dir: str | None) -> str:
    from .artifacts import check_output_dir

    if output_dir is None:
        raise UsageError("--remote needs --output-dir DIR: the segments, remote-run.json and any merge-report.json "
                         "go there; pass a new directory")
    check_output_dir(output_dir)
    for name in ("remote-run.json", "segments", "merge-report.json"):
        if os.path.lexists(os.path.join(output_dir, name)):
            raise UsageError(f"--output-dir {output_dir} already holds {name} of another remote run; pass a new "
                             f"directory")
    return output_dir
