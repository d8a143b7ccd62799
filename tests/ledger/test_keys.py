"""Keys: canonical, order-free, sensitive to every provenance field; the fast path equals the full one."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.errors import SpecError
from kprof.ledger import Contract, KeyMaker, Ledger, Provenance, ShapeCodec, provenance_key
from kprof.ledger import _codec
from kprof import synth
from kprof.ledger.events import Environment, Measured, Method, Stats

names = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8)
scalars = st.one_of(st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=8))
shapes = st.dictionaries(names, scalars, min_size=1, max_size=6)
provenances = st.builds(Provenance, table=names, backend=names, gpu_key=st.text(max_size=12), algorithm=st.text(max_size=6),
                        layout=st.text(max_size=6), numerics=st.text(max_size=6), timing=st.text(max_size=6),
                        profiler_revision=st.integers(0, 100), shape=shapes)


@given(provenances, st.randoms())
def test_key_ignores_shape_field_order(prov, rnd):
    items = list(prov.shape.items())
    rnd.shuffle(items)
    shuffled = msgspec.structs.replace(prov, shape=dict(items))
    assert provenance_key(shuffled) == provenance_key(prov)


FIELDS = ["table", "backend", "gpu_key", "algorithm", "layout", "numerics", "timing", "profiler_revision"]


@given(provenances, st.sampled_from(FIELDS + ["shape"]), st.data())
def test_any_change_to_any_field_changes_the_key(prov, field, data):
    old = getattr(prov, field)
    if field == "profiler_revision":
        new = data.draw(st.integers(0, 100).filter(lambda v: v != old))
    elif field == "shape":
        new = data.draw(shapes.filter(lambda s: _codec.encode(s) != _codec.encode(old)))
    else:
        new = data.draw(st.text(max_size=12).filter(lambda v: v != old))
    assert provenance_key(msgspec.structs.replace(prov, **{field: new})) != provenance_key(prov)


# What a spec's float field can hold: finite, -0.0 read as 0.0 (ShapeCodec refuses nan and inf, keys -0.0 as 0.0)
spec_scalars = st.one_of(st.booleans(), st.integers(-2**40, 2**40), st.text(max_size=8),
                         st.floats(allow_nan=False, allow_infinity=False).map(lambda v: v + 0.0))
spec_provenances = st.builds(Provenance, table=names, backend=names, gpu_key=st.text(max_size=12),
                             algorithm=st.text(max_size=6), layout=st.text(max_size=6), numerics=st.text(max_size=6),
                             timing=st.text(max_size=6), profiler_revision=st.integers(0, 100),
                             shape=st.dictionaries(names, spec_scalars, min_size=1, max_size=6))


@given(spec_provenances)
def test_prefix_fast_path_equals_full_encoding(prov):
    base = msgspec.structs.replace(prov, shape={})
    args = msgspec.defstruct("Args", [(name, type(value)) for name, value in prov.shape.items()])
    maker = KeyMaker(prov.table, prov.backend, prov.gpu_key, base.contract, ShapeCodec(args))
    assert maker.key(prov.shape) == provenance_key(prov)
    assert maker.provenance(prov.shape) == prov


def test_int_given_as_integral_float_normalizes_to_the_same_key():
    maker = synth.view.__globals__["CONTRACT"]
    keys = KeyMaker(synth.TABLE, synth.BACKEND, synth.GPU, maker, ShapeCodec(synth.SynthArgs))
    a = keys.key({"m": 128, "n": 256, "k": 64, "dtype": "bf16"})
    b = keys.key({"dtype": "bf16", "k": 64.0, "n": 256, "m": 128.0})
    assert a == b
    with pytest.raises(SpecError, match='field "m"'):
        keys.key({"m": 128.5, "n": 256, "k": 64, "dtype": "bf16"}, index=3)


@pytest.mark.parametrize("spec, message", [
    ({"m": 1, "n": 2, "k": 3, "dtype": "bf16", "backend": "torch"}, 'spec 7: field "backend" is not a KernelArgs field of SynthArgs; give the backend on its own instead (--backend; backend= in Python)'),
    ({"m": 1, "n": 2, "k": 3, "dtype": "bf16", "q": 1}, 'spec 7: field "q" is not a KernelArgs field of SynthArgs; use only {m, n, k, dtype}'),
    ({"m": 1, "n": 2, "dtype": "bf16"}, 'spec 7: field "k" is missing'),
    ({"m": "1", "n": 2, "k": 3, "dtype": "bf16"}, 'spec 7: field "m" = \'1\': Expected `int`, got `str`'),
    ([1, 2], "spec 7: expected a JSON object"),
])
def test_bad_specs_name_index_field_and_fix(spec, message):
    codec = ShapeCodec(synth.SynthArgs)
    with pytest.raises(SpecError) as err:
        codec.to_shape(spec, 7)
    assert str(err.value).startswith(message)


def test_key_is_versioned():
    prov = synth.event(1).provenance
    assert provenance_key(prov) == _codec.blake3(b"kprof/key/v1\x00" + _codec.encode(prov)).digest()
    assert provenance_key(prov) != _codec.blake3(_codec.encode(prov)).digest()


@settings(max_examples=50)
@given(st.integers(0, 10_000), st.integers(0, 3))
def test_event_round_trips_and_id_is_stable(i, seed):
    ev = synth.event(i, seed=seed)
    data = _codec.encode(ev)
    back = _codec.event_decoder.decode(data)
    assert back == ev and type(back) is Measured
    assert _codec.encode(back) == data
    assert _codec.event_id(_codec.encode(back)) == _codec.event_id(data)


def test_new_defaulted_field_does_not_change_old_bytes():
    class StatsV2(Stats, frozen=True):
        skew: float = 0.0

    s = Stats(n=1, median=1.0, p10=1.0, p90=1.0, mean=1.0, stdev=0.0, cv=0.0)
    s2 = StatsV2(n=1, median=1.0, p10=1.0, p90=1.0, mean=1.0, stdev=0.0, cv=0.0)
    assert _codec.encode(s) == _codec.encode(s2)
    assert Environment() == _codec.msgspec.msgpack.decode(_codec.encode(Environment()), type=Environment)
    assert Method(timer="cpu") == msgspec.msgpack.decode(_codec.encode(Method(timer="cpu")), type=Method)


def test_contract_is_provenance_without_shape_and_gpu():
    prov = synth.event(3).provenance
    assert prov.contract == Contract(prov.algorithm, prov.layout, prov.numerics, prov.timing, prov.profiler_revision)


def test_an_int_past_64_bits_in_an_unbounded_field_is_a_spec_error_naming_it(tmp_path):
    # SynthArgs' ints have no bounds: validation passes them, and the key's encoding cannot carry them
    led = Ledger.open(str(tmp_path / "big-int.db"))
    led.append(list(synth.events(0, 3)))
    view = synth.view(led)
    specs = [synth.spec(0)] * 5 + [{"m": 2 ** 70, "n": 128, "k": 4096, "dtype": "bf16"}]
    for lookup in (view.missing, view.get_many):
        with pytest.raises(SpecError, match=r'spec 5: field "m" = 1180591620717411303424: past the 64-bit'):
            lookup(specs)
    with pytest.raises(SpecError, match='field "m"'):
        view.keys.key({"m": -(2 ** 64), "n": 128, "k": 4096, "dtype": "bf16"})
    assert view.get(**synth.spec(1)) is not None
    led.close()
