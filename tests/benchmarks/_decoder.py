"""Decoder layers written only with the public callables kprof's runners time, for model_step.py.

Every kernel-launching operation of a layer is one named op. A covered op is exactly one call, with the
layout and dtype its runner uses, of:

    rms_norm           F.rms_norm(x, (hidden,), w, 1e-6)                         kprof.runners.norm
    single_gemm        a @ b, a[m,k] and b[k,n] row-major                          kprof.runners.gemm
    silu_mul           F.silu(x[:, :h]) * x[:, h:]                                 kprof.runners.activation
    attention_decode   F.scaled_dot_product_attention(q, k, v, is_causal=False,   kprof.runners.attention
    attention_prefill    enable_gqa=heads != kv_heads)  (is_causal=True for prefill)
    moe_grouped_gemm   torch._grouped_mm(x, w_t, offs=offs), w[experts, out, in]   kprof.runners.moe
                       contiguous passed transposed, offs int32 group ends

The others (KV-cache write, residual adds, MoE routing, gather and combine) are uncovered: real kernels with
no kprof table. A layer is a generator that yields each op's name before the op runs (and END after the
last), so a driver can bracket ops with synchronized timestamps or capture them one at a time.

No biases, no rotary embedding. torch is imported inside functions: importing this module needs no torch.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple

from kprof.runners.attention import SDPA_BACKENDS
from kprof.runners.moe import EXPERT_BIAS  # std of the per-expert router bias: expert loads differ as in the rows
from kprof.runners.norm import EPS

END = "end"  # yielded after a layer's last op
PAGE = 2 << 20  # a traced call records its activation's address modulo this: its place inside a large page
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class Config(NamedTuple):
    name: str
    hidden: int
    intermediate: int  # per expert for an MoE config
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0  # 0: a dense FFN
    topk: int = 0
    dtype: str = "bf16"


class Phase(NamedTuple):
    name: str
    kind: str  # decode | prefill
    batch: int
    length: int  # decode: KV-cache length attended over; prefill: prompt length

    @property
    def tokens(self) -> int:
        return self.batch if self.kind == "decode" else self.batch * self.length


class Op(NamedTuple):
    name: str
    table: str | None  # the kprof table; None: an uncovered op
    spec: dict | None


CONFIGS = {
    "qwen2.5-7b": Config("qwen2.5-7b", hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128),
    "mixtral-8x7b": Config("mixtral-8x7b", hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                           experts=8, topk=2),
}
PHASES = {
    "decode_b1": Phase("decode_b1", "decode", 1, 2048),
    "decode_b8": Phase("decode_b8", "decode", 8, 2048),
    "decode_b64": Phase("decode_b64", "decode", 64, 2048),
    "prefill_2048": Phase("prefill_2048", "prefill", 1, 2048),
}


def layer_ops(cfg: Config, ph: Phase) -> list[Op]:
    """The ops of one layer in launch order, each covered one with the kprof spec it must match exactly."""
    t, h, d, dt = ph.tokens, cfg.hidden, cfg.head_dim, cfg.dtype
    qkv_n = (cfg.heads + 2 * cfg.kv_heads) * d

    def gemm(m, n, k):
        return {"m": m, "n": n, "k": k, "dtype": dt}

    norm = {"tokens": t, "hidden": h, "dtype": dt}
    if ph.kind == "decode":
        attention = Op("attention", "attention_decode", {
            "batch": ph.batch, "kv_len": ph.length, "num_heads": cfg.heads, "num_kv_heads": cfg.kv_heads,
            "head_dim": d, "dtype": dt})
    else:
        attention = Op("attention", "attention_prefill", {
            "batch": ph.batch, "seq_len": ph.length, "num_heads": cfg.heads, "num_kv_heads": cfg.kv_heads,
            "head_dim": d, "causal": True, "dtype": dt})
    ops = [Op("attn_norm", "rms_norm", norm), Op("qkv", "single_gemm", gemm(t, qkv_n, h)), Op("kv_write", None, None),
           attention, Op("attn_out", None, None), Op("o", "single_gemm", gemm(t, h, cfg.heads * d)),
           Op("attn_residual", None, None), Op("ffn_norm", "rms_norm", dict(norm))]
    if cfg.experts:
        e, k, i = cfg.experts, cfg.topk, cfg.intermediate

        def grouped(hidden, inter):
            return {"tokens": t, "experts": e, "topk": k, "hidden": hidden, "intermediate": inter, "dtype": dt}

        ops += [Op("router", "single_gemm", gemm(t, e, h)), Op("route", None, None), Op("sort", None, None),
                Op("gather", None, None), Op("moe_gate_up", "moe_grouped_gemm", grouped(h, 2 * i)),
                Op("moe_silu_mul", "silu_mul", {"tokens": t * k, "hidden": i, "dtype": dt}),
                Op("moe_down", "moe_grouped_gemm", grouped(i, h)), Op("combine", None, None)]
    else:
        i = cfg.intermediate
        ops += [Op("gate_up", "single_gemm", gemm(t, 2 * i, h)),
                Op("silu_mul", "silu_mul", {"tokens": t, "hidden": i, "dtype": dt}),
                Op("down", "single_gemm", gemm(t, h, i))]
    return ops + [Op("ffn_residual", None, None)]


class Trace:
    """What a traced layer did: the ops it announced, in order, and each kprof call with the op it ran in."""

    def __init__(self):
        self.op: str | None = None
        self.marks: list[str] = []
        self.calls: list[tuple[str | None, str, dict, dict]] = []  # (op, table, spec, layout)
        self.addresses: list[tuple[str | None, int]] = []  # (op, its activation's address modulo PAGE)

    def mark(self, op: str) -> None:
        self.op = op
        self.marks.append(op)


class Calls:
    """The public callables kprof's runners time, called exactly as the runners call them. With a Trace,
    each call also records its table, the spec its tensors make and their layout (a few µs of host work:
    only while tracing)."""

    def __init__(self, trace: Trace | None = None):
        import torch
        import torch.nn.functional as F

        self.trace, self._torch, self._F = trace, torch, F

    def _note(self, table: str, spec: dict, layout: dict, act) -> None:
        self.trace.calls.append((self.trace.op, table, spec, layout))
        self.trace.addresses.append((self.trace.op, act.data_ptr() % PAGE))

    def rms_norm(self, x, w):
        if self.trace is not None:
            self._note("rms_norm", {"tokens": x.shape[0], "hidden": x.shape[1], "dtype": dtype_name(x)},
                       {"x_contiguous": x.is_contiguous()}, x)
        return self._F.rms_norm(x, (x.shape[-1],), w, EPS)

    def single_gemm(self, a, b):
        if self.trace is not None:
            self._note("single_gemm", {"m": a.shape[0], "n": b.shape[1], "k": a.shape[1], "dtype": dtype_name(a)},
                       {"a_contiguous": a.is_contiguous(), "b_contiguous": b.is_contiguous()}, a)
        return a @ b

    def silu_mul(self, x):
        h = x.shape[1] // 2
        if self.trace is not None:
            self._note("silu_mul", {"tokens": x.shape[0], "hidden": h, "dtype": dtype_name(x)},
                       {"x_contiguous": x.is_contiguous()}, x)
        return self._F.silu(x[:, :h]) * x[:, h:]

    def attention(self, q, k, v, causal: bool):
        gqa = q.shape[1] != k.shape[1]
        if self.trace is not None:
            b, hq, q_len, d = q.shape
            common = {"num_heads": hq, "num_kv_heads": k.shape[1], "head_dim": d, "dtype": dtype_name(q)}
            if q_len == 1 and not causal:
                table, spec = "attention_decode", {"batch": b, "kv_len": k.shape[2], **common}
            else:
                table, spec = "attention_prefill", {"batch": b, "seq_len": q_len, **common, "causal": causal}
            layout = {f"{n}_contiguous": t.is_contiguous() for n, t in (("q", q), ("k", k), ("v", v))}
            if q.is_cuda:  # the SDPA backend torch will run (the row records its own as algorithm_used)
                try:
                    choice = int(self._torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=gqa))
                    layout["sdpa_choice"] = SDPA_BACKENDS.get(choice, str(choice))
                except Exception as e:  # noqa: BLE001 - informational only
                    layout["sdpa_choice"] = f"{type(e).__name__}: {e}"
            self._note(table, spec, layout, q)
        return self._F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def grouped_mm(self, x, w_t, offs, topk: int):
        if self.trace is not None:
            self._note("moe_grouped_gemm", {"tokens": x.shape[0] // topk, "experts": w_t.shape[0], "topk": topk,
                                            "hidden": x.shape[1], "intermediate": w_t.shape[2],
                                            "dtype": dtype_name(x)},
                       {"x_contiguous": x.is_contiguous(),
                        "w_transposed_contiguous": _transposed_contiguous(w_t),
                        "offs_int32": str(offs.dtype) == "torch.int32"}, x)
        return self._torch._grouped_mm(x, w_t, offs=offs)


def _transposed_contiguous(w_t) -> bool:
    """Whether w_t[e, i, o] is a contiguous [e, o, i] tensor passed transposed (read from its strides: tracing
    dispatches no op)."""
    e, i, o = w_t.shape
    return tuple(w_t.stride()) == (i * o, 1, i)


def dtype_name(t) -> str:
    return DTYPE_NAMES.get(str(t.dtype).removeprefix("torch."), str(t.dtype))


class Weights(NamedTuple):
    attn_norm: object  # [hidden]
    wqkv: object  # [hidden, (heads + 2 kv_heads) head_dim]
    wo: object  # [heads head_dim, hidden]
    ffn_norm: object
    w_up: object  # dense: [hidden, 2 intermediate]; MoE: [experts, hidden, 2 intermediate] (transposed view)
    w_down: object  # dense: [intermediate, hidden]; MoE: [experts, intermediate, hidden] (transposed view)
    router: object = None  # MoE: [hidden, experts]
    router_bias: object = None  # MoE: [experts]


class Buffers(NamedTuple):
    """Per phase: the model input, one KV cache per layer, and MoE routing's constant ones."""

    x0: object  # [tokens, hidden]
    caches: list  # per layer [2, batch, kv_heads, length, head_dim]
    ones: object  # int32 [tokens * topk] (None for a dense config)


