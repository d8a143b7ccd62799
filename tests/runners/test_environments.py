import json
import subprocess
import sys

import msgspec
import pytest
from packaging.specifiers import InvalidSpecifier

from kprof.cli import main
from kprof.errors import UsageError
from kprof.runners import environments
from kprof.runners.environments import ENVIRONMENTS, Environment, Package, check
from kprof.runners.registry import entries, lookup
from kprof.runners.worker import prepare_device

HEAVY = ("torch", "cupti", "pynvml")
MSGSPEC = msgspec.__version__


def _impossible(monkeypatch, name="default_env", **package):
    """Environment `name` redefined to need msgspec>=999 (and torch, as before)."""
    env = msgspec.structs.replace(ENVIRONMENTS[name],
                                  packages=(*ENVIRONMENTS[name].packages, Package("msgspec", ">=999", **package)))
    monkeypatch.setitem(ENVIRONMENTS, name, env)


# --- definitions ------------------------------------------------------------------------------------------------

def test_every_entry_names_a_defined_environment():
    for e in entries():
        assert e.subprocess_env in ENVIRONMENTS, f"{e.table}/{e.backend}"
        assert e.subprocess_env == ("cuda_env" if e.device == "cuda" else "default_env")


@pytest.mark.parametrize("env", list(ENVIRONMENTS.values()), ids=lambda e: e.name)
def test_definitions_round_trip_and_name_themselves(env):
    assert ENVIRONMENTS[env.name] is env
    assert msgspec.convert(msgspec.to_builtins(env), Environment) == env
    assert env.image is None  # no container runtime reads it yet


def test_cuda_environment_requirements():
    cuda = ENVIRONMENTS["cuda_env"]
    assert cuda.cuda == ">=12"
    packages = {p.name: p for p in cuda.packages}
    assert packages["torch"].specifier == ">=2.4" and packages["torch"].timers == ()
    assert packages["nvidia-ml-py"].timers == ()  # every CUDA row needs NVML
    assert packages["cupti-python"].timers == ("cupti",)  # only the cupti timer needs CUPTI
    assert ENVIRONMENTS["default_env"].cuda is None  # any torch build


def test_a_specifier_that_does_not_parse_is_refused_at_definition():
    with pytest.raises(InvalidSpecifier):
        Package("torch", "at least 2.4")
    with pytest.raises(InvalidSpecifier):
        Environment("x", "x", python="3.10+")


@pytest.mark.parametrize("version, specifier, ok", [
    ("2.13.0+cpu", ">=2.4", True),  # a local label is ignored
    ("2.14.0.dev20260101+cu128", ">=2.4", True),  # a nightly is a torch
    ("2.3.1", ">=2.4", False),
    ("12.8", ">=12", True),
    ("11.8", ">=12", False),
    ("anything", "", True),
    ("not a version", ">=1", False),
])
def test_satisfies(version, specifier, ok):
    assert environments._satisfies(version, specifier) is ok


# --- check ------------------------------------------------------------------------------------------------------

def test_this_machine_satisfies_default_env():
    assert check("default_env") == []


def test_cuda_env_differences_name_the_package_and_the_fix():
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    diffs = check("cuda_env", timer="events")
    cuda = [d for d in diffs if "CUDA" in d]
    assert len(cuda) == 1
    assert cuda[0] == (f"cuda_env needs torch built with CUDA >=12 and torch {torch.__version__} is a build without "
                       f"CUDA (torch.version.cuda is None): install a CUDA >=12 build of torch, e.g. pip install torch "
                       f"--index-url https://download.pytorch.org/whl/cu128")
    assert not any("cupti-python" in d for d in diffs)  # the events timer does not need it


def test_a_missing_package_is_named_with_its_fix(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "default_env", msgspec.structs.replace(
        ENVIRONMENTS["default_env"], packages=(Package("kprof-no-such-package", ">=1"),)))
    assert check("default_env") == ["default_env needs kprof-no-such-package>=1 and kprof-no-such-package is not "
                                    "installed: pip install 'kprof-no-such-package>=1'"]


def test_an_impossible_version_is_reported_by_name(monkeypatch):
    _impossible(monkeypatch)
    assert check("default_env") == [f"default_env needs msgspec>=999 and msgspec {MSGSPEC} is installed: "
                                    f"pip install 'msgspec>=999'"]


