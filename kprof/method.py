"""The method and the GPU key a request measures and reads with: `effective_entry` (the timing method of CUDA
rows, from --timer/--l2/--cuda-graph/--power or their KPROF_* defaults) and `resolve_gpu_key`. Below both
`kprof.api` and `kprof.ceilings`, which each need them. A bad setting is a SettingError worded twice: with the
keyword arguments of the Python API (`timer='x'`) and with the verbs' flags (`--timer x`)."""

from __future__ import annotations

import functools

import msgspec

from ._children import cpus
from .errors import SettingError, UsageError
from .runners.registry import Entry, or_on_cpu
from .settings import environ
from .specs import is_text

__all__ = ["effective_entry", "resolve_gpu_key", "check_method_env", "refused", "cpu_threads"]


_FLAGS = {"timer": "--timer", "l2": "--l2", "power": "--power", "cuda_graph": "--cuda-graph",
          "gpu_name": "--gpu-name", "gpu_key": "--gpu-name"}
_NOTHING = object()


def _as_flag(name: str, value=_NOTHING, typed: bool = False) -> str:
    """A setting as a verb's flag: `--timer x`, `--cuda-graph`/`--no-cuda-graph`; `typed`: the value as the caller
    gave it (its repr)."""
    flag = _FLAGS[name]
    if value is _NOTHING:
        return flag
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    shown = repr(value) if typed or (isinstance(value, str) and (" " in value or not value)) else value
    return f"{flag} {shown}"


def _as_keyword(name: str, value=_NOTHING, typed: bool = False) -> str:
    """A setting as a keyword argument of the Python API: `timer='x'`, `cuda_graph=True`."""
    return name if value is _NOTHING else f"{name}={value!r}"


def refused(say) -> SettingError:
    """`say(arg)` words the message, `arg(name, value=..., typed=False)` naming a setting; it is worded for both."""
    return SettingError(say(_as_keyword), cli=say(_as_flag))


def resolve_gpu_key(entry: Entry, gpu_name: str | None, measures: bool = False, keyword: str = "gpu_name") -> str:
    """The GPU key: --gpu-name when given, else the name of the device the entry measures on. `measures`: the caller
    measures here, so a missing GPU is not mended by --gpu-name (which only names rows). `keyword`: the Python
    argument that carries it, for the messages (perf_api's is gpu_key)."""
    if gpu_name is not None:
        if not isinstance(gpu_name, str):
            raise refused(lambda arg: f"{arg(keyword, gpu_name, typed=True)} is not a GPU key "
                                       f"({type(gpu_name).__name__}); pass it as a str, e.g. "
                                       f"{arg(keyword, 'NVIDIA H200')}, or omit it to use this machine's device")
        if not gpu_name.strip():
            raise refused(lambda arg: f"{arg(keyword)} is empty; pass the GPU key, e.g. "
                                       f"{arg(keyword, 'NVIDIA H200')}, or omit it")
        if not is_text(gpu_name):  # a lone surrogate: a key hashes UTF-8
            raise refused(lambda arg: f"{arg(keyword, gpu_name, typed=True)} is not UTF-8 text (a lone surrogate, as "
                                       f"Python reads a byte that is not UTF-8); pass the GPU key as text, e.g. "
                                       f"{arg(keyword, 'NVIDIA H200')}")
        return gpu_name
    if entry.device == "cuda":
        from .measure.device_name import local_gpu_name

        name = local_gpu_name()
        if name is None and measures:
            raise refused(lambda arg: f"backend {entry.backend} measures on a CUDA GPU and none is visible here; "
                                       f"run on a machine with one ({arg(keyword)} only names the rows)"
                                       f"{or_on_cpu(entry)}")
        if name is None:
            raise refused(lambda arg: f"backend {entry.backend} measures on a CUDA GPU and none is visible here; "
                                       f"pass {arg(keyword)} (e.g. {arg(keyword, 'NVIDIA H200')}) to read the rows "
                                       f"of another machine")
        return name
    from .measure.env import cpu_model

    return cpu_model()


# The CUDA timing method's settings: (keyword, environment variable, allowed values, default).
_TIMER = ("timer", "KPROF_TIMER", ("cupti", "events"), "cupti")
_L2 = ("l2", "KPROF_L2", ("cold", "warm"), "cold")
_GRAPH = ("cuda_graph", "KPROF_CUDA_GRAPH", ("0", "1"), "0")
_POWER = ("power", "KPROF_POWER", ("sustained", "loaded"), "sustained")  # kprof.runners.catalog.POWER_STATES


