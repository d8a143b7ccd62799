"""Output: one JSON document on stdout with --json; readable tables otherwise; messages on stderr."""

from __future__ import annotations

import sys

import msgspec

_json = msgspec.json.Encoder(order="deterministic")


def emit_json(doc) -> None:
    sys.stdout.buffer.write(msgspec.json.format(_json.encode(doc), indent=2) + b"\n")
    sys.stdout.flush()


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal (pipes, logs, tests), rich would wrap tables at 80 columns: give them room instead.
    width = None if stream.isatty() else 200
    return Console(file=stream, highlight=False, soft_wrap=True, width=width)


def error(message: str) -> None:
    console(stderr=True).print(f"[bold red]error:[/] {message}", markup=True)
