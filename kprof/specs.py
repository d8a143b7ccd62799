"""Spec input: repeated `--spec JSON` and `--specs PATH` (a JSON object, a JSON list, {"specs": [...]},
or JSONL). Every spec is validated against the table's KernelArgs before anything runs.

JSON that a spec cannot be is refused at reading, naming where: nesting deeper than MAX_DEPTH (a spec file
nests three deep: {"specs": [{...}]}), and a key given twice in one object (a JSON decoder keeps the last
one silently: `{"m": 1, "m": 2}` would be read as m=2)."""

from __future__ import annotations

import json
import os
from itertools import chain, compress
from typing import Any

import msgspec

from .errors import SpecError, UsageError
from .ledger.keys import ShapeCodec

__all__ = ["MAX_DEPTH", "read_specs", "parse_spec_texts", "parse_specs_file", "validate"]

MAX_DEPTH = 32  # levels of arrays and objects in one JSON document of specs

_is_container = frozenset({dict, list}).__contains__


class _Duplicate(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _Duplicate(next(k for k, _v in pairs if k in seen or seen.add(k)))
    return out


def _walk(doc, opens: int) -> tuple[int, int]:
    """(depth, keys): the nesting depth of a decoded document (capped at MAX_DEPTH + 1) and how many keys its
    objects hold, level by level without recursion. `opens`, the count of "[" and "{" in its text (strings
    included), bounds how many arrays and objects it holds: once that many are seen, no level below holds one,
    and the values of the last level are not read (~2 ms per 10,000 flat specs)."""
    level, depth, keys, seen = [doc] if _is_container(type(doc)) else [], 0, 0, 0
    while level and depth <= MAX_DEPTH:
        depth += 1
        seen += len(level)
        dicts = [node for node in level if type(node) is dict]
        keys += sum(map(len, dicts))
        if seen >= opens:
            break
        values = list(chain(chain.from_iterable(map(dict.values, dicts)),
                            chain.from_iterable(node for node in level if type(node) is list)))
        level = list(compress(values, map(_is_container, map(type, values))))
    return depth, keys


def _duplicate(data: bytes | str, doc) -> tuple[int | None, str] | None:
    """(spec index or None, key) of the first key given twice in one object of `data`, or None. Read again with
    the standard library's decoder, which hands each object's pairs over in order (msgspec keeps the last)."""
    wrapped = type(doc) is dict and set(doc) == {"specs"} and type(doc["specs"]) is list
    if wrapped or type(doc) is list:  # to name the spec: the list's items left undecoded, then each read alone
        items = (msgspec.json.decode(data, type=dict[str, list[msgspec.Raw]])["specs"] if wrapped
                 else msgspec.json.decode(data, type=list[msgspec.Raw]))
        for i, item in enumerate(items):
            try:
                json.loads(bytes(item), object_pairs_hook=_unique)
            except _Duplicate as dup:
                return i, dup.key
    try:
        json.loads(data, object_pairs_hook=_unique)
    except _Duplicate as dup:
        return None, dup.key
    return None


def _load(data: bytes | str, where: str, index: int | None):
    """The JSON document `data`; SpecError for nesting past MAX_DEPTH or a key given twice (a DecodeError
    propagates: the caller says what the text should be)."""
    too_deep = SpecError(f"{where} nests arrays and objects deeper than {MAX_DEPTH} levels; a spec is one flat "
                         f"JSON object of its table's fields", index=index)
    try:
        doc = msgspec.json.decode(data)
    except RecursionError:  # msgspec refuses past Python's recursion limit; MAX_DEPTH is checked below
        raise too_deep from None
    marks = (b"[", b"{", b":") if isinstance(data, bytes) else ("[", "{", ":")
    depth, keys = _walk(doc, data.count(marks[0]) + data.count(marks[1]))
    if depth > MAX_DEPTH:
        raise too_deep
    # Each key is followed by a colon outside strings; strings may hold colons too. So when the text has as many
    # colons as the decoded objects have keys, no key was given twice; otherwise look for one, the slow way.
    if data.count(marks[2]) != keys:
        found = _duplicate(data, doc)
        if found is not None:
            at, key = found
            raise SpecError(f'{where} gives field "{key}" twice in one object; give each field once',
                            index=at if index is None else index, field=key)
    return doc


def _decode(text: str, where: str, index: int | None):
    try:
        return _load(text, where, index)
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
        doc = _load(data, f"--specs {path}", None)
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
    codec = ShapeCodec(args_type, strict=True)  # 64.0 or 1e3 for an int field is refused, not read as 64 or 1000
    shapes, _exact = codec.to_shapes(raw)
    names = codec.field_names
    out = []
    for shape in shapes:
        d = msgspec.structs.asdict(shape)
        out.append({n: d[n] for n in names})
    return out
