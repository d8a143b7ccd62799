"""`kprof list`: every (table, backend) with its args, kind, metric family, env, contract and read functions;
`--environments`: each environment a backend names, and whether this machine satisfies it."""

from __future__ import annotations

from json import dumps
from typing import Annotated

from cyclopts import Parameter

from ..runners.registry import entries
from ._options import Json
from ._render import console, emit_json, stdout_to_stderr

Environments = Annotated[bool, Parameter(name="--environments", negative="", help=(
    "List each environment the backends name (Python, packages, CUDA, image) and whether this machine satisfies "
    "it, with the differences. Imports torch to read its CUDA version."))]


def list_(*, json: Json = False, environments: Environments = False) -> int:
    """List every table/backend pair kprof can measure."""
    if environments:
        return _environments(json)
    with stdout_to_stderr(json):  # a KPROF_RUNNERS module's print when imported: stdout is the document's alone
        docs = [e.describe() for e in entries()]
    if json:
        emit_json({"count": len(docs), "entries": docs})
        return 0
    from rich.table import Column, Table

    # Nothing is cut on a narrow terminal (rich's default ends a cell with "…"): cells fold, and the table and backend
    # names, which every other verb takes, are printed whole.
    whole = {"table": max(len(d["table"]) for d in docs), "backend": max(len(d["backend"]) for d in docs)}
    table = Table(*(Column(name, overflow="fold", min_width=whole.get(name)) for name in (
        "table", "backend", "kernel_kind", "args", "metric_family", "subprocess_env", "get_fn / count_fn",
        "profiler_revision")))
    for d in docs:
        args = ", ".join(f"{a}={dumps(d['defaults'][a])}" if a in d["defaults"] else a for a in d["args"])
        table.add_row(d["table"], d["backend"], d["kernel_kind"], args, d["metric_family"],
                      d["subprocess_env"], f"{d['get_fn']}\n{d['count_fn']}", str(d["contract"]["profiler_revision"]))
    console().print(table)
    return 0


def _environments(json: bool) -> int:
    """Each environment with the backends that name it and this machine's differences from it ([]: satisfied)."""
    import msgspec
    from rich.text import Text

    from ..runners import environments as envs

    with stdout_to_stderr(json):  # what a KPROF_RUNNERS module or torch prints when imported goes to stderr
        used: dict[str, list[str]] = {}
        for e in entries():
            used.setdefault(e.subprocess_env, []).append(f"{e.table}/{e.backend}")
        names = list(envs.ENVIRONMENTS) + [n for n in used if n not in envs.ENVIRONMENTS]
        docs = []
        for name in names:
            env = envs.lookup(name)
            differences = envs.check(name)
            docs.append({"name": name, "environment": None if env is None else msgspec.to_builtins(env),
                         "satisfied": not differences, "differences": differences, "entries": used.get(name, [])})
    if json:
        emit_json({"count": len(docs), "environments": docs})
        return 0
    out = console()
    for d in docs:
        env = d["environment"] or {}
        out.print(Text.assemble((d["name"], "bold"), f": {env.get('description', 'not defined')}"), highlight=False)
        packages = ", ".join(p["name"] + p["specifier"] + (f" ({'/'.join(p['timers'])} timer only)" if p["timers"]
                                                           else "") for p in env.get("packages", []))
        out.print(f"  python {env.get('python', '?')}; packages: {packages or 'none'}; "
                  f"cuda: {env.get('cuda') or 'not needed'}; image: {env.get('image') or 'none (host interpreter)'}",
                  highlight=False, markup=False)
        out.print(f"  used by {len(d['entries'])} entr{'y' if len(d['entries']) == 1 else 'ies'}", highlight=False)
        if d["satisfied"]:
            out.print("  this machine: satisfies it", highlight=False)
        else:
            out.print("  this machine: differs", highlight=False)
            for diff in d["differences"]:
                out.print(f"    - {diff}", highlight=False, markup=False)
    return 0
