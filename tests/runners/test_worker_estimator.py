"""The row's time from its samples: the median, or the mean where the timing says so (a power-capped kernel,
whose per-call times under the cap's swinging clock are not one-peaked)."""

import pytest

from kprof.ledger.events import Environment, Measured, Method
from kprof.measure.stats import summarize
from kprof.runners.registry import lookup
from kprof.runners.worker import measure_specs

# Two peaks, as under a swinging clock: the median sits in one of them, the mean between.
SAMPLES = [1.0] * 6 + [1.3] * 5


class _Device:
    name = "cpu"

    def __init__(self, estimator):
        self.env = Environment()
        self.estimator = estimator

    def measure(self, case, rule):
        notes = {"estimator": self.estimator} if self.estimator else {}
        return summarize(SAMPLES), Method(timer="cupti", notes=notes), None, self.env, 0.01

    def recover(self):
        pass


@pytest.mark.parametrize("estimator, expected", [(None, 1.0), ("median", 1.0), ("mean", sum(SAMPLES) / 11)])
def test_time_ms_follows_the_timings_estimator(estimator, expected):
    entry = lookup("rms_norm", "torch-cpu")
    (out,) = measure_specs(entry, [{"tokens": 4, "hidden": 64, "dtype": "fp32"}], "test cpu",
                           device=_Device(estimator))
    assert type(out.event) is Measured
    assert out.event.metrics["time_ms"] == pytest.approx(expected)
    assert out.event.stats.median == 1.0 and out.event.stats.mean == pytest.approx(sum(SAMPLES) / 11)
