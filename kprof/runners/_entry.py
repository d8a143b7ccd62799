"""A registry entry: one (table, backend) kprof can measure, with its contract. Imports no measurement library."""

from __future__ import annotations

import importlib
from typing import Literal

import msgspec

from ..errors import UsageError
from ..ledger.events import Contract

__all__ = ["Entry", "METRICS"]

# The metrics of each family, in the order the contract lists them.
METRICS = {"compute": ("time_ms", "tflops", "memory_bandwidth_gbps", "energy_j"),
           "comm": ("time_ms", "algbw_gbps", "busbw_gbps", "message_size_bytes", "energy_j")}


class Entry(msgspec.Struct, frozen=True):
    table: str
    backend: str
    args: type  # the KernelArgs Struct of the table
    kernel_kind: str  # e.g. "gemm", "norm", "activation", "attention"
    metric_family: Literal["compute", "comm"]
    contract: Contract
    runner: str  # "module:Class", imported lazily
    device: Literal["cpu", "cuda"] = "cpu"
    subprocess_env: str = "default_env"
    gpus: int = 1  # devices one spec needs
    gpus_arg: str = ""  # or the KernelArgs field that says how many (a collective's world_size)
    description: str = ""

    @property
    def get_fn(self) -> str:
        return f"kprof.perf_api.get_{self.table}"

    @property
    def count_fn(self) -> str:
        return f"kprof.perf_api.count_{self.table}"

    def load_runner(self):
        """The runner class `runner` names; a UsageError naming the entry where it does not import (a plugin's typo,
        or a package its module needs that is not installed), not a traceback."""
        module, _, name = self.runner.partition(":")
        where = f"table {self.table!r} backend {self.backend!r} names runner {self.runner!r}"
        if not (module and name):
            raise UsageError(f"{where}; name it as 'module:Class' (e.g. 'mypkg.kernels:Softmax')")
        try:
            found = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise UsageError(f"{where}, whose module does not import ({e}); fix the name, or install what it "
                             f"needs") from None
        except AttributeError:
            raise UsageError(f"{where}, and module {module!r} has no {name!r}; fix the name") from None
        if not (isinstance(found, type) and callable(getattr(found, "build", None))):
            raise UsageError(f"{where}, which is not a class with a build(spec, device) method; name the runner's "
                             f"class")
        return found

    def make_runner(self):
        """An instance of the runner class (made with no arguments), or a UsageError saying why not."""
        cls = self.load_runner()
        try:
            return cls()
        except TypeError as e:
            raise UsageError(f"table {self.table!r} backend {self.backend!r}: runner {self.runner!r} cannot be "
                             f"made with no arguments ({e}); kprof calls {cls.__name__}() and then its build(spec, "
                             f"device)") from None

    def describe(self) -> dict:
        """Everything `kprof list` shows, with field names."""
        fields = msgspec.inspect.type_info(self.args).fields
        return {
            "table": self.table, "backend": self.backend, "kernel_kind": self.kernel_kind,
            "args": [f.name for f in fields],
            "arg_types": {f.name: _type_name(f.type) for f in fields},
            "defaults": {f.name: _default(f) for f in fields if not f.required},  # what a spec may leave out
            "metric_family": self.metric_family, "subprocess_env": self.subprocess_env,
            "get_fn": self.get_fn, "count_fn": self.count_fn, "device": self.device,
            "gpus": self.gpus_arg or self.gpus,  # a number, or the spec field that gives it
            "contract": msgspec.structs.asdict(self.contract), "runner": self.runner,
            "description": self.description, "environment": _environment(self.subprocess_env),
        }


def _default(field) -> object:
    """A field's default value as JSON shows it (a spec that leaves the field out is keyed with it)."""
    return msgspec.to_builtins(field.default if field.default_factory is msgspec.NODEFAULT else field.default_factory())


def _environment(name: str) -> dict | None:
    """The environment `name` as `kprof list --json` shows it (None when it is not defined; a worker refuses it)."""
    from .environments import lookup

    env = lookup(name)
    return None if env is None else msgspec.to_builtins(env)


def _type_name(t) -> str:
    inspect = msgspec.inspect
    if isinstance(t, inspect.LiteralType):
        return "one of " + ", ".join(map(repr, t.values))
    if isinstance(t, inspect.IntType):
        return "int > 0" if t.gt == 0 else "int"
    return {inspect.BoolType: "bool", inspect.StrType: "str", inspect.FloatType: "float"}.get(type(t), str(t))
