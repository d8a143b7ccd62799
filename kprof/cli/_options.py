"""Options shared by the verbs, declared once."""

from __future__ import annotations

from typing import Annotated

from cyclopts import Parameter

Db = Annotated[str | None, Parameter(name="--db", help="Ledger file. Default: $KPROF_DB, else ./profile.db.")]
Json = Annotated[bool, Parameter(name="--json", negative="", help="Print one JSON document on stdout.")]
GpuName = Annotated[str | None, Parameter(name="--gpu-name", help="GPU key of the rows (a DB key and filter, "
                                          "never a device selector). Default: the local device's name.")]
Table = Annotated[str, Parameter(help="The table, e.g. single_gemm (see `kprof list`).")]
Backend = Annotated[str, Parameter(name="--backend", help="The backend, e.g. torch-cpu (see `kprof list`).")]
Spec = Annotated[list[str] | None, Parameter(name="--spec", consume_multiple=False,
                                             help="One spec as a JSON object of the table's KernelArgs; repeatable.")]
Specs = Annotated[str | None, Parameter(name="--specs", help="A file of specs: a JSON object, a JSON list, "
                                        "{\"specs\": [...]}, or JSONL.")]
OutputDir = Annotated[str | None, Parameter(name="--output-dir", help="Write request.json, results.json, "
                                            "curve.json and job.meta.json there, once, read-only.")]