def _from_env(name: str, allowed: tuple[str, ...], default: str) -> str:
    value = environ().get(name, default).strip().lower() or default
    if value not in allowed:
        raise UsageError(f"{name}={environ()[name]!r} is not one of {', '.join(allowed)}; e.g. {name}={default}, or "
                         f"unset it")
    return value


def _choice(setting: tuple, given: str | None) -> str:
    """An explicit value wins over the environment variable, which wins over the default."""
    name, env, allowed, default = setting
    if given is None:
        return _from_env(env, allowed, default)
    value = given.strip().lower() if isinstance(given, str) else given
    if value not in allowed:
        raise refused(lambda arg: f"{arg(name, given, typed=True)} is not one of {', '.join(allowed)}; e.g. "
                                   f"{arg(name, default)}, or omit it to use ${env} (default {default})")
    return value


def _graph(given: bool | None) -> bool:
    if given is None:
        return _choice(_GRAPH, None) == "1"
    if not isinstance(given, bool):  # a truthy string such as "0" must not silently select graphs
        raise refused(lambda arg: f"{arg('cuda_graph', given, typed=True)} is not a bool; pass "
                                   f"{arg('cuda_graph', True)} or {arg('cuda_graph', False)}, or omit it to use "
                                   f"$KPROF_CUDA_GRAPH (default 0)")
    return given


def _refuse_on_cpu(entry: Entry, timer: str | None, l2: str | None, cuda_graph: bool | None,
                   power: str | None) -> None:
    """The CPU timer has one method (wall clock, warm caches, eager calls back to back): an explicit flag asking
    for any other is refused rather than ignored, so nobody reads CPU rows believing they were timed some other
    way. Only the explicit values are looked at: the environment variables never apply to a CPU entry."""
    if timer is None and l2 is None and cuda_graph is None and power is None:  # none asked: the CPU's one method
        return
    from .runners.catalog import parse_timing

    cpu_timer, cpu_l2, cpu_graph = parse_timing(entry.contract.timing)

    def plain(given: str) -> str:  # a value as typed: a CUDA-only or unknown one is refused with the CPU's reason
        return given.strip().lower() if isinstance(given, str) else given

    asked = []  # (setting, value)
    if timer is not None:  # no CUDA timer is the CPU's
        asked.append(("timer", plain(timer)))
    if l2 is not None and plain(l2) != cpu_l2:
        asked.append(("l2", plain(l2)))
    if cuda_graph is not None and _graph(cuda_graph) != cpu_graph:
        asked.append(("cuda_graph", cuda_graph))
    if power is not None and plain(power) != _POWER[3]:  # no heavy GEMMs heat a CPU before its calls
        asked.append(("power", plain(power)))
    if asked:
        name, value = asked[0]
        allowed = {s[0]: s[2] for s in (_TIMER, _L2, _POWER)}.get(name, (value,))
        # A value no backend takes (--l2 hot) is not said to apply to CUDA backends: it applies to none.
        what = "applies to CUDA backends" if value in allowed else f"is not one of {', '.join(allowed)} on any backend"
        calls = "each op after a barrier across the ranks" if entry.metric_family == "comm" else "back to back"
        raise refused(lambda arg: f"{arg(name, value)} {what}; {entry.backend} is timed by wall "
                                   f"clock ({cpu_timer}, L2 {cpu_l2}, {'graph' if cpu_graph else 'eager'} calls, "
                                   f"{calls}); omit {arg(name)}, or pass a CUDA backend (see `kprof list`)")


def _refuse_on_comm(entry: Entry, name: str, given, value) -> None:
    """A collective on GPUs is timed eagerly, one op per barrier, in the sustained power state (its device,
    kprof.runners._comm_device, refuses to measure it otherwise): a graph or a loaded power state asked for is
    refused on every verb, as its run refuses it, rather than read as rows no run can store. `given`: the explicit
    value, else None (the setting came from its environment variable)."""
    why = (f"{entry.table}/{entry.backend} times each collective eagerly, one op per barrier, in the sustained power "
           f"state")
    if given is None:
        env = {"cuda_graph": _GRAPH, "power": _POWER}[name][1]
        plain = _as_flag(name, False if name == "cuda_graph" else _POWER[3])
        raise UsageError(f"{env}={environ()[env].strip()} does not apply: {why}; unset {env} (or pass {plain}) for "
                         f"this backend")
    raise refused(lambda arg: f"{arg(name, value)} does not apply: {why}; omit {arg(name)}")


