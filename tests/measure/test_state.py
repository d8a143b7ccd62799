"""The thermal and power protocol's decisions (kprof.measure._state), on scripted readings: no GPU needed."""

import pytest

from kprof.measure._state import StateProtocol, StateReading, state_label


class Script:
    """A probe that replays readings (the last one repeats), on a fake clock that `sleep` and chunks advance."""

    def __init__(self, readings):
        self.readings, self.i, self.now, self.slept = list(readings), 0, 0.0, 0.0

    def probe(self):
        r = self.readings[min(self.i, len(self.readings) - 1)]
        self.i += 1
        return StateReading(*r)

    def sleep(self, s):
        self.slept += s
        self.now += s

    def clock(self):
        return self.now

    def chunk(self, chunk_s):
        self.now += chunk_s


def protocol(script, **kw):
    return StateProtocol(script.probe, sleep=script.sleep, clock=script.clock, **kw)


def test_start_waits_for_a_hot_gpu_to_cool_to_the_stated_temperature():
    s = Script([(1980, 80.0, 86.0, 0), (1980, 80.0, 84.0, 0), (345, 70.0, 79.0, 1)])
    p = protocol(s, max_start_c=80.0)
    p.start()
    assert s.slept == pytest.approx(1.0) and p.notes["start_temp_c"] == "86.0"
    assert p.notes["cooldown_to_c"] == "79.0" and p.notes["cooldown_s"] == "1.0"


def test_start_gives_up_cooling_after_cool_s_and_says_how_hot_it_stayed():
    s = Script([(1980, 80.0, 90.0, 0)])
    p = protocol(s, max_start_c=80.0, cool_s=3.0)
    p.start()
    assert s.slept == pytest.approx(3.0) and p.notes["cooldown_to_c"] == "90.0"


def test_a_cool_gpu_starts_at_once():
    s = Script([(345, 70.0, 40.0, 1)])
    p = protocol(s)
    p.start()
    assert s.slept == 0 and "cooldown_s" not in p.notes


def test_settle_runs_until_the_clock_holds_steady_and_takes_its_median():
    # A kernel under the power limit: the clock climbs from the warm-up's idle gaps and holds near boost.
    ramp = [(1410, 300, 50, 0), (1755, 380, 51, 0), (1980, 420, 52, 0), (1965, 430, 53, 0),
            (1980, 430, 53, 0), (1980, 430, 53, 0), (1980, 430, 53, 0)]
    s = Script(ramp)
    p = protocol(s, chunk_s=0.02, min_s=0.04, window=3, tol=0.02, power_limit_w=700.0)
    settled = p.settle(s.chunk)
    assert settled.steady and settled.sm_mhz == 1980 and settled.chunks == 5
    assert p.reference == 1980 and p.notes["settled"] == "yes" and p.notes["power_capped"] == "no"
    assert p.min_sample_s == 0.0
    assert p.estimator == "median" and p.notes["estimator"] == "median"


def test_a_power_capped_kernel_settles_for_capped_settle_s_and_must_be_sampled_longer():
    # Boost at first, then the cap engages and the clock swings between ~1500 and ~1750 MHz.
    swing = [(1980, 760, 50, 0)] + [(1500 + 125 * (i % 3), 700, 55, 0x4) for i in range(100)]
    s = Script(swing)
    p = protocol(s, chunk_s=0.02, min_s=0.04, window=3, tol=0.02, capped_settle_s=0.3, capped_sample_s=0.5,
                 power_limit_w=700.0)
    settled = p.settle(s.chunk)
    assert settled.steady and p.capped and p.min_sample_s == 0.5 and settled.chunks in (15, 16)
    assert settled.sm_mhz == 1625  # the median of the swings since the cap engaged, not the boost reading
    assert p.hold(StateReading(1500, 700, 56, 0x4)) and p.hold(StateReading(1750, 700, 56, 0x4))
    assert not p.hold(StateReading(1500, 700, 90, 0x4 | 0x20))  # a thermal slowdown is still out of state
    assert p.summary()["power_capped"] == "yes"
    assert p.estimator == "mean" and p.summary()["estimator"] == "mean"  # the row's time: the samples' mean


def test_power_above_the_limit_is_not_steady_even_on_a_steady_clock():
    """The cap's controller has not acted yet: the clock still reads boost while the power is over the limit.
    That counts as capped (the clock is about to fall), never as a steady boost state."""
    s = Script([(1980, 776, 50, 0)] * 100)
    p = protocol(s, chunk_s=0.02, min_s=0.04, window=3, tol=0.02, capped_settle_s=0.3, power_limit_w=700.0)
    settled = p.settle(s.chunk)
    assert p.capped and settled.seconds >= 0.3


