"""LMDB structural verifier, run in a child process so that a damaged page that faults the reader is
reported as a finding rather than a crash: `python -m kprof.ledger._verify PATH` prints a JSON list.

It walks every named database end to end, checks that keys are strictly increasing, and that the
number of entries walked equals the count in the database's header; and that the file holds every page
its header claims.
"""

from __future__ import annotations

import json
import os
import sys

import lmdb

from .store import DBS


def verify(path: str) -> list[str]:
    problems = []
    env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=len(DBS) + 4)
    try:
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if os.path.getsize(path) < need:
            return [f"file is truncated: {os.path.getsize(path)} bytes, header needs {need}"]
        with env.begin() as txn:
            for name in DBS:
                try:
                    db = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.Error as exc:
                    problems.append(f"sub-database {name!r} cannot be opened: {exc}")
                    continue
                expected = txn.stat(db)["entries"]
                seen, last = 0, None
                try:
                    for k in txn.cursor(db).iternext(values=True):
                        key = k[0]
                        if last is not None and key <= last:
                            problems.append(f"{name}: keys out of order at entry {seen}")
                            break
                        last = key
                        seen += 1
                except lmdb.Error as exc:
                    problems.append(f"{name}: walk failed at entry {seen}: {exc}")
                    continue
                if seen != expected:
                    problems.append(f"{name}: header counts {expected} entries, walk found {seen}")
    finally:
        env.close()
    return problems


if __name__ == "__main__":
    try:
        found = verify(sys.argv[1])
    except lmdb.Error as exc:
        found = [f"LMDB refused the file: {exc}"]
    print(json.dumps(found))
