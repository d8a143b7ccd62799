"""Spec input as text: repeated `--spec JSON` and `--specs PATH` (a JSON object, a JSON list, {"specs": [...]},
or JSONL), read into Python values that `kprof.specs.validate` then checks against the table's KernelArgs.

JSON that a spec cannot be is refused at reading, naming where: nesting deeper than MAX_DEPTH (a spec file
nests three deep: {"specs": [{...}]}), and a key given twice in one object (a JSON decoder keeps the last
one silently: `{"m": 1, "m": 2}` would be read as m=2)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from itertools import chain, compress
from typing import Any

import msgspec

from .errors import SpecError, UsageError

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "FileSpecs", "cut", "json_kind", "json_text", "long_int", "read_specs",
           "parse_spec_texts", "parse_specs_file"]

MAX_DEPTH = 32  # levels of arrays and objects in one JSON document of specs
# A --specs file past this is refused unread: it is read whole, and its specs take ~16x its size in memory (a 44 MiB
# file of a million GEMM specs, 0.7 GiB), so a file of gigabytes (a sparse or runaway one) would take the machine's.
MAX_FILE_BYTES = 256 << 20  # ~6 million GEMM specs

_is_container = frozenset({dict, list}).__contains__


def long_int(value) -> str | None:
    """An int too long to show in a message (past 40 digits) by its count of digits, else None: Python will not write
    one past 4,300 digits at all (a ValueError, where the message meant to name it)."""
    if not isinstance(value, int) or value.bit_length() <= 132:  # < 10**39.7: written whole
        return None
    return f"a {'negative ' if value < 0 else ''}{math.floor(math.log10(abs(value))) + 1:,}-digit integer"


_JSON_KINDS = {type(None): "", bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list",
               tuple: "a list", dict: "an object"}


def cut(text: str, limit: int = 60) -> str:
    """Text of the caller's (a field's name or value) as a message shows it: past `limit` characters, its start."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def json_text(value) -> str:
    """A value of a JSON type as JSON writes it (`null`, `true`, `{"v":4}`: not Python's None, True, {'v': 4}), cut
    to 60 characters; another value as Python writes it."""
    try:
        as_json = type(value) in _JSON_KINDS and type(value) is not float  # JSON writes nan as null
        shown = long_int(value) or (msgspec.json.encode(value).decode() if as_json else repr(value))
    except (TypeError, ValueError, OverflowError):  # nan, a str that is not UTF-8: as Python writes it
        try:
            shown = repr(value)
        except ValueError:  # a list holding an int past the 4,300 digits Python writes
            shown = "..."
    return cut(shown)


def json_kind(value) -> str:
    """A value that is no spec as JSON names it, with the value (`null`, `a number (42)`), not as Python does
    (`NoneType`, `int`); another Python type by its name."""
    kind = _JSON_KINDS.get(type(value))
    if kind is None:
        return type(value).__name__
    return f"{kind} ({json_text(value)})" if kind else json_text(value)


class FileSpecs(list):
    """The specs of a --specs file, and the line of the file each starts on (as editors number them, blank lines
    counted): `kprof.specs.validate` names a spec it refuses by that line as well as by its index. A JSONL file's lines
    are kept as read; a JSON list's are found once a spec is refused, by reading the file again up to it."""

    def __init__(self, specs: list, path: str, lines: list[int] | None = None):
        super().__init__(specs)
        self.path, self.lines = path, lines

    def line_of(self, index: int) -> int | None:
        if self.lines is not None:
            return self.lines[index] if 0 <= index < len(self.lines) else None
        try:
            with open(self.path, "rb") as f:
                text = f.read(MAX_FILE_BYTES + 1).decode("utf-8").removeprefix("\ufeff")
        except (OSError, UnicodeDecodeError):  # gone or changed since: the index alone
            return None
        return _item_line(text, index) if "\n" in text.strip() else None  # one line: the index says where

    def locate(self, exc: SpecError) -> SpecError:
        line = None if exc.index is None else self.line_of(exc.index)
        if line is None:
            return exc
        return SpecError(f"--specs {self.path} line {line}: {exc.reason}", index=exc.index, field=exc.field,
                         value=exc.value)


