"""`kprof list`: every (table, backend) with its args, kind, metric family, env, contract and read functions."""

from __future__ import annotations

from ..runners.registry import entries
from ._options import Json
from ._render import console, emit_json


def list_(*, json: Json = False) -> int:
    """List every table/backend pair kprof can measure."""
    docs = [e.describe() for e in entries()]
    if json:
        emit_json({"count": len(docs), "entries": docs})
        return 0
    from rich.table import Table

    table = Table("table", "backend", "kernel_kind", "args", "metric_family", "subprocess_env", "get_fn / count_fn",
                  "profiler_revision")
    for d in docs:
        table.add_row(d["table"], d["backend"], d["kernel_kind"], ", ".join(d["args"]), d["metric_family"],
                      d["subprocess_env"], f"{d['get_fn']}\n{d['count_fn']}", str(d["contract"]["profiler_revision"]))
    console().print(table)
    return 0
