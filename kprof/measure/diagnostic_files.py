"""The `measure` diagnostic's files: runtimes.csv, telemetry.csv, summary.json and the plots, each written once and
read-only with a `kmeasure.<16 hex>` citation (the start of the blake3 digest of its bytes), and the lookup of a
citation that `kprof show kmeasure.<hex>` makes.

    files = write_outputs(path, window, summary)                   # read-only artifacts and their citations
    find_artifact("kmeasure.1a2b3c4d5e6f7a8b", ["."])             # what `kprof show kmeasure.<hex>` prints
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
from typing import Sequence

import msgspec
from blake3 import blake3

from .._outdir import staged, write_once
from ..errors import IntegrityError, UsageError
from ._diagnostic_telemetry import reason_labels
from ._nvml_telemetry import TelemetrySample
from .diagnostic import (ARTIFACTS, FORMAT, STAGING, TOKEN_HEX, TOKEN_PREFIX, DiagnosticError, Launches, Window,
                         check_output_dir)

__all__ = ["runtimes_csv", "telemetry_csv", "token_of", "write_outputs", "find_artifact", "default_dirs"]

_json = msgspec.json.Encoder(order="deterministic")


# --- files --------------------------------------------------------------------------------------------------

def runtimes_csv(launches: Launches) -> bytes:
    """runtimes.csv: one row per launch, integer ns from the window's zero (CUPTI's own resolution)."""
    rows = ["launch,start_ns,end_ns,duration_ns,idle_before_ns\n"]
    rows += ["%d,%d,%d,%d,%d\n" % row for row in zip(range(len(launches.start)), *launches)]
    return "".join(rows).encode()


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def telemetry_csv(samples: Sequence[TelemetrySample]) -> bytes:
    """telemetry.csv: one row per reading (t_s from the window's zero; readings just before and after it kept);
    an empty cell is a value NVML did not give."""
    rows = ["t_s,sm_mhz,mem_mhz,power_w,temp_c,util_pct,reasons,reason_labels,energy_mj,read_ms\n"]
    for s in samples:
        labels = "|".join(reason_labels(s.reasons)) if s.reasons is not None else ""
        reasons = f"{s.reasons:#x}" if s.reasons is not None else ""
        rows.append(",".join([f"{s.t:.4f}", _cell(s.sm_mhz), _cell(s.mem_mhz), _cell(s.power_w), _cell(s.temp_c),
                              _cell(s.util_pct), reasons, labels, _cell(s.energy_mj), _cell(s.read_ms)]) + "\n")
    return "".join(rows).encode()


def token_of(data: bytes) -> tuple[str, str]:
    """(citation, full digest): blake3 of the artifact's bytes."""
    digest = blake3(data).hexdigest()
    return TOKEN_PREFIX + digest[:TOKEN_HEX], digest


def write_outputs(path: str, window: Window, summary: dict) -> dict:
    """Writes runtimes.csv, telemetry.csv, the two plots (when matplotlib imports) and summary.json into `path`,
    each once and read-only; summary.json gets `artifacts` ({name: {citation, blake3, bytes, what}}) and `plots`.
    Returns the summary as written, with `summary_citation` (summary.json's own, which it cannot hold) added.

    The files are made in a staging folder inside `path` and renamed into place once all are written: a write
    interrupted (Ctrl-C while the plots render) or refused (a full disk) leaves no part of an output, which would
    refuse the same command again. A failed write is a DiagnosticError naming the file; nothing of it is left."""
    check_output_dir(path)
    try:
        os.makedirs(path, exist_ok=True)
        with staged(path, STAGING) as staging:  # held while written: a kill leaves it for the next check to remove
            summary, written = _write_staged(staging, window, summary)
            check_output_dir(path)  # another writer may have finished there since: never overwrite its files
            _place(staging, path, written)
            return summary
    except OSError as exc:
        name = os.path.basename(exc.filename) if exc.filename else ""
        where = f" ({os.path.join(path, name)})" if name in ARTIFACTS else ""
        raise DiagnosticError(f"cannot write the measure output in --output-dir {path}: {exc.strerror or exc}"
                              f"{where}; nothing of it was written: free space or fix the directory, and measure "
                              f"again") from None


def _place(staging: str, path: str, names: list[str]) -> None:
    """Renames the staged files into `path`; one that fails (or an interrupt among them) takes back those placed."""
    placed: list[str] = []
    try:
        for name in names:
            os.rename(os.path.join(staging, name), os.path.join(path, name))
            placed.append(name)
    except BaseException:
        for name in placed:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name))
        raise