def test_a_timer_package_is_checked_for_that_timer_only(monkeypatch):
    _impossible(monkeypatch, timers=("cupti",))
    assert check("default_env", timer="events") == []
    [diff] = check("default_env", timer="cupti")
    assert diff.endswith("(only the cupti timer needs it; KPROF_TIMER=events times without it)")
    assert check("default_env") == [diff]  # no timer: every package


def test_python_requirement(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "default_env", msgspec.structs.replace(ENVIRONMENTS["default_env"],
                                                                             python=">=99"))
    [diff] = check("default_env")
    assert diff.startswith("default_env needs Python >=99 and this is Python 3.")


def test_an_undefined_environment_is_a_difference():
    [diff] = check("no_such_env")
    assert "environment 'no_such_env' is not defined (defined: cuda_env, default_env)" in diff


# --- the worker refuses -----------------------------------------------------------------------------------------

def test_prepare_device_refuses_a_differing_environment(monkeypatch):
    _impossible(monkeypatch)
    monkeypatch.delenv(environments.SKIP_VAR, raising=False)
    with pytest.raises(UsageError) as info:
        prepare_device(lookup("single_gemm", "torch-cpu"), "cpu")
    assert info.value.exit_code == 2
    message = str(info.value)
    assert message.startswith("single_gemm/torch-cpu measures in environment 'default_env', and this one differs: "
                              f"default_env needs msgspec>=999 and msgspec {MSGSPEC} is installed")
    assert "KPROF_SKIP_ENV_CHECK=1" in message


def test_skip_env_check_lets_the_worker_measure(monkeypatch):
    _impossible(monkeypatch)
    monkeypatch.setenv(environments.SKIP_VAR, "1")
    assert prepare_device(lookup("single_gemm", "torch-cpu"), "cpu").name == "cpu"


def test_run_refuses_before_the_ledger_is_created(monkeypatch, tmp_path, capsys):
    _impossible(monkeypatch)
    monkeypatch.delenv(environments.SKIP_VAR, raising=False)
    db = tmp_path / "p.db"
    spec = json.dumps({"m": 8, "n": 8, "k": 8, "dtype": "fp32"})
    assert main(["run", "single_gemm", "--backend", "torch-cpu", "--spec", spec, "--db", str(db)]) == 2
    assert "default_env needs msgspec>=999" in capsys.readouterr().err
    assert not db.exists()


# --- kprof list -------------------------------------------------------------------------------------------------

def test_list_json_has_each_entrys_environment(capsys):
    assert main(["list", "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)["entries"]
    for d in docs:
        env = d["environment"]
        assert env["name"] == d["subprocess_env"]
        assert env == json.loads(msgspec.json.encode(ENVIRONMENTS[d["subprocess_env"]]))
        assert set(env) == {"name", "description", "python", "packages", "cuda", "image"}
    gemm = next(d for d in docs if (d["table"], d["backend"]) == ("single_gemm", "torch"))
    assert gemm["environment"]["cuda"] == ">=12"
    assert {"name": "torch", "specifier": ">=2.4", "timers": [], "purpose": "builds the inputs and runs the kernels"} \
        in gemm["environment"]["packages"]


def test_list_environments_json(capsys):
    assert main(["list", "--environments", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["count"] == len(doc["environments"]) == len(ENVIRONMENTS)
    by_name = {d["name"]: d for d in doc["environments"]}
    assert by_name["default_env"]["satisfied"] is True and by_name["default_env"]["differences"] == []
    assert "single_gemm/torch-cpu" in by_name["default_env"]["entries"]
    assert "single_gemm/torch" in by_name["cuda_env"]["entries"]
    assert by_name["cuda_env"]["differences"] == check("cuda_env")
    assert by_name["cuda_env"]["satisfied"] is (check("cuda_env") == [])


def test_list_environments_human(monkeypatch, capsys):
    _impossible(monkeypatch)
    assert main(["list", "--environments"]) == 0
    out = capsys.readouterr().out
    assert "default_env: CPU backends" in out and "cuda_env: CUDA backends" in out
    assert "packages: torch>=2.4, msgspec>=999; cuda: not needed; image: none (host interpreter)" in out
    assert "cupti-python>=12 (cupti timer only)" in out
    assert f"    - default_env needs msgspec>=999 and msgspec {MSGSPEC} is installed" in out


def test_list_and_the_default_check_import_no_measurement_library(tmp_path):
    code = ("import sys; from kprof.cli import main; from kprof.runners.environments import check; "
            "codes = [main(['list', '--json']), main(['list'])]; diffs = check('default_env'); "
            "print('RESULT', codes, diffs, sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY,))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "RESULT [0, 0] [] []"
