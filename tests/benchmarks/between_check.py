#!/usr/bin/env python
"""Does what runs between two calls of a decode kernel change its time? One call on one GPU.

Decode kernels composed from kprof rows read 2-5 % below the same kernels inside 16-layer models
(docs/PERFORMANCE.md), at the same clock and L2 protocol; more weight allocations and a busy GPU were ruled
out. Inside a model each kernel follows the other kernels of its layer; a row's call follows only the L2 sweep
and the rewrite of its activations. This times each of eight Qwen2.5-7B decode ops (rms_norm, the qkv GEMM,
attention over a 2,048-token KV cache, the o GEMM, rms_norm, the gate_up GEMM, silu_mul, the down GEMM; batch
1, or --batch) with kprof's timer (CUPTI, cold L2 by a read sweep), with fifteen things between its calls, outside
the timed region, after the sweep:

  row       nothing more (kprof's row)
  same      ten launches of one tiny kernel (an in-place add on 4 KiB): more kernels, no new code
  tiny      the other seven ops at tiny shapes (their kernels' code, almost none of their data)
  layer     the other seven ops at the model's shapes, in the layer's order up to the op (their code and data)
  prev      only the op's own predecessor in the layer, at the model's shape
  pages     one 2-byte read in each 2 MiB page of a 4 GiB buffer: many pages' translations, almost no data
  stream    a 512 MiB buffer read whole: a heavy read stream of new data
  dirty     16 MiB written: dirty lines in L2, as a predecessor's outputs leave them
  dirtyKx   K (1, 2, 4) times the op's activation bytes written to a buffer of its own: foreign dirty lines in
            proportion to the op's inputs
  dirtyNm   N (1, 2, 4, 8) MiB written to that buffer: foreign dirty lines of a fixed amount

`--variants a,b,c` times only those (row always); all of them by default.

Each variant is timed in ROUNDS interleaved rounds; the figure is the median of the rounds' medians, and each
variant's change against `row`. If `tiny` moves the time as far as `layer`, a kernel's code and launch state
(instruction and constant caches) are what a row lacks; if only `layer` does, its predecessors' data.

    python tests/benchmarks/between_check.py [--out DIR] [--rounds 3] [--batch 1] [--variants a,b]

`--batch` is the decode batch (the ops' tokens; 1 by default; run 10 timed six ops, without attention and the
second norm, at batch 1). Writes between_check_b<batch>.json under --out ($OUT, else .); prints the table last.
"""

from __future__ import annotations

import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # _variants lives beside this file, however the script is started
    sys.path.insert(0, _HERE)
from _variants import arguments, cuda, time_variants, written  # noqa: E402

ROUNDS = 3
HIDDEN, INTER, QKV = 3584, 18944, 4608  # Qwen2.5-7B: hidden, intermediate, (28 + 2*4) heads x 128
KV_LEN = 2048  # the KV cache model_step's decode attends over


def ops(batch: int = 1) -> dict:
    """name: (table, model-shape spec, tiny spec) of each op at decode batch `batch` (its tokens)."""
    t = batch
    return {
        "attn_norm": ("rms_norm", {"tokens": t, "hidden": HIDDEN, "dtype": "bf16"},
                      {"tokens": 1, "hidden": 256, "dtype": "bf16"}),
        "qkv": ("single_gemm", {"m": t, "n": QKV, "k": HIDDEN, "dtype": "bf16"},
                {"m": 1, "n": 256, "k": 256, "dtype": "bf16"}),
        "attention": ("attention_decode", {"batch": t, "kv_len": KV_LEN, "num_heads": 28, "num_kv_heads": 4,
                                           "head_dim": 128, "dtype": "bf16"},
                      {"batch": 1, "kv_len": 16, "num_heads": 4, "num_kv_heads": 1, "head_dim": 128, "dtype": "bf16"}),
        "o": ("single_gemm", {"m": t, "n": HIDDEN, "k": HIDDEN, "dtype": "bf16"},
              {"m": 1, "n": 128, "k": 256, "dtype": "bf16"}),
        "ffn_norm": ("rms_norm", {"tokens": t, "hidden": HIDDEN, "dtype": "bf16"},
                     {"tokens": 1, "hidden": 256, "dtype": "bf16"}),
        "gate_up": ("single_gemm", {"m": t, "n": 2 * INTER, "k": HIDDEN, "dtype": "bf16"},
                    {"m": 1, "n": 512, "k": 256, "dtype": "bf16"}),
        "silu_mul": ("silu_mul", {"tokens": t, "hidden": INTER, "dtype": "bf16"},
                     {"tokens": 1, "hidden": 256, "dtype": "bf16"}),
        "down": ("single_gemm", {"m": t, "n": HIDDEN, "k": INTER, "dtype": "bf16"},
                 {"m": 1, "n": 256, "k": 512, "dtype": "bf16"}),
    }


OPS = ops(1)
DIRTY_TIMES, DIRTY_MIB = (1, 2, 4), (1, 2, 4, 8)
VARIANTS = ("row", "same", "tiny", "layer", "prev", "pages", "stream", "dirty", *(f"dirty{k}x" for k in DIRTY_TIMES),
            *(f"dirty{m}m" for m in DIRTY_MIB))