_WS = re.compile(r"[ \t\n\r]*")
_LIST = re.compile(r"[ \t\n\r]*\[")
_WRAPPED = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"specs"[ \t\n\r]*:[ \t\n\r]*\[')


def _item_line(text: str, index: int) -> int | None:
    """The line item `index` of a JSON document's list of specs (the document, or its "specs") starts on; None where
    the document is no such list (one spec alone)."""
    at = _WRAPPED.match(text) or _LIST.match(text)
    if at is None:
        return None
    i, decoder = at.end(), json.JSONDecoder()
    try:
        for _ in range(index):  # each item before it read whole, so a "[" or "," inside a string is not counted
            _item, i = decoder.raw_decode(text, _WS.match(text, i).end())
            i = _WS.match(text, i).end()
            if not text.startswith(",", i):
                return None
            i += 1
    except ValueError:
        return None
    return text.count("\n", 0, _WS.match(text, i).end()) + 1


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
            raise SpecError(f'{where} gives field "{cut(key)}" twice in one object; give each field once',
                            index=at if index is None else index, field=key)
    return doc


def _decode(text: str, where: str, index: int | None):
    try:
        return _load(text, where, index)
    except msgspec.DecodeError as exc:
        # read before the table is looked up: the example is named as single_gemm's, not offered as every table's
        reason = _located(exc, text.encode("utf-8", "replace"), one_line=True)
        fix = ("write it as a JSON object of the table's fields (`kprof list` names them), e.g. '{\"m\": 128, \"n\": "
               "256, \"k\": 64, \"dtype\": \"bf16\"}' for single_gemm")
        if reason.startswith("JSON is malformed: trailing characters"):  # a whole value, then more: several specs
            fix = ("a --spec holds one spec: give each its own --spec, or put them in a --specs file"
                   if where == "--spec" else "a JSONL line holds one spec, ending where its object does")
        raise SpecError(f"{where} is not valid JSON ({reason}); {fix}", index=index) from None


def _one_value(line: str) -> bool:
    try:
        msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


def _located(exc: msgspec.DecodeError, data: bytes, one_line: bool = False) -> str:
    """msgspec's reason with its byte offset as the line and column an editor shows (a pretty-printed file's error is
    rarely on its first line; `one_line`: a --spec or JSONL line, the column alone), and a document that ends early,
    or is empty, said as such."""
    reason = str(exc)
    at = re.search(r" \(byte (\d+)\)$", reason)
    if at:
        offset = int(at.group(1)) - reason.startswith("JSON is malformed: trailing characters")  # msgspec: one past
        start = data.rfind(b"\n", 0, offset) + 1
        line, column = data.count(b"\n", 0, offset) + 1, len(data[start:offset].decode("utf-8", "replace")) + 1
        one_line = one_line and b"\n" not in data.strip()  # a --spec of several lines: its line too
        where = f"at column {column}" if one_line else f"at line {line}, column {column}"
        if data.startswith(b"\xef\xbb\xbf", offset):  # past the file's start (ignored there): files joined with `cat`
            return f"a byte-order mark (U+FEFF) {where}, as joining files saved with one leaves; remove it"
        char = data[offset:offset + 4].decode("utf-8", "replace")[:1]
        if char > " " and char.isspace():  # a no-break space, as a document or web page gives
            return f"the character U+{ord(char):04X} {where}, which JSON does not read as a space; write a space"
        if char and char < " ":  # a NUL (of UTF-16 or UTF-32 text, beside every letter), a tab in a string
            nul = data.count(b"\0") * 4 // len(data)  # quarters of the file: 2 of UTF-16's ASCII text, 3 of UTF-32's
            utf = f"; the file is UTF-{16 if nul < 3 else 32} text: save it as UTF-8" if nul and len(data) > 1 else ""
            return (f"the control character U+{ord(char):04X} {where}, which a JSON string holds only escaped, as "
                    f"\\u{ord(char):04x}{utf}")
        if char and char in "'\u201c\u201d\u2018\u2019":  # a Python dict's repr; text copied from a document
            what = "single quote" if char == "'" else "typographic quote"
            return (f"a {what} ({char}) {where}: JSON quotes with \" alone; write \" (json.dumps writes a Python "
                    f"dict as JSON)")
        word = re.match(rb"True|False|None|NaN|Infinity", data[offset:])  # Python's words: JSON has no NaN either
        if word:
            said = {b"True": "true", b"False": "false", b"None": "null"}.get(word.group())
            fix = f"JSON writes {said}" if said else "JSON has no such number; use a finite one"
            return f"{word.group().decode()} {where} is Python's, not JSON: {fix}"
        return f"{reason[:at.start()]} {where}"
    if reason.startswith(("Integer value out of range", "Number out of range")):  # valid JSON, too large to read
        return ("it holds a number too large to read (an integer past 4,300 digits, or a number past 1.8e308); use "
                "one in the field's range")
    if reason == "Input data was truncated":
        if not data.strip():
            return "it is empty"
        try:  # msgspec says so of a string ending in a lone surrogate escape ("\ud800"), which the stdlib reads
            json.loads(data)
        except ValueError:
            return "it ends before every [ and { it opens is closed"
        return ("it holds a \\u escape of half a UTF-16 surrogate pair (\\ud800 to \\udfff, alone), which is no "
                "character; write the character itself")
    return reason


def parse_spec_texts(texts: list[str], files: bool = True) -> list[Any]:
    """Each --spec's JSON. `files`: the verb takes --specs too (`measure` does not)."""
    for i, text in enumerate(texts):  # `--spec specs.json` for --specs: said so, not "invalid character at column 1"
        if text.strip()[:1] not in ("{", "[", '"') and os.path.isfile(text):
            fix = (f"pass the file with --specs {shlex.quote(text)}" if files else
                   f"give the spec itself, e.g. --spec \"$(cat {shlex.quote(text)})\"")
            raise SpecError(f"--spec {text}: that is a file, and --spec takes one spec as JSON text; {fix}", index=i)
    return [_decode(t, "--spec", i) for i, t in enumerate(texts)]


def parse_specs_file(path: str) -> list[Any]:
    fix = "pass the path of a JSON or JSONL file of specs"
    if path == "-":  # pipes are refused below, and "-" is no file name either: say what it would have meant
        raise UsageError("--specs -: reading specs from stdin is not supported; write them to a file and pass its "
                         "path")
    if not os.path.isfile(path):
        what = ("is a directory" if os.path.isdir(path) else "is not a regular file (a device, pipe or socket)"
                if os.path.exists(path) else f"is a symbolic link to {os.readlink(path)}, which names no file (moved, "
                "or a loop of links)" if os.path.islink(path) else "no such file")
        if not os.path.exists(path) and path.startswith("-"):  # `--specs --json`: the flag took the next one
            fix = f"{path} looks like a flag; give --specs the path of a JSON or JSONL file of specs"
        elif path.startswith("~") and os.path.isfile(os.path.expanduser(path)):  # `--specs=~/s.json`: bash keeps ~
            fix = f"the shell left ~ as it is (after =, or quoted); pass --specs {os.path.expanduser(path)}"
        raise UsageError(f"--specs {path}: {what}; {fix}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise UsageError(f"--specs {path} is {size:,} bytes, past the {MAX_FILE_BYTES >> 20} MiB a specs file "
                                 f"may hold (millions of specs); split it into smaller files, one command each")
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:  # the path was right: what it names is not readable
        fix = ("make it readable by this user (chmod u+r), or pass a copy that is" if isinstance(exc, PermissionError)
               else "pass a copy of it that can be read")
        raise UsageError(f"--specs {path}: cannot be read ({exc.strerror}); {fix}") from None
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as some editors write: ignored
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        boms = {b"\xff\xfe\0\0": 32, b"\0\0\xfe\xff": 32, b"\xff\xfe": 16, b"\xfe\xff": 16}  # 16: PowerShell's >
        said = next((f"UTF-{bits}" for bom, bits in boms.items() if data.startswith(bom)), "not UTF-8")
        raise SpecError(f"--specs {path} is {said} text (byte {exc.start} is 0x{data[exc.start]:02x}); save it "
                        f"as UTF-8 JSON or JSONL") from None
    if not text:
        raise UsageError(f"--specs {path} is empty; it needs at least one spec")
    try:
        doc = _load(data, f"--specs {path}", None)
    except msgspec.DecodeError as exc:
        lines = [(n, ln) for n, ln in enumerate(data.decode("utf-8").split("\n"), 1) if ln.strip()]  # as editors number
        comment = next(((n, ln.strip()) for n, ln in lines if ln.lstrip().startswith(("#", "//", "/*"))), None)
        if comment:  # no line of valid JSON starts so (a string holds no newline): "invalid character" says too little
            raise SpecError(f"--specs {path} line {comment[0]} is a comment ({cut(comment[1], 40)}); JSON and JSONL "
                            f"have no comments: remove the line, or keep notes in another file")
        if len(lines) < 2 or not _one_value(lines[0][1]):  # JSONL's first line is a whole value; else one document
            raise SpecError(f"--specs {path} is not valid JSON or JSONL ({_located(exc, data)}); fix the "
                            f"file") from None
        doc = FileSpecs([_decode(ln, f"--specs {path} line {n}", i) for i, (n, ln) in enumerate(lines)], path,
                        [n for n, _ln in lines])
    if isinstance(doc, dict) and isinstance(doc.get("table"), str) and isinstance(doc.get("backend"), str):
        _refuse_output(path, doc)  # no spec has a field "backend": a document kprof wrote
    if isinstance(doc, dict) and isinstance(doc.get("view_root_after"), str) and "command" in doc:  # names no table
        request = os.path.join(os.path.dirname(path), "request.json")
        raise SpecError(f"--specs {path} is a snapshot's job.meta.json (how its run went), not a file of specs; the "
                        f"snapshot's request.json holds its specs: jq '.specs' {request} > specs.json", field="command")
    if isinstance(doc, dict) and isinstance(doc.get("specs"), list):
        extra = sorted(set(doc) - {"specs"})
        if extra:  # read as one spec, it would be refused for its field "specs", which is not the mistake
            fix = "pass --backend instead" if "backend" in extra else "remove it; the specs are the list alone"
            raise SpecError(f'--specs {path}: a {{"specs": [...]}} document holds only "specs", and it also has '
                            f'"{extra[0]}"; {fix}', field=extra[0])
        doc = doc["specs"]
    if isinstance(doc, dict) and set(doc) == {"specs"}:  # the wrapper around one spec: no table has a field "specs"
        held = "an object" if isinstance(doc["specs"], dict) else json_kind(doc["specs"])
        raise SpecError(f'--specs {path}: "specs" holds {held}, not a list; write {{"specs": [{{...}}, ...]}}, the '
                        f'specs in a list even where there is one', field="specs")
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise UsageError(f"--specs {path} holds {json_kind(doc)}; give an object, a list, "
                         f"{{\"specs\": [...]}} or JSONL")
    if not doc:
        raise UsageError(f"--specs {path} holds no specs; it needs at least one")
    return doc if isinstance(doc, FileSpecs) else FileSpecs(doc, path)


# kprof's own documents: (a field that tells it, its list of specs, what it is, jq's filter for the specs alone)
_OUTPUTS = (("missing_count", "missing", "`kprof count-missing --json` output", ".missing"),
            ("view_root", "results", "`kprof query --json` or `kprof run --json` output (or a snapshot's results.json)",
             "[.results[].spec]"),
            ("mode", "specs", "a snapshot's request.json", ".specs"),
            ("axes", "points", "a snapshot's curve.json (its points hold only the fields that vary)", None))


def _refuse_output(path: str, doc: dict) -> None:
    """A --specs file that is a document kprof wrote (count-missing/query/run --json, a snapshot's files) was read as
    one spec and refused for its field "table" or "backend", with a fix (--backend) the command already followed."""
    for tell, field, what, jq in _OUTPUTS:
        if tell in doc and isinstance(doc.get(field), list):
            request = os.path.join(os.path.dirname(path), "request.json")  # beside it, in the snapshot
            where = (f'its specs are its "{field}" list: write them to a file of their own, e.g. jq \'{jq}\' {path} > '
                     f"specs.json" if jq else f"the snapshot's request.json holds its specs: jq '.specs' {request} > "
                     "specs.json")
            raise SpecError(f"--specs {path} is {what} for {doc['table']}/{doc['backend']}, not a file of specs; "
                            f"{where}", field=field)


def read_specs(spec: list[str] | None, specs: str | None) -> list[Any]:
    if spec and specs:
        raise UsageError("pass either --spec (repeatable) or --specs PATH, not both")
    if specs == "":  # not "no --specs": the path is what is wrong
        raise UsageError("--specs '': the path is empty; pass the path of a JSON or JSONL file of specs")
    if not spec and not specs:
        raise UsageError("no specs given; pass --spec JSON (repeatable) or --specs PATH")
    return parse_spec_texts(spec) if spec else parse_specs_file(specs)