def test_settle_stops_at_max_s_on_a_clock_that_never_holds():
    s = Script([(1980 - 60 * i, 500, 60, 0) for i in range(100)])  # falling, uncapped (a thermal drift)
    p = protocol(s, chunk_s=0.1, min_s=0.0, max_s=1.0, window=3, tol=0.02)
    settled = p.settle(s.chunk)
    assert not settled.steady and settled.chunks in (10, 11) and p.notes["settled"] == "no (max_s reached)"


def test_hold_keeps_in_state_batches_and_discards_off_clock_or_throttled_ones():
    s = Script([(1980, 450, 60, 0)] * 3)
    p = protocol(s, min_s=0.0, tol=0.02)
    p.settle(s.chunk)
    assert p.hold(StateReading(1965, 450, 60, 0))  # within 2 %
    assert not p.hold(StateReading(1800, 600, 60, 0))  # off the settled clock: the power state moved
    assert not p.hold(StateReading(1980, 450, 90, 0x20))  # on the clock but thermally slowed
    summary = p.summary()
    assert summary["batches_discarded"] == "2" and summary["state"] == "sustained, boost"
    assert summary["timed_sm_mhz_median"] == "1965.0" and summary["timed_reasons"] == "none"


def test_hold_reanchors_on_a_gpu_that_found_a_new_steady_state():
    s = Script([(1980, 450, 60, 0)] * 3)
    p = protocol(s, min_s=0.0, tol=0.02, max_discards=2)
    p.settle(s.chunk)
    drifted = StateReading(1400, 450, 70, 0)
    assert [p.hold(drifted) for _ in range(4)] == [False, False, True, True]
    summary = p.summary()
    assert p.reference == 1400 and summary["state_reanchored"] == "1" and summary["batches_discarded"] == "2"


def test_hold_does_not_reanchor_on_off_state_batches_spread_among_kept_ones():
    """A thermal blip every tenth batch is no new steady state: the count of discards toward a re-anchor restarts
    at each kept batch (it ran on over the row, so the ninth blip was kept, made the reference, and the good
    batches after it were discarded as off its clock)."""
    s = Script([(1980, 450, 60, 0)] * 3)
    p = protocol(s, min_s=0.0, tol=0.02, max_discards=2)
    p.settle(s.chunk)
    good, blip = StateReading(1980, 450, 60, 0), StateReading(1700, 450, 90, 0x20)
    held = [p.hold(r) for _ in range(5) for r in (good, good, blip)]
    assert held == [True, True, False] * 5 and p.reference == 1980 and p.reanchored == 0
    assert p.summary()["batches_discarded"] == "5"


def test_hold_without_a_clock_to_hold_to_keeps_batches_rather_than_dividing_by_zero():
    """NVML reading an SM clock of 0 MHz (a GPU that does not report it) settled on a reference of 0, and the first
    batch held to it raised ZeroDivisionError: the row failed as a crash. No clock to hold to holds nothing."""
    s = Script([(0, 450, 60, 0)] * 3)
    p = protocol(s, min_s=0.0, tol=0.02)
    p.settle(s.chunk)
    assert p.hold(StateReading(0, 450, 60, 0)) and p.hold(StateReading(1980, 450, 60, 0))
    assert not p.hold(StateReading(1980, 450, 90, 0x20))  # thermal slowdown is still out of state


def test_the_state_label_names_what_held_the_clock():
    assert state_label([StateReading(1980, 300, 40, 0)]) == "sustained, boost"
    assert state_label([StateReading(1500, 700, 60, 0x4)]) == "sustained, power-capped"
    assert state_label([StateReading(1400, 700, 88, 0x4 | 0x20)]) == "sustained, thermal-limited"
    assert state_label([StateReading(1500, 700, 60, None), StateReading(1500, 700, 60, 0x4)]) == \
        "sustained, power-capped"


def test_a_row_whose_clock_event_reasons_nvml_cannot_read_claims_no_state():
    """With the reasons call Not Supported (None in every reading) the row read `sustained, boost` and timed reasons
    `none`, as if NVML had seen nothing holding the clock."""
    p = protocol(Script([(1980, 300, 50, None)]), min_s=0.0)
    assert p.hold(StateReading(1980, 300, 50, None))
    summary = p.summary()
    assert summary["state"] == "sustained, unknown (no clock-event reasons)" and summary["timed_reasons"] == "n/a"


def test_no_clock_readings_settle_without_a_reference_and_hold_everything():
    s = Script([(None, None, None, None)])
    p = protocol(s, min_s=0.0, max_s=0.05, chunk_s=0.01)
    settled = p.settle(s.chunk)
    assert settled.sm_mhz is None and not settled.steady
    assert p.notes["settled"] == "no (NVML gave no SM clock: max_s run)"  # not "max_s reached", as if it swung
    assert p.hold(StateReading(None, None, None, None)) and p.summary()["settled_sm_mhz"] == "n/a"


