"""Helper processes for tests/ledger/test_reliability.py. Each mode is a real, separate process.

    python _writer.py write PATH --start A --count N [--batch-min B --batch-max B --seed S]
                                 [--ready-file F] [--start-file F] [--pause SECONDS] [--open-after-start]
        Opens the ledger, touches the ready file, waits for the start file, then appends synthetic
        events A..A+N in batches (sizes drawn from [batch-min, batch-max] with the seed) and prints one
        JSON line per committed batch, flushed right after the commit:
        {"start": a, "stop": b, "added": n, "existing": n, "last_seq": s}. Ends with {"done": true}.

    python _writer.py read PATH --count N --batch B [--ready-file F] [--deadline SECONDS]
        Repeatedly queries the synthetic view for specs 0..N and checks, per snapshot, that the ok rows are
        a whole number of batches, form a prefix (batches commit in order), never shrink, and that one
        count always comes with the same view root. Stops once all N rows are ok (or at the deadline) and
        prints {"violations": [...], "states": [...], "iterations": n}.

    python _writer.py open PATH
        Opens the ledger read-only and prints {"ok": true, "last_seq": s} or {"error": name, "message": m}.

    python _writer.py fork PATH
        Opens the ledger, forks, and in the child uses the parent's Ledger (read, view, append), then
        opens it afresh; prints what the child saw and whether the parent still works afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def _emit(doc) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _touch(path: str | None) -> None:
    if path:
        with open(path, "w"):
            pass


def _wait_for(path: str | None, timeout: float = 60.0) -> None:
    if not path:
        return
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"start file {path} never appeared")
        time.sleep(0.001)


def write(args) -> int:
    from kprof.ledger import Ledger
    from kprof import synth

    rng = random.Random(args.seed)
    # --open-after-start: writers started together open the file together (an upgrade races)
    ledger = None if args.open_after_start else Ledger.open(args.path)
    _touch(args.ready_file)
    _wait_for(args.start_file)
    if ledger is None:
        ledger = Ledger.open(args.path)
    i, stop = args.start, args.start + args.count
    while i < stop:
        n = min(rng.randint(args.batch_min, args.batch_max), stop - i)
        result = ledger.append(list(synth.events(i, i + n)))
        _emit({"start": i, "stop": i + n, "added": len(result.added), "existing": len(result.existing),
               "last_seq": result.last_seq})
        i += n
        if args.pause:
            time.sleep(args.pause)
    ledger.close()
    _emit({"done": True})
    return 0


def read(args) -> int:
    from kprof.ledger import Ledger
    from kprof import synth

    ledger = Ledger.open(args.path, readonly=True)
    view = synth.view(ledger)
    specs = [synth.spec(i) for i in range(args.count)]
    violations: list[str] = []
    states: list[int] = []
    roots: dict[int, str] = {}
    iterations = 0
    previous = 0
    deadline = time.monotonic() + args.deadline
    while True:
        root, rows = view.query(specs)
        iterations += 1
        ok = [row.ok for row in rows]
        n = sum(ok)
        if n % args.batch:
            violations.append(f"iteration {iterations}: {n} ok rows is not a multiple of the batch size {args.batch}")
        if ok != [True] * n + [False] * (args.count - n):
            violations.append(f"iteration {iterations}: the {n} ok rows are not the first {n} specs")
        if n < previous:
            violations.append(f"iteration {iterations}: ok rows went from {previous} down to {n}")
        if roots.setdefault(n, root.hex()) != root.hex():
            violations.append(f"iteration {iterations}: {n} ok rows seen under two view roots")
        if not states or states[-1] != n:
            states.append(n)
        previous = n
        if iterations == 1:
            _touch(args.ready_file)
        if n == args.count:
            break
        if time.monotonic() > deadline:
            violations.append(f"deadline passed with {n} of {args.count} rows ok")
            break
    ledger.close()
    _emit({"violations": violations, "states": states, "iterations": iterations})
    return 0


def open_readonly(args) -> int:
    from kprof.errors import KprofError
    from kprof.ledger import Ledger

    try:
        ledger = Ledger.open(args.path, readonly=True)
    except KprofError as exc:
        _emit({"error": type(exc).__name__, "exit_code": exc.exit_code, "message": str(exc)})
        return 0
    try:
        _emit({"ok": True, "last_seq": ledger.last_seq})
    finally:
        ledger.close()
    return 0


def fork(args) -> int:
    from kprof.errors import LedgerError
    from kprof.ledger import Ledger
    from kprof import synth

    ledger = Ledger.open(args.path)
    before = ledger.last_seq
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into the caller's stack
        code = 1
        try:
            os.close(r)
            seen = {}
            ops = {
                "last_seq": lambda: ledger.last_seq,
                "get_many": lambda: synth.view(ledger).get_many([synth.spec(0)]),
                "append": lambda: ledger.append([synth.event(10_000_000)]),
                "read": lambda: ledger.read().__enter__(),
            }
            for name, op in ops.items():
                try:
                    op()
                    seen[name] = {"raised": None}
                except Exception as exc:  # noqa: BLE001 - the report names whatever was raised
                    seen[name] = {"raised": type(exc).__name__, "is_ledger_error": isinstance(exc, LedgerError),
                                  "message": str(exc)}
            ledger.close()  # must not close the parent's environment
            try:  # the guard's advice: open it again in this process
                with Ledger.open(args.path) as fresh:
                    seen["reopened"] = {"last_seq": fresh.last_seq}
            except Exception as exc:  # noqa: BLE001
                seen["reopened"] = {"raised": type(exc).__name__, "message": str(exc)}
            os.write(w, json.dumps(seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _pid, status = os.waitpid(pid, 0)
    child = json.loads(b"".join(chunks) or b"null")
    parent = {"last_seq_before": before, "last_seq_after": ledger.last_seq}
    parent["append_after"] = ledger.append([synth.event(20_000_000)]).last_seq
    ledger.close()
    _emit({"child": child, "child_exit": os.waitstatus_to_exitcode(status), "parent": parent})
    return 0


def fork_exit(args) -> int:
    """Holds a read snapshot, forks a child that drops everything and exits normally (interpreter
    finalization frees its copies of the environment and the transaction), then reports the parent's
    reader slots before and after, and that its snapshot still reads."""
    import gc

    from kprof.ledger import Ledger

    ledger = Ledger.open(args.path)

    def slots():
        return [line.split() for line in ledger.env.readers().strip().splitlines()[1:]
                if line.split() and line.split()[0] == str(os.getpid())]

    with ledger.read() as txn:
        before = slots()
        pid = os.fork()
        if pid == 0:
            del txn
            gc.collect()
            sys.exit(0)  # a normal exit, finalizers and all: no os._exit
        _pid, status = os.waitpid(pid, 0)
        after = slots()
        still = ledger.last_seq
    ledger.close()
    _emit({"child_exit": os.waitstatus_to_exitcode(status), "before": before, "after": after, "last_seq": still})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write")
    w.add_argument("path")
    w.add_argument("--start", type=int, required=True)
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--batch-min", type=int, default=200)
    w.add_argument("--batch-max", type=int, default=200)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ready-file")
    w.add_argument("--open-after-start", action="store_true", help="open the ledger once the start file appears")
    w.add_argument("--start-file")
    w.add_argument("--pause", type=float, default=0.0)
    rd = sub.add_parser("read")
    rd.add_argument("path")
    rd.add_argument("--count", type=int, required=True)
    rd.add_argument("--batch", type=int, required=True)
    rd.add_argument("--ready-file")
    rd.add_argument("--deadline", type=float, default=30.0)
    o = sub.add_parser("open")
    o.add_argument("path")
    f = sub.add_parser("fork")
    f.add_argument("path")
    fe = sub.add_parser("fork-exit")
    fe.add_argument("path")
    args = parser.parse_args(argv)
    return {"write": write, "read": read, "open": open_readonly, "fork": fork, "fork-exit": fork_exit}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
