"""between_check.py on CPU: its specs are valid for their tables, every op has a smaller twin, and without a
GPU it refuses with exit 2."""

import importlib.util
import pathlib

import msgspec
import pytest
import torch

from kprof.runners.registry import lookup

_spec = importlib.util.spec_from_file_location("between_check", pathlib.Path(__file__).with_name("between_check.py"))
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("op", sorted(bc.OPS))
def test_every_op_is_a_valid_spec_with_a_smaller_twin(op, batch):
    table, spec, tiny = bc.ops(batch)[op]
    args = lookup(table, "torch").args
    model, small = msgspec.convert(spec, args), msgspec.convert(tiny, args)
    size = [v for k, v in msgspec.structs.asdict(model).items() if isinstance(v, int)]
    tiny_size = [v for k, v in msgspec.structs.asdict(small).items() if isinstance(v, int)]
    assert all(t <= m for t, m in zip(tiny_size, size)) and tiny_size != size


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_without_a_gpu_exits_2(tmp_path, capsys):
    assert bc.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_each_op_follows_its_own_predecessor_in_the_layer():
    order = list(bc.OPS)
    assert order == ["attn_norm", "qkv", "attention", "o", "ffn_norm", "gate_up", "silu_mul", "down"]
    assert bc.predecessors(order, "o") == ["ffn_norm", "gate_up", "silu_mul", "down", "attn_norm", "qkv", "attention"]
    assert bc.predecessors(order, "attn_norm") == order[1:]
    assert bc.predecessors(order, "down") == order[:-1]


def test_every_variant_runs_its_preamble_on_the_cpu(monkeypatch):
    """The preambles as the GPU runs them, on CPU tensors 256 times smaller: each ends with the op's own rewrite,
    `prev` runs only the op's predecessor and `pages` reads one element per 2 MiB page."""
    calls = []

    class Case:
        def __init__(self, name):
            self.fn = lambda: calls.append(name)
            self.inputs, self.warm = [torch.zeros(4, 256), torch.zeros(256, 256)], (0,)  # 4 KiB of activations

    monkeypatch.setattr(bc, "rewrite", lambda case: lambda: calls.append("own"))
    order = list(bc.OPS)
    model = {op: Case(op) for op in order}
    tiny = {op: Case("tiny " + op) for op in order}
    state = bc.memory_state(torch, "cpu", scale=256)
    assert state["pages"].numel() == bc.PAGES_BYTES // 256 // bc.PAGE
    between = bc.hooks("o", model, tiny, state)
    assert set(between) == set(bc.VARIANTS)
    for variant in bc.VARIANTS:
        calls.clear()
        between[variant]()
        assert calls[-1] == "own", variant
        if variant == "prev":
            assert calls == ["attention", "own"]
        if variant == "layer":
            assert calls[:-1] == bc.predecessors(order, "o")
    assert int(state["out"]) == state["stream"].numel()  # the last sum read the stream buffer whole
    assert int(state["dirty"][0]) != 0
    state["dirty"].zero_()
    between["dirty2x"]()
    assert int(state["dirty"].view(torch.uint8).sum()) == 2 * 4096  # twice the op's activation bytes written


def test_variants_can_be_chosen_and_a_wrong_name_is_refused():
    assert bc.chosen_variants(None) == bc.VARIANTS
    assert bc.chosen_variants("dirty4m,layer") == ("row", "layer", "dirty4m")
    with pytest.raises(SystemExit, match="unknown dirty3m"):
        bc.chosen_variants("dirty3m")
