"""pyproject.toml's dependency floors against the APIs kprof calls: pip keeps an installed release the floor allows,
so a floor below the first release with an API kprof uses installs a kprof that fails at import."""

from __future__ import annotations

import os

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from kprof.runners.environments import ENVIRONMENTS


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _dependencies(extra: str | None = None) -> dict:
    project = _project()
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
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


@pytest.mark.parametrize("extra", ["remote", "test"])
def test_the_submitit_floor_runs_with_a_current_setuptools(extra):
    """submitit>=1.5 let pip keep submitit 1.5.0-1.5.3, which import pkg_resources, no longer in setuptools 84: run
    --remote on Slurm (or submitit's local executor) ended with a ModuleNotFoundError traceback. 1.5.4 does not."""
    specifier = _dependencies(extra)["submitit"]
    assert "1.5.3" not in specifier and "1.5.4" in specifier, str(specifier)


def test_the_python_floor_is_one_kprof_runs_on():
    """requires-python >=3.10 let pip install kprof on Python 3.10, with the newest cyclopts there (4.x: cyclopts 5
    needs 3.11), and every command ended at import with a TypeError; kprof.merge calls BaseException.add_note (3.11)
    too. The floor is 3.11, and each backend environment names the same one."""
    python = _project()["requires-python"]
    assert "3.10.13" not in SpecifierSet(python) and "3.11.0" in SpecifierSet(python), python
    assert {env.python for env in ENVIRONMENTS.values()} == {python}


def test_the_test_extra_holds_every_optional_package_the_tests_use():
    """`pip install '.[test]'` left matplotlib out: ten snapshot tests (curve.png) failed without the [plot] extra.
    The test extra holds the plot and remote extras' packages."""
    extras = _project()["optional-dependencies"]
    names = {key: {Requirement(r).name for r in extras[key]} for key in ("test", "plot", "remote")}
    assert names["plot"] | names["remote"] <= names["test"], names


def test_the_measure_extra_installs_what_the_cuda_environment_checks():
    """The [measure] extra named torch, nvidia-ml-py and cupti-python without versions, so pip kept an nvidia-ml-py
    11 it found, and every CUDA run then refused it (cuda_env needs >=12). The extra asks for what cuda_env checks."""
    extras = _project()["optional-dependencies"]
    measure = {(r := Requirement(d)).name: str(r.specifier) for d in extras["measure"]}
    assert measure == {p.name: p.specifier for p in ENVIRONMENTS["cuda_env"].packages}, measure
    test = {(r := Requirement(d)).name: str(r.specifier) for d in extras["test"]}
    assert test["nvidia-ml-py"] == measure["nvidia-ml-py"]


@pytest.mark.parametrize("extra, name, lacking, first", [
    ("remote", "ray", "2.9.3", "2.10.0"),  # ray 2.9 imports pkg_resources as a task is submitted
    ("test", "ray", "2.55.1", "2.56.0"),  # ray 2.55 leaves a process of ray.init running: a ResourceWarning, an error
])
def test_the_ray_floor_runs_what_kprof_and_its_tests_do(extra, name, lacking, first):
    """ray>=2.9 let pip keep ray 2.9, which imports pkg_resources, no longer in setuptools 84, as the first task is
    submitted: run --remote on Ray ended with a ModuleNotFoundError traceback. Through 2.55, ray.init leaves a
    subprocess that the tests' warnings-as-errors report as errors of the Ray tests."""
    specifier = _dependencies(extra)[name]
    assert lacking not in specifier and first in specifier, str(specifier)
