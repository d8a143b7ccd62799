"""address_check.py on CPU: its cases are valid specs of CUDA entries, its offsets are the bits it names, and its
summary reads the fastest and slowest bit and the two placement means."""

import importlib.util
import pathlib

import msgspec
import pytest

from kprof.runners.registry import lookup

_spec = importlib.util.spec_from_file_location("address_check", pathlib.Path(__file__).with_name("address_check.py"))
ac = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ac)


@pytest.mark.parametrize("name,table,backend,spec", ac.CASES, ids=[c[0] for c in ac.CASES])
def test_every_case_is_a_valid_spec_of_a_cuda_entry(name, table, backend, spec):
    entry = lookup(table, backend)
    assert entry.device == "cuda"
    msgspec.convert(spec, entry.args)  # raises on a bad spec


def test_bits_are_zero_then_each_power_of_two_from_512_bytes_to_2_mib():
    assert ac.BITS[0] == 0 and ac.BITS[1] == 512 and ac.BITS[-1] == 2 << 20
    assert all(b == 2 * a for a, b in zip(ac.BITS[1:], ac.BITS[2:]))


def test_summary_names_the_fastest_and_slowest_bit_and_both_means():
    bits = {str(b): {"us": 10.0} for b in ac.BITS}
    bits["4096"]["us"], bits["8192"]["us"] = 8.5, 11.0
    doc = {"bits": bits, "hashed": [{"us": 9.0}, {"us": 10.0}], "clones": [{"us": 10.0}, {"us": 11.0}],
           "original": {"us": 10.2}}
    s = ac.summary(doc)
    assert (s["fastest_bit"], s["fastest_us"], s["slowest_bit"], s["slowest_us"]) == (4096, 8.5, 8192, 11.0)
    assert s["hashed_mean_us"] == pytest.approx(9.5) and s["clones_mean_us"] == pytest.approx(10.5)
    assert s["base_us"] == 10.0 and s["original_us"] == 10.2
