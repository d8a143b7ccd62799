"""Options shared by the verbs, declared once."""

from __future__ import annotations

import math
import re
from typing import Annotated

from cyclopts import Parameter

from ..errors import UsageError


def _db_given(type_, value) -> None:
    """`--db ""` is refused by every verb (kprof.ledger.ledger_path says why), before the verb runs."""
    if value is not None:
        from ..ledger.store import ledger_path  # here: `kprof list` does not import the ledger

        ledger_path(value)


def whole(type_, tokens) -> int:
    """The converter of every int flag: a whole number only. cyclopts' own int conversion rounds (`--since 1.5`
    would be 2), so a float, an exponent or text is refused naming the flag, as a spec's 64.0 is for an int field."""
    token = tokens[-1]
    if re.fullmatch(r"[+-]?[0-9]+", token.value.strip()):
        return int(token.value)
    flag = token.keyword or "the value"
    try:
        value = float(token.value)
    except ValueError:
        value = math.nan
    near = sorted({math.floor(value), math.ceil(value)}) if math.isfinite(value) else []  # 1.5: 1 or 2
    example = f", e.g. {' or '.join(f'{flag} {n}' for n in near)}" if near else ""
    raise UsageError(f"{flag} {token.value!r} is not a whole number; pass an integer{example}")


def number(example: str):
    """The converter of a float flag, `example` its fix (`--duration-s 10`): a decimal number only, refused in one
    line naming the flag and the value as typed (cyclopts' own said "unable to convert" and pointed at --help)."""
    def convert(type_, tokens) -> float:
        token = tokens[-1]
        if re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", token.value.strip()):
            return float(token.value)
        flag = token.keyword or "the value"
        raise UsageError(f"{flag} {token.value!r} is not a number; pass a decimal number, e.g. {flag} {example}")
    return convert


Db = Annotated[str | None, Parameter(name="--db", validator=_db_given,
                                     help="Ledger file. Default: $KPROF_DB, else ./profile.db.")]
Json = Annotated[bool, Parameter(name="--json", negative="", help="Print one JSON document on stdout.")]
GpuName = Annotated[str | None, Parameter(name="--gpu-name", help="GPU key of the rows (a DB key and filter, "
                                          "never a device selector). Default: the local device's name.")]
Table = Annotated[str, Parameter(help="The table, e.g. single_gemm (see `kprof list`).")]
Backend = Annotated[str, Parameter(name="--backend", help="The backend, e.g. torch-cpu (see `kprof list`).")]
Spec = Annotated[list[str] | None, Parameter(name="--spec", consume_multiple=False, metavar="JSON",
                                             help="One spec as a JSON object of the table's KernelArgs; repeatable.")]
# allow_leading_hyphen: `--specs -` reaches the spec loader, which says stdin is not read (not "requires an argument").
Specs = Annotated[str | None, Parameter(name="--specs", allow_leading_hyphen=True, metavar="FILE", help=(
    "A file of specs: a JSON object, a JSON list, {\"specs\": [...]}, or JSONL (a file: not stdin or a pipe)."))]
OutputDir = Annotated[str | None, Parameter(name="--output-dir", help="Write request.json, results.json, "
                                            "curve.json, job.meta.json (and curve.png, with matplotlib, where a "
                                            "spec field varies) there, once, read-only.")]
# The timing method of CUDA rows (part of their key). None = the environment variable, so scripts that set
# KPROF_TIMER / KPROF_L2 / KPROF_CUDA_GRAPH / KPROF_POWER keep working; values are checked by
# kprof.api.effective_entry, one rule and one message for the CLI and the Python API.
Timer = Annotated[str | None, Parameter(name="--timer", help="CUDA timer: cupti (kernel time) or events (CUDA "
                                        "events per launch). Default: $KPROF_TIMER, else cupti.")]
L2 = Annotated[str | None, Parameter(name="--l2", help="CUDA L2 state per call: cold (flushed) or warm. "
                                     "Default: $KPROF_L2, else cold.")]
CudaGraph = Annotated[bool | None, Parameter(name="--cuda-graph", negative="--no-cuda-graph", help=(
    "Time CUDA graph replays (--no-cuda-graph: eager launches). Default: $KPROF_CUDA_GRAPH=0|1, else eager."))]
Power = Annotated[str | None, Parameter(name="--power", help=(
    "CUDA power state: loaded: each call after heavy GEMMs that hold the GPU at its power limit, as inside a "
    "prefill; sustained (default): the kernel back to back, as in decode. Default: $KPROF_POWER, else sustained."))]
