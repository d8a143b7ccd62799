"""How the worker meets a device that fails: a CUDA error that leaves the process's context unusable, on a fake
device (no GPU needed)."""

import msgspec

from kprof.ledger.events import Environment, Failed, Measured, Method
from kprof.measure.stats import summarize
from kprof.runners.registry import lookup
from kprof.runners.worker import measure_specs

SPECS = [{"tokens": 4, "hidden": 16, "dtype": "fp32"}, {"tokens": 8, "hidden": 16, "dtype": "fp32"}]
STICKY = "CUDA error: an illegal memory access was encountered"


class _Sticky:
    """A device whose first measurement hits a sticky CUDA error: every later CUDA call raises it again, recover too."""

    name = "cpu"

    def __init__(self):
        self.env, self.broken, self.measured = Environment(), False, 0

    def measure(self, case, rule):
        self.measured += 1
        if self.broken or self.measured == 1:
            self.broken = True
            raise RuntimeError(STICKY)
        return summarize([1.0] * 5), Method(timer="cupti"), None, self.env, 0.01

    def recover(self):
        if self.broken:
            raise RuntimeError(STICKY)


def test_a_sticky_cuda_error_keeps_its_row_and_the_next_specs_fail_naming_it():
    """A CUDA error that recover() meets again lost the failed spec's event and ended the run with a traceback."""
    device = _Sticky()
    first, second = measure_specs(lookup("rms_norm", "torch-cpu"), SPECS, "test gpu", device=device)
    assert type(first.event) is Failed and first.event.error_kind == "crash" and STICKY in first.event.message
    assert type(second.event) is Failed and second.event.error_kind == "crash"
    assert "earlier spec's failure left this process's device unusable" in second.event.message
    assert STICKY in second.event.message and "fresh process" in second.event.message
    assert device.measured == 1  # the lost device is not asked again


def test_specs_after_a_lost_device_are_crashes_whatever_its_error_said():
    from kprof.runners.worker import DeviceLost, classify

    assert classify(DeviceLost("not measured: ... (RuntimeError: CUDA error: operation not supported)")) == "crash"
    assert classify(DeviceLost("not measured: ... (RuntimeError: CUDA error: out of memory)")) == "crash"


def test_a_recovered_device_goes_on_measuring():
    device = _Sticky()
    device.recover = lambda: setattr(device, "broken", False)  # an OOM: recover gives the memory back
    first, second = measure_specs(lookup("rms_norm", "torch-cpu"), SPECS, "test gpu", device=device)
    assert type(first.event) is Failed and type(second.event) is Measured


def test_recover_runs_once_the_failed_cases_inputs_are_let_go():
    """recover() (gc, empty_cache) ran inside the except block, while the failed spec's case and the error's traceback
    (whose frames hold the case's inputs) were still referenced: the memory of an OOM's spec could not be given back."""
    import weakref

    device, seen = _Sticky(), []

    def measure(case, rule):
        device.inputs = weakref.ref(case.inputs[0])
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    device.measure = measure
    device.recover = lambda: seen.append(device.inputs() is None)
    first, _second = measure_specs(lookup("rms_norm", "torch-cpu"), SPECS, "test gpu", device=device)
    assert first.event.error_kind == "oom" and seen == [True, True]


def test_a_pool_worker_whose_device_is_lost_ends_after_sending_the_event(tmp_path, monkeypatch):
    """The worker sends the failed spec's event, then ends instead of failing every spec it is handed: the pool
    starts a fresh worker (a fresh CUDA context) on the device."""
    import multiprocessing
    import signal

    from kprof.ledger._codec import event_decoder
    from kprof.runners import pool, worker
    from kprof.runners.chunk import Chunk

    entry = lookup("rms_norm", "torch-cpu")
    monkeypatch.setattr(worker, "prepare_device", lambda *a, **k: _Sticky())
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the worker ignores Ctrl-C; this process must not
    monkeypatch.setattr(pool, "watch_parent", lambda **k: None)
    parent, child = multiprocessing.Pipe()
    for spec in SPECS:
        parent.send(Chunk.of(entry, "test gpu", [spec]).encode())
    parent.send(None)
    pool._worker_main(child, None, entry.table, entry.backend, msgspec.msgpack.encode(entry.contract), "test gpu",
                      str(tmp_path))
    got = []
    while parent.poll():
        got.append(parent.recv())
    assert [m[0] for m in got] == ["ready", "event"]  # no "idle": it asks for no more work
    assert STICKY in event_decoder.decode(got[1][3]).message


def test_cuda_recover_surfaces_a_sticky_error_even_with_no_cached_memory():
    """empty_cache() frees nothing (so raises nothing) where no block is cached; a synchronize meets the error."""
    import types

    import pytest

    from kprof.runners.cuda_device import CudaDevice

    def synchronize():
        raise RuntimeError(STICKY)

    d = object.__new__(CudaDevice)
    d.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=synchronize, empty_cache=lambda: None))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        d.recover()


def test_a_cuda_device_whose_first_work_fails_is_refused_not_a_traceback(monkeypatch):
    """KPROF_POOL's default measures a host's one GPU in this process: a GPU whose memory another process holds made
    the device's wake-up raise OutOfMemoryError out of `run`, a traceback; a worker's refusal was already exit 2."""
    import pytest
    import torch

    from kprof.errors import UsageError
    from kprof.runners.cuda_device import CudaDevice
    from kprof.runners.worker import prepare_device

    def wake(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 120.00 MiB")

    monkeypatch.setenv("KPROF_SKIP_ENV_CHECK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(CudaDevice, "_wake", wake)
    entry = lookup("single_gemm", "torch")
    contract = msgspec.structs.replace(entry.contract, timing="events;l2=cold;eager")
    with pytest.raises(UsageError, match="CUDA device 0 could not be prepared .*OutOfMemoryError.*nvidia-smi"):
        prepare_device(msgspec.structs.replace(entry, contract=contract), "NVIDIA H200", Environment)