PAGE, PAGES_BYTES, STREAM_BYTES, DIRTY_BYTES = 2 << 20, 4 << 30, 512 << 20, 16 << 20


def build(table: str, spec: dict):
    import msgspec

    from kprof.runners.registry import lookup

    entry = lookup(table, "torch")
    return entry.load_runner()().build(msgspec.convert(spec, entry.args), "cuda")


def rewrite(case):
    """The row's own step after the sweep: its activations rewritten in place (see kprof.runners.cuda_device)."""
    import torch

    from kprof.measure._l2 import rewriter

    return rewriter(torch, [case.inputs[i] for i in case.warm])


def predecessors(order: list, name: str) -> list:
    """The other ops in the layer's cycle before `name`: the rest of the previous layer, then this one's ops up to
    it, so that its own predecessor in the model runs last."""
    i = order.index(name)
    return order[i + 1:] + order[:i]


def hooks(name: str, model: dict, tiny: dict, state: dict):
    """Per variant, what runs after the sweep and before the call of op `name` (`state`: memory_state's buffers)."""
    import torch

    own = rewrite(model[name])
    scratch = torch.zeros(1024, device=state["out"].device)
    others = predecessors(list(model), name)

    def same():
        for _ in range(10):
            scratch.add_(0)
        own()

    def tiny_ops():
        for op in others:
            tiny[op].fn()
        own()

    def layer_ops():
        for op in others:
            model[op].fn()
        own()

    def prev():
        model[others[-1]].fn()
        own()

    def pages():
        torch.sum(state["pages"], dim=0, out=state["out"])
        own()

    def stream():
        torch.sum(state["stream"], dim=0, out=state["out"])
        own()

    activation = sum(model[name].inputs[i].numel() * model[name].inputs[i].element_size() for i in model[name].warm)
    foreign = state["dirty"].view(torch.uint8)

    def writing(nbytes: int):
        """The first `nbytes` of the foreign buffer written (dirty in L2), then the op's own rewrite."""
        part = foreign[: min(nbytes, foreign.numel())]

        def write():
            part.fill_(1)
            own()
        return write

    dirty = {"dirty": writing(foreign.numel()), **{f"dirty{k}x": writing(k * activation) for k in DIRTY_TIMES},
             **{f"dirty{m}m": writing(m << 20) for m in DIRTY_MIB}}
    return {"row": own, "same": same, "tiny": tiny_ops, "layer": layer_ops, "prev": prev, "pages": pages,
            "stream": stream, **dirty}


def memory_state(torch, device: str = "cuda", scale: int = 1) -> dict:
    """The buffers of the memory-state variants: `pages` one 2-byte read per 2 MiB page of a 4 GiB buffer (2,048
    pages, 4 KiB of data: the address translation of a large working set, almost no traffic), `stream` a 512 MiB
    buffer read whole, `dirty` 16 MiB written (each `scale` times smaller: a CPU test's)."""
    big = torch.ones(PAGES_BYTES // scale // 2, dtype=torch.int16, device=device)
    return {"pages": big.view(-1, PAGE // 2)[:, 0], "out": torch.empty((), dtype=torch.int64, device=device),
            "stream": torch.ones(STREAM_BYTES // scale // 4, dtype=torch.int32, device=device),
            "dirty": torch.empty(DIRTY_BYTES // scale // 4, dtype=torch.int32, device=device)}


def chosen_variants(text: str | None) -> tuple:
    """`row` and the variants named in `text` (comma-separated), in VARIANTS' order; all where None."""
    if not text:
        return VARIANTS
    names = set(text.split(","))
    unknown = names - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    return tuple(v for v in VARIANTS if v == "row" or v in names)


def main(argv=None) -> int:
    args = arguments(__doc__, argv, ROUNDS, batch=1, variants=True)
    torch = cuda("between_check")
    if torch is None:
        return 2
    started = time.perf_counter()
    chosen = ops(args.batch)
    model = {op: build(t, spec) for op, (t, spec, _tiny) in chosen.items()}
    tiny = {op: build(t, spec) for op, (t, _spec, spec) in chosen.items()}
    for case in list(model.values()) + list(tiny.values()):
        case.check()
    state = memory_state(torch)
    between = {op: hooks(op, model, tiny, state) for op in chosen}
    variants = chosen_variants(args.variants)
    medians, kernels = time_variants({op: case.fn for op, case in model.items()}, between, variants, args.rounds)
    about = {op: {"table": t, "spec": s, "tiny_spec": ts} for op, (t, s, ts) in chosen.items()}
    figures = written(torch, args.out, f"between_check_b{args.batch}", args.rounds, started, medians, kernels,
                      batch=args.batch, ops=about)["figures_us"]
    print(f"decode batch {args.batch}")
    print(f"{'op':10s} {'row µs':>8s} " + " ".join(f"{v:>8s}" for v in variants[1:]) + "   (change against row)")
    for op, f in figures.items():
        print(f"{op:10s} {f['row']:8.2f} " + " ".join(f"{(f[v] / f['row'] - 1) * 100:+7.1f}%" for v in variants[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
