"""Options shared by the verbs, declared once."""

from __future__ import annotations

from typing import Annotated

from cyclopts import Parameter

Db = Annotated[str | None, Parameter(name="--db", help="Ledger file. Default: $KPROF_DB, else ./profile.db.")]
Json = Annotated[bool, Parameter(name="--json", negative="", help="Print one JSON document on stdout.")]
GpuName = Annotated[str | None, Parameter(name="--gpu-name", help="GPU key of the rows (a DB key and filter, "
                                          "never a device selector). Default: the local device's name.")]