def _write_staged(staging: str, window: Window, summary: dict) -> tuple[dict, list[str]]:
    """(the summary as written, the files written in order, summary.json last) in the folder `staging`."""
    artifacts: dict[str, dict] = {}

    def keep(name: str, data: bytes) -> None:
        write_once(os.path.join(staging, name), data)
        citation, digest = token_of(data)
        artifacts[name] = {"citation": citation, "blake3": digest, "bytes": len(data), "what": ARTIFACTS[name]}

    keep("runtimes.csv", runtimes_csv(window.launches))
    keep("telemetry.csv", telemetry_csv(window.samples))
    summary = dict(summary)
    summary["plots"] = _plots(window, summary, keep)
    summary["artifacts"] = artifacts
    data = msgspec.json.format(_json.encode(summary), indent=2) + b"\n"
    write_once(os.path.join(staging, "summary.json"), data)
    summary["summary_citation"], _digest = token_of(data)
    return summary, [*artifacts, "summary.json"]


def _plots(window: Window, summary: dict, keep) -> dict:
    try:
        from . import _diagnostic_plots as plots

        pngs = plots.render(window, summary)
    except ImportError as e:
        return {"skipped": f"matplotlib is not importable ({e}); pip install matplotlib for the plots"}
    for name, data in pngs.items():
        keep(name, data)
    return {name: "written" for name in pngs}


# --- kmeasure citations -------------------------------------------------------------------------------------

_SUMMARY_MAX = 64 << 20  # bytes of a summary.json read at most: one measure writes is a few KiB


def _summaries(dirs: Sequence[str]) -> list[str]:
    """summary.json files in each directory given and in its immediate subdirectories (a directory holding an output
    of its own, e.g. `measure --output-dir .`, may hold others in its subdirectories too)."""
    out: dict[str, str] = {}  # real path -> the path as found (a directory given twice is read once)
    for d in dirs:
        own = os.path.join(d, "summary.json")
        found = ([own] if os.path.isfile(own) else []) + sorted(glob.glob(os.path.join(glob.escape(d), "*",
                                                                                        "summary.json")))
        for path in found:
            out.setdefault(os.path.realpath(path), os.path.normpath(path))
    return list(out.values())


def default_dirs() -> list[str]:
    """Where `kprof show kmeasure.<hex>` looks without --dir: the current directory and its immediate subdirectories
    (./measure_<table>_<backend>/ among them)."""
    return ["."]