def check_method_env() -> None:
    """KPROF_TIMER, KPROF_L2, KPROF_CUDA_GRAPH and KPROF_POWER: a value no backend could use is a UsageError."""
    for setting in (_TIMER, _L2, _GRAPH, _POWER):
        _from_env(*setting[1:])


def cpu_threads() -> int:
    """The torch threads a torch-cpu row is measured with (named in its key): $MKL_NUM_THREADS, else
    $OMP_NUM_THREADS, as torch reads them at start-up, else the physical cores among the CPUs this process may run
    on (torch's own default is the machine's physical cores: one thread per core, not per SMT sibling). A value that
    is not a whole number >= 1 is a UsageError (torch would ignore it, and the row's key would name a count nobody
    asked for)."""
    name = thread_variable()
    if name:  # OpenMP's nested form "4,2" is valid: its first level is torch's count
        raw = environ()[name].strip()
        if not all(n.isascii() and n.isdigit() and int(n) >= 1 for n in raw.split(",")):
            raise UsageError(f"{name}={raw!r} is not a number of threads; e.g. {name}=1, or unset it to measure "
                             f"torch-cpu rows on every core this process may use")
        return int(raw.split(",")[0])
    return _cores_among(cpus())


def thread_variable() -> str | None:
    """The variable that sets the torch threads here (see cpu_threads): MKL_NUM_THREADS where set, else
    OMP_NUM_THREADS where set; None where neither is. A command a message names sets it to the count it means."""
    return next((name for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS") if environ().get(name, "").strip()), None)


@functools.lru_cache(maxsize=64)  # asked on every lookup (perf_api's get_<table>): counted once per affinity set
def _cores_among(cpus: frozenset[int]) -> int:
    """The physical cores among logical CPUs `cpus` (each CPU its own where the topology is not said). Cached by the
    set, so a changed affinity is counted afresh; `_cores_among.cache_clear()` forgets the counts (a test that
    changes what `_core_of` says)."""
    cores = [_core_of(cpu) for cpu in cpus]
    return len(cpus) if None in cores else len(set(cores))


@functools.lru_cache(maxsize=None)  # read once per CPU, not per count
def _core_of(cpu: int) -> str | None:
    """The physical core of logical CPU `cpu` (the kernel's list of its SMT siblings), or None where it is not said."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return f.read().strip() or None
    except OSError:
        return None


def effective_entry(entry: Entry, *, timer: str | None = None, l2: str | None = None,
                    cuda_graph: bool | None = None, power: str | None = None) -> Entry:
    """The entry with the timing method this process measures and reads with. On a CUDA backend each setting
    is the explicit argument (the verbs' --timer, --l2, --cuda-graph/--no-cuda-graph, --power) when given, else
    its environment variable, else the default: timer cupti|events ($KPROF_TIMER, default cupti), l2 cold|warm
    ($KPROF_L2, default cold: flushed before each call, or rotated input copies under a graph), cuda_graph
    ($KPROF_CUDA_GRAPH=0|1, default 0: eager launches), power sustained|loaded ($KPROF_POWER, default sustained:
    the kernel back to back, as in decode; loaded: each call after heavy GEMMs that hold the GPU at its power
    limit, as inside a prefill). The method is part of the key, so rows timed one way never mix with rows timed
    another, and a query reads the rows of the method it names. A CPU entry keeps its one method: the
    environment variables do not apply to it and an explicit other method is refused; a torch-cpu entry's timing
    names the torch threads its rows are measured with (`cpu_threads`). A variable's value that no
    backend could use is refused on every backend, even where a flag or the CPU's one method overrides it."""
    check_method_env()
    if entry.device != "cuda":
        _refuse_on_cpu(entry, timer, l2, cuda_graph, power)
        if entry.metric_family == "comm":  # gloo's ranks run one thread each (kprof.runners._rank)
            return entry
        from .runners.catalog import cpu_timing

        return msgspec.structs.replace(entry, contract=msgspec.structs.replace(entry.contract,
                                                                               timing=cpu_timing(cpu_threads())))
    from .runners.catalog import timing_string

    graph, state = _graph(cuda_graph), _choice(_POWER, power)
    if entry.metric_family == "comm" and (graph or state != _POWER[3]):
        _refuse_on_comm(entry, *(("cuda_graph", cuda_graph, True) if graph else ("power", power, state)))
    timing = timing_string(_choice(_TIMER, timer), _choice(_L2, l2), graph, state)
    if timing == entry.contract.timing:
        return entry
    return msgspec.structs.replace(entry, contract=msgspec.structs.replace(entry.contract, timing=timing))