def test_one_reading_at_the_cap_is_a_transient_and_the_kernel_settles_uncapped():
    """A small kernel between sweeps at boost and 350 W that shows the cap reason once (seen on an H200): not a
    capped kernel; its row keeps the median, and the row says a transient was seen."""
    readings = [(1980, 350, 50, 0), (1965, 504, 50, 0x4)] + [(1980, 350, 50, 0)] * 100
    s = Script(readings)
    p = protocol(s, chunk_s=0.02, min_s=0.04, window=3, tol=0.02, capped_settle_s=0.3, power_limit_w=700.0)
    settled = p.settle(s.chunk)
    assert settled.steady and not p.capped and p.estimator == "median" and settled.sm_mhz == 1980
    assert p.notes["power_capped"] == "no" and p.notes["power_cap_transient"] == "1 of 14 readings"
    assert settled.seconds >= 0.3  # it waited out the capped settle before deciding


def test_a_cap_seen_on_a_quarter_of_the_readings_is_a_capped_kernel():
    readings = [(1980, 650, 50, 0)] + [(1900, 690, 55, 0x4 if i % 4 == 0 else 0) for i in range(100)]
    s = Script(readings)
    p = protocol(s, chunk_s=0.02, min_s=0.04, window=3, tol=0.02, capped_settle_s=0.3, power_limit_w=700.0)
    p.settle(s.chunk)
    assert p.capped and p.estimator == "mean" and "power_cap_transient" not in p.notes


def _run_sampling(capped, min_s, max_s, rule, per_batch_ms, target=0.01):
    """_sample over batches of 2 ms whose samples are `per_batch_ms(i)` for batch i. The batches take 2 ms of a fake
    clock, not of wall time: a batch a loaded host slept long in ran past the bounds on the sampling's length."""
    import types

    from kprof.measure import _sampling
    from kprof.measure._sampling import _sample

    count = {"i": 0}
    clock = types.SimpleNamespace(now=0.0)
    clock.perf_counter = lambda: clock.now

    def batch(k, n, during):
        during()
        clock.now += 0.002
        count["i"] += 1
        return [per_batch_ms(count["i"])] * k

    reading = StateReading(1700.0, 700.0, 60.0, 0)
    state = StateProtocol(lambda: reading, capped_sample_s=min_s, capped_max_sample_s=max_s, capped_target=target,
                          capped_block_s=0.02)
    state.capped, state.min_sample_s, state.reference = capped, min_s if capped else 0.0, 1700.0
    notes: dict = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_sampling, "time", clock)
        _samples, why = _sample(batch, 1e-4, rule, clock.perf_counter(), notes, state)
    return why, float(notes["sample_s"]), notes, state


def test_a_capped_kernel_stops_on_its_block_means_not_on_the_rule():
    """A power-capped kernel is sampled for at least its minimum and at most its maximum whatever the stopping
    rule's budget and sample cap say, and in between until the mean of its blocks is known to capped_target: a
    steady one stops at the minimum, one whose blocks swing goes on to the maximum. An uncapped kernel stops with
    the rule."""
    from kprof.measure.stats import StopRule

    tight = StopRule(budget_s=0.05, max_samples=20)
    why, took, notes, state = _run_sampling(True, 0.25, 0.6, tight, lambda i: 1.0)
    assert why == "converged" and 0.25 <= took < 0.4
    assert int(notes["batch"]) == 100  # full batches throughout, past the rule's sample cap too
    assert int(state.notes["capped_blocks"]) >= 5 and float(state.notes["capped_mean_halfwidth"]) == 0.0
    why, took, _notes, state = _run_sampling(True, 0.25, 0.6, tight, lambda i: 1.0 + 0.2 * ((i // 10) % 2))
    assert why == "budget" and 0.6 <= took < 0.8 and float(state.notes["capped_mean_halfwidth"]) > 0.01
    why, took, _notes, _state = _run_sampling(False, 0.25, 0.6, StopRule(budget_s=0.05), lambda i: 1.0)
    assert why == "converged" and took < 0.2


def test_a_capped_kernel_does_not_stop_without_samples():
    """Past its maximum, a capped kernel whose batches were all discarded (a thermal slowdown) goes on until the
    protocol re-anchors and keeps samples, rather than stopping with none."""
    import time

    from kprof.measure._sampling import _sample
    from kprof.measure.stats import StopRule

    hot = StateReading(1500.0, 700.0, 90.0, 0x20)  # thermal slowdown: every batch out of state
    state = StateProtocol(lambda: hot, capped_sample_s=0.01, capped_max_sample_s=0.01, max_discards=30)
    state.capped, state.min_sample_s, state.reference = True, 0.01, 1700.0

    def batch(k, n, during):
        during()
        time.sleep(0.002)
        return [1.0] * k

    samples, why = _sample(batch, 1e-4, StopRule(), time.perf_counter(), {}, state)
    assert why == "budget" and len(samples) >= 3 and state.discarded_total == 30 and state.reanchored == 1