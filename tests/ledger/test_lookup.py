"""Bulk point lookups (kprof.ledger._lookup): sorted with numpy from NUMPY_FROM keys on, with sorted()
below; both answer exactly as one get per key does, in input order."""

import os
import random

import lmdb
import pytest

from kprof.ledger import _lookup


@pytest.fixture
def store(tmp_path):
    """A current view (kind byte + anything) and a failures view beside it."""
    env = lmdb.open(str(tmp_path / "t.lmdb"), subdir=False, map_size=1 << 28, max_dbs=2)
    current, failures = env.open_db(b"current"), env.open_db(b"failures")
    rng = random.Random(3)
    stored = {os.urandom(32): rng.choice((b"m", b"f")) + os.urandom(rng.randrange(0, 60)) for _ in range(6000)}
    with env.begin(write=True) as txn:
        for k, v in stored.items():
            txn.put(k, v, db=current)
            if v[:1] == b"f" or rng.random() < 0.2:
                txn.put(k, os.urandom(32), db=failures)
    yield env, stored, current, failures
    env.close()


@pytest.mark.parametrize("numpy_from", [1, 10**9])  # every list through numpy, none
def test_bulk_lookups_answer_as_one_get_per_key(store, monkeypatch, numpy_from):
    env, stored, current, failures = store
    monkeypatch.setattr(_lookup, "NUMPY_FROM", numpy_from)
    monkeypatch.setattr(_lookup, "IMPORT_NUMPY_FROM", numpy_from)
    rng = random.Random(11)
    present = list(stored)
    keys = rng.sample(present, 3000) + [os.urandom(32) for _ in range(3000)] + rng.sample(present, 500)  # repeats
    rng.shuffle(keys)
    keys.append(b"\0" * 32)  # ties in the first 8 bytes, and the smallest key there is
    keys.append(b"\0" * 31 + b"\1")
    with env.begin() as txn:
        cur = txn.cursor(current)
        assert _lookup.values(cur, keys) == [stored.get(k) for k in keys]
        assert _lookup.values(cur, []) == []


def test_keys_of_other_sizes_take_sorted(store, monkeypatch):
    env, stored, current, failures = store
    monkeypatch.setattr(_lookup, "NUMPY_FROM", 1)
    monkeypatch.setattr(_lookup, "IMPORT_NUMPY_FROM", 1)
    keys = list(stored)[:100] + [b"short"]
    with env.begin() as txn:
        assert _lookup.values(txn.cursor(current), keys) == [stored.get(k) for k in keys]


def test_a_cli_verb_does_not_import_numpy_for_a_lookup_it_would_not_repay(tmp_path):
    """A CLI verb runs once: importing numpy (~0.1 s) for 10,000 keys would cost more than it saves."""
    import json
    import subprocess
    import sys

    from kprof.ledger import Ledger, synth

    db = str(tmp_path / "profile.db")
    with Ledger.open(db) as ledger:
        ledger.append(list(synth.events(0, 100)))
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps([synth.spec(i) for i in range(10_000)]))
    script = (f"import sys; from kprof.cli import main; "
              f"rc = main(['count-missing', 'single_gemm', '--backend', 'torch-cpu', '--specs', {str(specs)!r}, "
              f"'--db', {db!r}, '--gpu-name', 'X', '--json']); "
              f"print(rc, 'numpy' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "0 False", proc.stderr
