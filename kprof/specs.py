"""Spec input: repeated `--spec JSON` and `--specs PATH` (a JSON object, a JSON list, {"specs": [...]},
or JSONL). Every spec is validated against the table's KernelArgs before anything runs."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from .errors import SpecError, UsageError
from .ledger.keys import ShapeCodec

__all__ = ["read_specs", "parse_spec_texts", "parse_specs_file", "validate"]


def _decode(text: str, where: str, index: int | None):
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise SpecError(f"{where} is not valid JSON ({exc}); write it as a JSON object such as "
                        f"'{{\"m\": 128, \"n\": 256, \"k\": 64, \"dtype\": \"bf16\"}}'", index=index) from None


def parse_spec_texts(texts: list[str]) -> list[Any]:
    return [_decode(t, "--spec", i) for i, t in enumerate(texts)]


def parse_specs_file(path: str) -> list[Any]:
    if not os.path.isfile(path):
        raise UsageError(f"--specs {path}: no such file; pass the path of a JSON or JSONL file of specs")
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", errors="replace").strip()
    if not text:
        raise UsageError(f"--specs {path} is empty; it needs at least one spec")
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if len(lines) < 2:
            raise SpecError(f"--specs {path} is not valid JSON or JSONL; fix the file") from None
        doc = [_decode(ln, f"--specs {path} line {n + 1}", n) for n, ln in enumerate(lines)]
    if isinstance(doc, dict) and set(doc) == {"specs"}:
        doc = doc["specs"]
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise UsageError(f"--specs {path} holds a JSON {type(doc).__name__}; give an object, a list, "
                         f"{{\"specs\": [...]}} or JSONL")
    if not doc:
        raise UsageError(f"--specs {path} holds no specs; it needs at least one")
    return doc


def read_specs(spec: list[str] | None, specs: str | None) -> list[Any]:
    if spec and specs:
        raise UsageError("pass either --spec (repeatable) or --specs PATH, not both")
    if not spec and not specs:
        raise UsageError("no specs given; pass --spec JSON (repeatable) or --specs PATH")
    return parse_spec_texts(spec) if spec else parse_specs_file(specs)


def validate(args_type, raw: list[Any]) -> list[dict]:
    """The specs as canonical dicts in KernelArgs field order; raises SpecError naming index and field."""
    codec = ShapeCodec(args_type)
    shapes, _exact = codec.to_shapes(raw)
    names = codec.field_names
    out = []
    for shape in shapes:
        d = msgspec.structs.asdict(shape)
        out.append({n: d[n] for n in names})
    return out
