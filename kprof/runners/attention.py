"""attention_prefill and attention_decode through torch's scaled_dot_product_attention (SDPA).

The SDPA backend torch selects for the inputs (flash, efficient, cudnn, math) is recorded with the row.
Grouped-query attention (num_kv_heads < num_heads) uses SDPA's enable_gqa, as serving stacks call it.
"""

from __future__ import annotations

from ._args import DTYPE_BYTES, FloatDtype, KernelArgs, Size
from ._case import Case, check_close, seed_of, torch_dtype

SDPA_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
ORACLE_PAIRS = 4  # (batch, head) pairs recomputed by the fp64 oracle


def _heads_divide(spec) -> None:
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.num_kv_heads})")


class AttentionPrefillArgs(KernelArgs, frozen=True):
    batch: Size
    seq_len: Size
    num_heads: Size
    num_kv_heads: Size
    head_dim: Size
    causal: bool
    dtype: FloatDtype

    def __post_init__(self):
        _heads_divide(self)


class AttentionDecodeArgs(KernelArgs, frozen=True):
    batch: Size
    kv_len: Size
    num_heads: Size
    num_kv_heads: Size
    head_dim: Size
    dtype: FloatDtype

    def __post_init__(self):
        _heads_divide(self)


def _build(spec, device: str, q_len: int, kv_len: int, causal: bool, what: str) -> Case:
    import torch
    import torch.nn.functional as F

    dt = torch_dtype(spec.dtype)
    g = torch.Generator().manual_seed(seed_of(spec))
    b, hq, hkv, d = spec.batch, spec.num_heads, spec.num_kv_heads, spec.head_dim

    def tensor(heads, length):
        return torch.randn(b, heads, length, d, generator=g).to(device=device, dtype=dt)

    q, k, v = tensor(hq, q_len), tensor(hkv, kv_len), tensor(hkv, kv_len)
    gqa = hq != hkv
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=gqa)
    algorithm = SDPA_BACKENDS.get(int(choice), str(choice))

    def fn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    pairs = [(i * 7919 % b, i * 104729 % hq) for i in range(ORACLE_PAIRS)]

    def check():
        out = fn().cpu()
        got, ref = [], []
        for bi, hi in pairs:
            q64 = q[bi, hi].double().cpu()
            k64 = k[bi, hi // (hq // hkv)].double().cpu()
            v64 = v[bi, hi // (hq // hkv)].double().cpu()
            s = q64 @ k64.T / d ** 0.5
            if causal:  # SDPA's is_causal aligns the mask to the top-left corner
                s = s.masked_fill(torch.ones(q_len, kv_len, dtype=torch.bool).triu(1), float("-inf"))
            ref.append(torch.softmax(s, -1) @ v64)
            got.append(out[bi, hi])
        check_close(torch.stack(got), torch.stack(ref), spec.dtype, what)

    pairs_scored = q_len * kv_len * (0.5 if causal and q_len == kv_len else 1.0)
    flops = 4.0 * b * hq * pairs_scored * d
    size = DTYPE_BYTES[spec.dtype]
    moved = size * (2 * b * hq * q_len * d + 2 * b * hkv * kv_len * d)
    return Case(fn, check, flops=flops, bytes=float(moved), algorithm=algorithm, notes={"sdpa_backend": algorithm})


class AttentionPrefill:
    def build(self, spec: AttentionPrefillArgs, device: str) -> Case:
        return _build(spec, device, spec.seq_len, spec.seq_len, spec.causal, "attention_prefill")


class AttentionDecode:
    def build(self, spec: AttentionDecodeArgs, device: str) -> Case:
        return _build(spec, device, 1, spec.kv_len, False, "attention_decode")
