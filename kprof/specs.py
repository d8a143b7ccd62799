"""Spec validation: every spec, from the CLI (read by `kprof.spec_input`) or a Python caller, is checked against
the table's KernelArgs before anything runs, and turned into its canonical shape (what a key hashes)."""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import msgspec

from .errors import SpecError, UsageError
from .spec_input import (MAX_DEPTH, MAX_FILE_BYTES, FileSpecs, cut, json_kind, json_text, long_int,
                         parse_spec_texts, parse_specs_file, read_specs)

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "ShapeCodec", "is_text", "long_int", "read_specs", "parse_spec_texts",
           "parse_specs_file", "spec_list", "validate"]


def is_text(value: str) -> bool:
    """Whether a str is UTF-8 text, as keys hash it and records store it: not one holding a lone surrogate (how
    Python reads a byte that is not UTF-8, from a file name or os.fsdecode)."""
    return value.encode("utf-8", "replace").decode("utf-8") == value


def spec_list(specs: Any) -> list:
    """The caller's specs as a list: a list (a FileSpecs too) as it is, another iterable (a tuple, a generator)
    listed. One spec (a mapping or a Struct), a string, None or anything not iterable is a UsageError: listing a dict
    would read its keys as specs."""
    if isinstance(specs, list):
        return specs
    if isinstance(specs, Mapping) and isinstance(specs.get("specs"), list):  # a specs file's {"specs": [...]}, loaded
        raise UsageError('specs: expected a list of specs, got a {"specs": [...]} document (as a specs file holds); '
                         'pass its list, doc["specs"]')
    if isinstance(specs, (Mapping, msgspec.Struct)):
        raise UsageError(f"specs: expected a list of specs, got one spec ({type(specs).__name__}); wrap it in a list, "
                         f"[spec]")
    if specs is None or isinstance(specs, (str, bytes)) or not hasattr(specs, "__iter__"):
        raise UsageError(f"specs: expected a list of specs (mappings of the table's fields), got "
                         f"{type(specs).__name__}; pass e.g. [{{\"m\": 64, \"n\": 1024, \"k\": 256, \"dtype\": "
                         f"\"fp32\"}}]")
    return list(specs)


def _scalar(value):
    """A numpy (or other array library's) scalar as the Python value it holds (`.item()`): a simulator's specs often
    come from arrays, and np.int64 is no int to msgspec, while np.float64 is a float that strict reading must refuse
    for an int field as it refuses 64.0. Any other value as it is: an array, even of one value (`np.array([64])`,
    `df["m"]` of one row), is no scalar, and msgspec names its type."""
    if type(value) in (int, float, str, bool) or not callable(getattr(value, "item", None)):
        return value
    if getattr(value, "ndim", 0) != 0:  # an array's .item() takes [[64]] too
        return value
    try:
        return value.item()
    except (TypeError, ValueError):  # not one value: msgspec names its type
        return value