class Model:
    """N decoder layers with distinct weights ~ N(0, 1)/sqrt(fan_in) (norm weights ~ 1 + 0.1 N(0, 1)), drawn on
    `device` from a seeded generator."""

    def __init__(self, cfg: Config, layers: int, device: str, seed: int = 0):
        import torch

        self.cfg, self.device = cfg, device
        self.dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.dtype])
        g = torch.Generator(device).manual_seed(seed)
        self.weights = [self._layer(g) for _ in range(layers)]

    def _randn(self, g, *shape, fan_in: int | None = None):
        import torch

        t = torch.randn(*shape, generator=g, device=self.device, dtype=self.dtype)
        return t.mul_(1.0 / math.sqrt(fan_in)) if fan_in else t

    def _layer(self, g) -> Weights:
        c = self.cfg
        h, d = c.hidden, c.head_dim

        def norm():
            return self._randn(g, h).mul_(0.1).add_(1.0)

        common = dict(attn_norm=norm(), wqkv=self._randn(g, h, (c.heads + 2 * c.kv_heads) * d, fan_in=h),
                      wo=self._randn(g, c.heads * d, h, fan_in=c.heads * d), ffn_norm=norm())
        if not c.experts:
            return Weights(**common, w_up=self._randn(g, h, 2 * c.intermediate, fan_in=h),
                           w_down=self._randn(g, c.intermediate, h, fan_in=c.intermediate))
        # nn.Linear layouts [experts, out, in], contiguous; the grouped GEMM gets them transposed
        w13 = self._randn(g, c.experts, 2 * c.intermediate, h, fan_in=h)
        w2 = self._randn(g, c.experts, h, c.intermediate, fan_in=c.intermediate)
        return Weights(**common, w_up=w13.transpose(-2, -1), w_down=w2.transpose(-2, -1),
                       router=self._randn(g, h, c.experts, fan_in=h),
                       router_bias=self._randn(g, c.experts).mul_(EXPERT_BIAS))

    def buffers(self, ph: Phase, seed: int = 1) -> Buffers:
        """Decode: caches full of N(0, 1) keys and values (the new token is written at the last position);
        prefill: caches the layer fills."""
        import torch

        c = self.cfg
        g = torch.Generator(self.device).manual_seed(seed)
        shape = (2, ph.batch, c.kv_heads, ph.length, c.head_dim)
        if ph.kind == "decode":
            caches = [self._randn(g, *shape) for _ in self.weights]
        else:
            caches = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in self.weights]
        ones = (torch.ones(ph.tokens * c.topk, dtype=torch.int32, device=self.device) if c.experts else None)
        return Buffers(self._randn(g, ph.tokens, c.hidden), caches, ones)

    def layer(self, index: int, ph: Phase, buf: Buffers, x, calls: Calls) -> Iterator[str]:
        """One layer as a generator: yields each op's name before the op, END after the last; returns x."""
        w, cache = self.weights[index], buf.caches[index]
        x = yield from self._attention(ph, w, cache, x, calls)
        yield "ffn_norm"
        h = calls.rms_norm(x, w.ffn_norm)
        out = yield from (self._moe(ph, w, h, buf, calls) if self.cfg.experts else self._mlp(w, h, calls))
        yield "ffn_residual"
        x = x + out
        yield END
        return x

    def _attention(self, ph: Phase, w: Weights, cache, x, calls: Calls):
        c = self.cfg
        b, hq, hkv, d, t = ph.batch, c.heads, c.kv_heads, c.head_dim, ph.tokens
        yield "attn_norm"
        h = calls.rms_norm(x, w.attn_norm)
        yield "qkv"
        qkv = calls.single_gemm(h, w.wqkv)  # [tokens, (hq + 2 hkv) d]: q heads, then k heads, then v heads
        yield "kv_write"
        if ph.kind == "decode":
            # the new token's k and v into the last cache slot: one strided copy kernel
            cache[:, :, :, ph.length - 1].copy_(qkv[:, hq * d:].view(b, 2, hkv, d).transpose(0, 1))
        else:
            cache.copy_(qkv[:, hq * d:].view(b, ph.length, 2, hkv, d).permute(2, 0, 3, 1, 4))
        yield "attention"
        if ph.kind == "decode":
            q = qkv[:, :hq * d].view(b, hq, 1, d)  # a view: [b, hq, 1, d]
            o = calls.attention(q, cache[0], cache[1], causal=False)  # k, v: [b, hkv, kv_len, d] contiguous
        else:  # views of the GEMM output, [b, heads, seq, d] with the token stride of qkv
            q = qkv[:, :hq * d].view(b, ph.length, hq, d).transpose(1, 2)
            k = qkv[:, hq * d:(hq + hkv) * d].view(b, ph.length, hkv, d).transpose(1, 2)
            v = qkv[:, (hq + hkv) * d:].view(b, ph.length, hkv, d).transpose(1, 2)
            o = calls.attention(q, k, v, causal=True)
        yield "attn_out"
        a = o.transpose(1, 2).reshape(t, hq * d)  # a view when SDPA's output is [b, seq, heads, d] in memory
        yield "o"
        attn = calls.single_gemm(a, w.wo)
        yield "attn_residual"
        return x + attn

    def _mlp(self, w: Weights, h, calls: Calls):
        yield "gate_up"
        gu = calls.single_gemm(h, w.w_up)
        yield "silu_mul"
        act = calls.silu_mul(gu)
        yield "down"
        return calls.single_gemm(act, w.w_down)

    def _moe(self, ph: Phase, w: Weights, h, buf: Buffers, calls: Calls):
        """Mixtral's sparse FFN, capturable in a CUDA graph (no host sync): softmax top-k routing, rows sorted
        by expert (stable), counts by scatter_add, int32 cumulative group ends, grouped expert GEMMs, and a
        weighted combine of each token's top-k rows."""
        torch = calls._torch
        c = self.cfg
        t, k = ph.tokens, c.topk
        yield "router"
        logits = calls.single_gemm(h, w.router)  # [tokens, experts]
        yield "route"
        probs = torch.softmax((logits + w.router_bias).float(), dim=-1)
        top_w, top_i = probs.topk(k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        yield "sort"
        slots = top_i.reshape(-1)  # slot t*k + j: token t's j-th expert
        order = torch.sort(slots, stable=True).indices  # routed rows grouped by expert
        token_of_row = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(c.experts, dtype=torch.int32, device=h.device).scatter_add_(0, slots, buf.ones)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # group ends, as _grouped_mm's offs
        yield "gather"
        xs = h.index_select(0, token_of_row)
        yield "moe_gate_up"
        gu = calls.grouped_mm(xs, w.w_up, offs, k)
        yield "moe_silu_mul"
        act = calls.silu_mul(gu)
        yield "moe_down"
        y = calls.grouped_mm(act, w.w_down, offs, k)
        yield "combine"
        unsorted = torch.empty_like(y).index_copy_(0, order, y)  # back to slot order
        return (unsorted.view(t, k, c.hidden) * top_w.to(y.dtype).unsqueeze(-1)).sum(dim=1)

    def forward(self, ph: Phase, buf: Buffers, calls: Calls, layers: range | None = None):
        """All layers back to back from buf.x0, nothing synchronized: the output."""
        x = buf.x0
        for i in layers if layers is not None else range(len(self.weights)):
            x = run_layer(self.layer(i, ph, buf, x, calls))
        return x


def run_layer(gen, before=None):
    """Drives a layer generator to its end; `before(op)` runs before each op and once with END. Returns x."""
    while True:
        try:
            op = next(gen)
        except StopIteration as stop:
            return stop.value
        if before is not None:
            before(op)


class LayerMismatch(Exception):
    """A layer did not do what its op list says: the comparison with kprof rows would be meaningless."""


def check_trace(ops: list[Op], trace: Trace) -> dict[str, dict]:
    """Raises LayerMismatch unless the traced layer announced exactly `ops` in order (then END) and made one
    kprof call per covered op, with that op's table and spec, and none in an uncovered op. Returns each
    covered op's recorded layout."""
    want = [o.name for o in ops] + [END]
    if trace.marks != want:
        raise LayerMismatch(f"the layer announced ops {trace.marks}, the op list says {want}")
    by_op: dict[str, list] = {}
    for op, table, spec, layout in trace.calls:
        by_op.setdefault(op, []).append((table, spec, layout))
    layouts = {}
    for o in ops:
        made = by_op.pop(o.name, [])
        if o.table is None:
            if made:
                raise LayerMismatch(f"uncovered op {o.name!r} made kprof calls {[(t, s) for t, s, _ in made]}")
            continue
        if len(made) != 1:
            raise LayerMismatch(f"op {o.name!r} made {len(made)} kprof calls, expected one {o.table} call")
        table, spec, layout = made[0]
        if (table, spec) != (o.table, o.spec):
            raise LayerMismatch(f"op {o.name!r} called {table} {spec}; the op list expects {o.table} {o.spec}")
        layouts[o.name] = layout
    if by_op:
        raise LayerMismatch(f"kprof calls outside any op: {sorted(by_op, key=str)}")
    return layouts
