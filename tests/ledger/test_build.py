"""Events built by kprof.ledger.build are in canonical form as built: their bytes are the bytes a reader that
decodes and re-encodes them (a merge, an audit) recomputes, whatever numeric types the caller handed in."""

from kprof.ledger import _codec
from kprof import synth
from kprof.ledger.build import failed, measured
from kprof.ledger.events import Environment, Method, Stats


def _canonical(event) -> bool:
    data = _codec.encode(event)
    return _codec.encode(_codec.event_decoder.decode(data)) == data


def test_an_int_given_for_a_float_field_is_stored_as_the_float_it_decodes_to():
    prov = synth.event(0).provenance
    env = Environment(clocks={"sm_mhz": 1980}, power_limit_w=700)  # NVML hands these over as ints
    stats = Stats(n=3, median=1, p10=1, p90=1, mean=1, stdev=0, cv=0, min=1, max=1, samples=[1, 1, 1])
    ev = measured(prov, {"time_ms": 2, "tflops": None}, stats, Method(timer="cpu", l2="warm"), environment=env)
    assert _canonical(ev) and type(ev.environment.clocks["sm_mhz"]) is float and ev.environment.clocks["sm_mhz"] == 1980
    assert type(ev.environment.power_limit_w) is float and type(ev.stats.median) is float
    assert _canonical(failed(prov, "crash", "x", environment=env))
    assert not _canonical(msgspec_replace(ev, environment=env))  # what the round trip guards against


def msgspec_replace(event, **kw):
    import msgspec

    return msgspec.structs.replace(event, **kw)