class ShapeCodec:
    """Validates specs against one KernelArgs Struct and makes their canonical shapes (the key's last part).

    A shape is canonical when its fields are sorted by name and each value has the type its field declares (an
    integral float for an int field becomes that int), so field order and `128` against `128.0` never change a key.
    A twin Struct with the same fields in sorted order does validation, normalization and canonical
    field order in one msgspec call; its encoding is byte-identical to the sorted shape dict's. `strict`:
    an int field takes an int only; a float (even 64.0) or a bool is a SpecError naming the field.
    """

    def __init__(self, args_type: type[msgspec.Struct], *, strict: bool = False, name: str | None = None):
        self.args_type = args_type
        self.name = name or args_type.__name__  # what messages call the specs' kind: the table, where known
        self.strict = strict
        info = msgspec.inspect.type_info(args_type)
        fields = sorted(info.fields, key=lambda f: f.name)
        self.field_names = tuple(f.name for f in info.fields)
        self._types = {f.name: f.type for f in info.fields}
        self._int_fields = {f.name for f in info.fields if isinstance(f.type, msgspec.inspect.IntType)}
        # int fields whose bounds let a value past the 64 bits a key's msgpack holds through (a plugin's plain `int`)
        self.wide_ints = tuple(n for n in sorted(self._int_fields) if not self._in_64_bits(self._types[n]))
        self._float_fields = tuple(f.name for f in info.fields if isinstance(f.type, msgspec.inspect.FloatType))
        hints = msgspec.structs.fields(args_type)
        by_name = {f.name: f for f in hints}
        # A field with a default (a plugin's `act: str = "ok"`) may be left out; its shape holds the default, so the
        # key is the same whether the default is given or omitted.
        self._optional = tuple(f.name for f in hints if f.default is not msgspec.NODEFAULT
                               or f.default_factory is not msgspec.NODEFAULT)
        post_init = getattr(args_type, "__post_init__", None)  # cross-field rules travel with the twin
        self._twin = msgspec.defstruct(
            f"_Canonical{args_type.__name__}",
            [(f.name, by_name[f.name].type, msgspec.field(default=by_name[f.name].default,
                                                         default_factory=by_name[f.name].default_factory))
             for f in fields],
            kw_only=True,  # fields sorted by name: one with a default may come before one without
            frozen=True,
            forbid_unknown_fields=True,
            gc=False,  # scalars only, never in a cycle: untracked, bulk conversions skip the collector
            namespace={"__post_init__": post_init} if post_init else None,
        )

    def to_shape(self, spec: Mapping[str, Any] | msgspec.Struct, index: int | None = None):
        """The validated canonical shape (a Struct of the twin type). Raises SpecError."""
        if isinstance(spec, msgspec.Struct):
            spec = msgspec.structs.asdict(spec)
        try:
            shape = msgspec.convert(spec, self._twin)
        except (msgspec.ValidationError, UnicodeEncodeError):  # a str with a lone surrogate: named below
            shape = self._slow_to_shape(spec, index)
        return self._finite(shape, index) if self._float_fields else shape

    def to_shapes(self, specs: list) -> tuple[list, bool]:
        """(`to_shape` over a list, exact): validated in one msgspec call when every spec is a dict with
        exactly the declared types (`exact`: each input dict already holds its canonical values)."""
        try:
            shapes = msgspec.convert(specs, list[self._twin])
        except (msgspec.ValidationError, UnicodeEncodeError):
            pass  # find and explain (or normalize) spec by spec
        else:  # a dict that left out a field with a default is not its canonical shape: that holds the default
            if self._float_fields:  # nor one holding 1 or -0.0 for a float field (1.0, 0.0)
                return [self._finite(shape, i) for i, shape in enumerate(shapes)], False
            return shapes, not self._optional or all(len(s) == len(self.field_names) for s in specs if type(s) is dict)
        return [self.to_shape(spec, i) for i, spec in enumerate(specs)], False

    def _finite(self, shape, index):
        """The shape with a float field's -0.0 as 0.0 (equal values, so one key); SpecError for nan or inf, which JSON
        cannot carry (a row's spec would read null) and no kernel parameter means."""
        zeros = {}
        for name in self._float_fields:
            value = getattr(shape, name)
            if not math.isfinite(value):
                raise SpecError(f'field "{name}" = {value!r} is not a finite number; use a finite one', index=index,
                                field=name, value=value)
            if value == 0 and math.copysign(1.0, value) < 0:
                zeros[name] = 0.0
        return msgspec.structs.replace(shape, **zeros) if zeros else shape

    def _slow_to_shape(self, spec, index):
        if not isinstance(spec, Mapping):
            fix = ("a spec is one object, not a list of them: one per --spec, one per JSONL line, or in one flat list "
                   "(in Python, a flat list of dicts)" if isinstance(spec, (list, tuple))
                   else "write each spec as an object of those fields")
            raise SpecError(f"expected a JSON object of {self._table_fields()}, got {json_kind(spec)}; {fix}",
                            index=index, value=spec)
        named = [name for name in spec if not isinstance(name, str)]
        if named:
            raise SpecError(f"field name {named[0]!r} ({type(named[0]).__name__}) is not a str; name each field as a "
                            f"str, one of {self._table_fields()}", index=index, value=named[0])
        # np.int64(64) is 64, np.float64(64.0) a float; a name of a str subclass (np.str_, a str Enum) its str
        fixed = {str.__str__(name): _scalar(value) for name, value in spec.items()}
        for name, value in fixed.items():  # msgspec reads a str as UTF-8: a lone surrogate was a UnicodeEncodeError
            if any(isinstance(t, str) and not is_text(t) for t in (name, value)):
                raise SpecError(f"field {cut(repr(name))} = {cut(repr(value))} is not UTF-8 text (a lone surrogate, "
                                f"as Python reads a byte that is not UTF-8); use {self._table_fields()} with text "
                                f"values",
                                index=index, field=name, value=value)
        for name in self._int_fields & fixed.keys():
            value = fixed[name]
            if self.strict and type(value) in (float, bool):
                raise self._not_an_int(name, value, index, given=spec[name])
            if isinstance(value, float) and math.isfinite(value) and value.is_integer():
                fixed[name] = int(value)
        try:
            return msgspec.convert(fixed, self._twin)
        except msgspec.ValidationError as exc:
            raise self._explain(exc, fixed, index) from None

    @staticmethod
    def _in_64_bits(t) -> bool:
        low = t.ge if t.ge is not None else None if t.gt is None else t.gt + 1
        high = t.le if t.le is not None else None if t.lt is None else t.lt - 1
        return low is not None and high is not None and low >= -(1 << 63) and high < (1 << 64)

    @staticmethod
    def past_64_bits(name: str, value: int, index) -> SpecError:
        return SpecError(f'field "{name}" = {long_int(value) or value}: past the 64-bit integers a key can hold; use a '
                         f'smaller value', index=index, field=name, value=value)

    def _table_fields(self) -> str:
        return "{" + ", ".join(self.field_names) + "}"

    def _int_fix(self, name: str) -> str:
        ftype = self._types.get(name)
        if isinstance(ftype, msgspec.inspect.IntType) and ftype.gt is not None:
            return f"use an integer greater than {ftype.gt}" + (f" and at most {ftype.le}" if ftype.le else "")
        return "use an integer"

    def _in_bounds(self, name: str, value: int) -> bool:
        t = self._types[name]
        return ((t.gt is None or value > t.gt) and (t.ge is None or value >= t.ge) and (t.lt is None or value < t.lt)
                and (t.le is None or value <= t.le))

    def _not_an_int(self, name: str, value, index, given=None) -> SpecError:
        """A float or bool given for an int field (strict): named as JSON wrote it, with the int meant; the error's
        `value` is the one `given` (a numpy scalar, where one was)."""
        kind = "bool" if type(value) is bool else "float"
        example = ""
        if kind == "float" and math.isfinite(value) and value.is_integer() and self._in_bounds(name, int(value)):
            example = f', e.g. "{name}": {int(value)}'
        shown = msgspec.json.encode(value).decode() if math.isfinite(value) else repr(value)
        return SpecError(f'field "{name}" = {shown} is a {kind}; {self._int_fix(name)}{example}', index=index,
                         field=name, value=value if given is None else given)

    def _explain(self, exc: msgspec.ValidationError, spec: dict, index) -> SpecError:
        text = str(exc)
        name = None
        if "`$." in text:
            name = text.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
        if text.startswith("Object contains unknown field"):
            name = text.split("`")[1]
            fix = ("give the backend on its own instead (--backend; backend= in Python)" if name == "backend"
                   else 'a {"specs": [...]} document is a whole --specs file (in Python, pass its list), not one '
                   'spec or JSONL line' if name == "specs" and isinstance(spec.get(name), list)
                   else f"use only {self._table_fields()}")
            return SpecError(f'field "{cut(name)}" is not a KernelArgs field of {self.name}; {fix}',
                             index=index, field=name, value=spec.get(name))
        if text.startswith("Object missing required field"):
            name = text.split("`")[1]
            article = "an" if self.name[:1] in "aeiou" else "a"  # an all_reduce spec, a single_gemm spec
            required = [n for n in self.field_names if n not in self._optional]
            optional = f" (optional: {', '.join(self._optional)})" if self._optional else ""
            return SpecError(f'field "{name}" is missing; {article} {self.name} spec needs '
                             f'{{{", ".join(required)}}}{optional}', index=index, field=name)
        if not name:  # a rule across fields (from __post_init__): one that names its field says its fix too
            named = re.match(r'field "(\w+)"', text)
            if named:
                return SpecError(text, index=index, field=named.group(1), value=spec.get(named.group(1)))
            return SpecError(f"{text}; fix the values", index=index)
        value = spec.get(name)
        fix = "fix the value"
        ftype = self._types.get(name)
        if isinstance(ftype, msgspec.inspect.LiteralType):
            fix = "use one of " + ", ".join(map(str, ftype.values))
        elif isinstance(ftype, msgspec.inspect.IntType) and ftype.gt is not None:
            fix = self._int_fix(name)
        elif isinstance(ftype, msgspec.inspect.BoolType):
            fix = "use true or false (JSON booleans)"
        elif isinstance(ftype, msgspec.inspect.FloatType):
            fix = "use a number"
        shown = cut(repr(value)) if isinstance(value, str) else json_text(value)  # null, true: as JSON writes them
        return SpecError(f'field "{name}" = {shown}: {cut(text.split(" - at ")[0], 120)}; {fix}',
                         index=index, field=name, value=value)


def validate(args_type, raw: list[Any], table: str | None = None) -> list[dict]:
    """The specs as canonical dicts in KernelArgs field order; raises SpecError naming index, field and `table`."""
    codec = ShapeCodec(args_type, strict=True, name=table)  # 64.0 or 1e3 for an int field: refused, not 64 or 1000
    names, out = codec.field_names, []
    try:
        shapes, _exact = codec.to_shapes(raw)
        for i, shape in enumerate(shapes):
            d = msgspec.structs.asdict(shape)
            for name in codec.wide_ints:  # refused here, as every spec's other mistakes, not when its key is made
                if not -(1 << 63) <= d[name] < (1 << 64):
                    raise codec.past_64_bits(name, d[name], i)
            out.append({n: d[n] for n in names})
    except SpecError as exc:  # a --specs file's spec: named by its line too
        raise raw.locate(exc) if isinstance(raw, FileSpecs) else exc from None
    return out
