"""after_load_check.py's analysis on the CPU: when a row's shift after the load fades."""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("after_load_check", os.path.join(HERE, "after_load_check.py"))
alc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(alc)


def test_fade_finds_the_largest_shift_and_when_every_later_row_is_back_within_the_tolerance():
    points = [{"t": 0.2, "ms": 1.01}, {"t": 0.5, "ms": 1.10}, {"t": 1.0, "ms": 1.03}, {"t": 1.5, "ms": 1.015},
              {"t": 2.0, "ms": 0.99}]
    got = alc.fade(points, base=1.0)
    assert got["max_shift"] == pytest.approx(0.10) and got["at_s"] == 0.5 and got["within_after_s"] == 1.5
    assert alc.fade(points[:3], base=1.0)["within_after_s"] is None  # still 3 % off at the window's end
    assert alc.fade([], base=1.0) == {"max_shift": None, "at_s": None, "within_after_s": None}


def test_bad_arguments_exit_2_before_any_gpu_is_looked_for(capsys):
    assert alc.main(["--load-s", "0", "--out", "x"]) == 2
    assert "--load-s" in capsys.readouterr().err