def find_artifact(ref: str, dirs: Sequence[str] | None = None) -> dict:
    """The measure artifact whose citation `ref` (`kmeasure.<hex>`, 8 hex digits at least) names, searched in the
    summary.json files of `dirs` (default: `default_dirs()`): {ref, resolved_as, path, artifact, what, bytes,
    blake3, summary, table, backend, spec, gpu_name, mode, output_dir}. The artifact's bytes are hashed again: one
    that changed since it was written is an IntegrityError (exit 3); no match or several are a UsageError."""
    text = ref.strip().lower()
    hexpart = text[len(TOKEN_PREFIX):] if text.startswith(TOKEN_PREFIX) else ""
    if len(hexpart) < 8 or any(c not in "0123456789abcdef" for c in hexpart):
        raise UsageError(f"{ref!r} is not a measure citation; pass kmeasure.<hex> (at least 8 hex digits) as "
                         f"summary.json lists it")
    where = list(dirs) if dirs else default_dirs()
    absent = [d for d in dirs or () if not os.path.isdir(d)]
    if absent:
        what = "not a directory" if os.path.exists(absent[0]) else "no such directory"
        raise UsageError(f"--dir {shlex.quote(absent[0])}: {what}; pass the `kprof measure` output directory (or the "
                         f"directory holding it)")
    found: dict[str, tuple[str, str, dict, dict]] = {}  # artifact path -> (name, summary path, summary, entry)
    unreadable: list[str] = []
    for summary_path in _summaries(where):
        try:
            if not (os.path.isfile(summary_path) or os.path.isdir(summary_path) or not os.path.exists(summary_path)):
                raise OSError(0, "not a regular file")  # a pipe or device: its read would block, or never end
            with open(summary_path, "rb") as f:
                data = f.read(_SUMMARY_MAX + 1)
        except OSError as e:  # a dangling link, a folder of that name, no permission: not one that can be shown
            unreadable.append(f"{summary_path}: {e.strerror}")
            continue
        if len(data) > _SUMMARY_MAX:  # not one of ours (a summary is a few KiB): not read whole into memory
            continue
        try:
            doc = msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError):  # nested past the decoder's depth: a RecursionError
            continue  # not one of ours
        if not isinstance(doc, dict) or not isinstance(doc.get("artifacts"), dict) or not isinstance(
                doc.get("mode", {}), dict):  # not one of ours either: `show` reads its mode's fields
            continue
        if isinstance(doc.get("format"), int) and doc["format"] > FORMAT:
            raise UsageError(f"{summary_path} has measure format {doc['format']}; this kprof reads up to {FORMAT}: "
                             f"upgrade kprof to show it")
        _cite, digest = token_of(data)
        if digest.startswith(hexpart):
            found[summary_path] = ("summary.json", summary_path, doc, {"blake3": digest, "bytes": len(data),
                                                                       "what": ARTIFACTS["summary.json"]})
        for name, entry in doc["artifacts"].items():
            if isinstance(entry, dict) and str(entry.get("blake3", "")).startswith(hexpart):
                found[os.path.join(os.path.dirname(summary_path), name)] = (name, summary_path, doc, entry)
    if not found:
        skipped = f" (could not read {'; '.join(unreadable)})" if unreadable else ""
        raise UsageError(f"no measure output in {', '.join(where)} or the directories directly in "
                         f"{'it' if len(where) == 1 else 'them'} lists {ref!r}{skipped}; pass --dir with the measure "
                         f"output directory (or the directory holding it)")
    if len(found) > 1:
        if len({entry["blake3"] for *_, entry in found.values()}) == 1:  # copies: no digit tells them apart
            raise UsageError(f"{ref!r} names the same bytes in {', '.join(sorted(found))}: no more hex digits tell "
                             f"them apart; pass --dir with the directory of the one to show")
        raise UsageError(f"{ref!r} is ambiguous: {', '.join(sorted(found))} match; give more hex digits")
    path, (name, summary_path, doc, entry) = next(iter(found.items()))
    if name != "summary.json":
        try:
            if not os.path.isfile(path):  # a pipe or device named in a summary: never a file measure wrote
                raise OSError(0, "not a regular file")
            with open(path, "rb") as f:
                hasher = blake3()
                for chunk in iter(lambda: f.read(1 << 20), b""):  # streamed: a launch record can take gigabytes
                    hasher.update(chunk)
                actual = hasher.hexdigest()
        except OSError as e:
            raise IntegrityError(f"{path}, listed as {ref} by {summary_path}, cannot be read ({e.strerror}); the "
                                 f"measure output is incomplete") from None
        if actual != entry["blake3"]:
            raise IntegrityError(f"{path} no longer has the bytes {summary_path} lists for {ref}: it was changed "
                                 f"after it was written; measure again for a trustworthy copy")
    return {"ref": ref, "resolved_as": "measure-artifact", "path": path, "artifact": name, "what": entry.get("what"),
            "bytes": entry.get("bytes"), "blake3": entry.get("blake3"), "summary": summary_path,
            "table": doc.get("table"), "backend": doc.get("backend"), "spec": doc.get("spec"),
            "gpu_name": doc.get("gpu_name"), "mode": doc.get("mode"),
            "output_dir": os.path.dirname(summary_path) or "."}
