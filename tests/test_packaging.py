"""pyproject.toml's dependency floors against the APIs kprof calls: pip keeps an installed release the floor allows,
so a floor below the first release with an API kprof uses installs a kprof that fails at import."""

from __future__ import annotations

import os

import pytest
from packaging.requirements import Requirement


def _dependencies() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {(r := Requirement(d)).name: r.specifier for d in deps}


@pytest.mark.parametrize("name, lacking, first", [
    ("msgspec", "0.18.5", "0.18.6"),  # msgspec.msgpack.Encoder(order="deterministic"): kprof.ledger._codec
    ("cyclopts", "4.25.3", "5.0.0"),  # Parameter(metavar=...): kprof.cli._options
])
def test_each_floor_is_a_release_with_the_apis_kprof_calls(name, lacking, first):
    """msgspec>=0.18 and cyclopts>=3 let pip keep msgspec 0.18.0-0.18.5 or cyclopts 3 or 4, where `kprof` ended at
    import with a TypeError ('order' is an invalid keyword argument; unexpected keyword argument 'metavar' or
    'exit_on_error'); the floors are the first releases that have them."""
    specifier = _dependencies()[name]
    assert lacking not in specifier and first in specifier, (name, str(specifier))
