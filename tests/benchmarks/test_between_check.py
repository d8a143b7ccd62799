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
    `tiny` and `layer` run the op's predecessors (tiny or at the model's shapes), `prev` only the last of them,
    `pages` reads one element per 2 MiB page, `stream` its buffer whole, and each `dirty*` writes its bytes of the
    foreign buffer."""
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
    before = bc.predecessors(order, "o")
    assert before and before[-1] == "attention"
    foreign = state["dirty"].view(torch.uint8)
    written = {"dirty": foreign.numel(), **{f"dirty{k}x": k * 4096 for k in bc.DIRTY_TIMES},
               **{f"dirty{m}m": m << 20 for m in bc.DIRTY_MIB}}
    expected_calls = {"tiny": ["tiny " + op for op in before], "layer": before, "prev": ["attention"]}
    reads = {"pages": state["pages"].numel(), "stream": state["stream"].numel()}  # sums of ones
    for variant in bc.VARIANTS:
        calls.clear()
        state["out"].fill_(-1)
        state["dirty"].zero_()
        between[variant]()
        assert calls == expected_calls.get(variant, []) + ["own"], variant
        assert int(state["out"]) == reads.get(variant, -1), variant
        assert int(foreign.sum()) == min(written.get(variant, 0), foreign.numel()), variant
    assert max(bc.DIRTY_TIMES) * 4096 < foreign.numel()  # so dirty1x / 2x / 4x are told apart by their byte counts


def test_variants_can_be_chosen_and_a_wrong_name_is_refused():
    assert bc.chosen_variants(None) == bc.VARIANTS
    assert bc.chosen_variants("dirty4m,layer") == ("row", "layer", "dirty4m")
    with pytest.raises(SystemExit, match="unknown dirty3m"):
        bc.chosen_variants("dirty3m")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "-2"], ["--batch", "0"]])
def test_a_count_below_one_is_refused_before_any_gpu_work(argv, monkeypatch, capsys):
    monkeypatch.setattr(bc, "cuda", lambda name: pytest.fail("the GPU was woken for a run of no rounds"))
    with pytest.raises(SystemExit) as exit_:
        bc.main(argv)
    assert exit_.value.code == 2 and f"{argv[0]} {argv[1]}: must be at least 1" in capsys.readouterr().err
