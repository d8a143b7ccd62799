"""oracle_cost.py on CPU: without a GPU it refuses with exit 2 and writes nothing."""

import importlib.util
import pathlib

import pytest
import torch

_spec = importlib.util.spec_from_file_location("oracle_cost", pathlib.Path(__file__).with_name("oracle_cost.py"))
oc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_without_a_gpu_exits_2(tmp_path, capsys):
    assert oc.main(["--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
