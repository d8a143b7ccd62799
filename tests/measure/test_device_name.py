"""GPU names from the driver's /proc listing (no torch, no pynvml), as CUDA_VISIBLE_DEVICES selects them."""

import pytest

from kprof.measure.device_name import visible_gpus


@pytest.fixture
def proc(tmp_path):
    gpus = [("0000:18:00.0", "NVIDIA H200", "GPU-aaaa1111"), ("0000:2a:00.0", "NVIDIA H100 80GB HBM3", "GPU-bbbb2222")]
    for bus, model, uuid in gpus:
        d = tmp_path / bus
        d.mkdir()
        (d / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 35\nGPU UUID: \t {uuid}\n"
                                       f"Bus Location: \t {bus}\n")
    return str(tmp_path)


def test_all_gpus_in_bus_order_when_unset(proc):
    assert visible_gpus(proc, env={}) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]


@pytest.mark.parametrize("value, names", [
    ("1", ["NVIDIA H100 80GB HBM3"]),
    ("1,0", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]),
    ("GPU-bbbb", ["NVIDIA H100 80GB HBM3"]),
    ("0,7,1", ["NVIDIA H200"]),  # CUDA stops at the first invalid entry
    ("", []),
    ("-1", []),
])
def test_cuda_visible_devices_selects(proc, value, names):
    assert visible_gpus(proc, env={"CUDA_VISIBLE_DEVICES": value}) == names


def test_no_driver_listing_means_no_gpu(tmp_path):
    assert visible_gpus(str(tmp_path / "absent"), env={}) == []
