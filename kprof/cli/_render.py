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

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def error(message: str) -> None:
    console(stderr=True).print(f"[bold red]error:[/] {message}", markup=True)
