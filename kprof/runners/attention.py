"""attention_prefill and attention_decode through torch's scaled_dot_product_attention (SDPA).

Backend `torch` (and `torch-cpu`) lets SDPA choose its implementation (flash, efficient, cudnn, math); the
choice, read from torch._fused_sdp_choice on the built inputs, is the row's `algorithm_used`. Backends
`torch-flash`, `torch-efficient`, `torch-cudnn` and `torch-math` force one implementation: the timed call
enables only that SDPA backend, calls SDPA, and restores the previous flags. It sets the flags through the
C-level getters and setters `torch.nn.attention.sdpa_kernel` itself uses: under 1 µs of host work per
call, where entering and leaving the sdpa_kernel context manager costs 5-20 µs (its contextlib generator
and list building), which an event timer would count while the GPU waits. A CUDA graph captures the
kernels alone. A forced backend that cannot run the spec (dtype, head_dim, hardware) is Unsupported at build time.

Grouped-query attention (num_kv_heads < num_heads) uses SDPA's enable_gqa, as serving stacks call it.

Counted work per invocation: flops = 4·batch·heads·q_len·kv_len·head_dim (Q·Kᵀ and P·V), halved for a
causal square prefill; minimum bytes = q and out (batch·heads·q_len·head_dim each) + k and v
(batch·kv_heads·kv_len·head_dim each), in the spec dtype.
"""

from __future__ import annotations

import math
import warnings

from ._args import DTYPE_BYTES, FloatDtype, KernelArgs, Size
from ._case import Case, Unsupported, bind, check_close, check_shape, seed_of, torch_dtype

SDPA_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
# torch._C flag names (torch.nn.attention._backend_names) of each forceable SDPA backend
_FLAG_NAMES = {"flash": "flash", "efficient": "mem_efficient", "cudnn": "cudnn", "math": "math",
               "overrideable": "overrideable"}
ORACLE_PAIRS = 4  # (batch, head) pairs recomputed by the fp64 oracle
ORACLE_QUERIES = 64  # query positions of each pair it recomputes (every one of a shorter prompt)


def _heads_divide(spec) -> None:
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if heads % kv_heads:
        raise ValueError(f'field "num_kv_heads" = {kv_heads} does not divide num_heads ({heads}): num_heads must be a '
                         f'multiple of it (each kv head serves num_heads / num_kv_heads query heads); use a divisor of '
                         f'{heads}, e.g. {math.gcd(heads, kv_heads)}')


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


class _Flags:
    """Enables exactly one SDPA backend around a call, through the setters sdpa_kernel uses."""

    def __init__(self, backend: str):
        import torch

        names = list(_FLAG_NAMES.values())
        self._get = [getattr(torch._C, f"_get_{n}_sdp_enabled") for n in names]
        self._set = [getattr(torch._C, f"_set_sdp_use_{n}") for n in names]
        self._only = [n == _FLAG_NAMES[backend] for n in names]

    def enable(self) -> list[bool]:
        before = [get() for get in self._get]
        for set_, on in zip(self._set, self._only):
            set_(on)
        return before

    def restore(self, before: list[bool]) -> None:
        for set_, on in zip(self._set, before):
            set_(on)


def _choice(q, k, v, causal: bool, gqa: bool, flags: _Flags | None, what: str) -> str:
    """The SDPA backend torch will run for these inputs (under the forced flags, if any)."""
    import torch

    if flags is None:
        return SDPA_BACKENDS.get(int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=gqa)), "?")
    before = flags.enable()
    try:
        with warnings.catch_warnings(record=True) as seen:  # torch explains a refusal through warnings
            warnings.simplefilter("always")
            choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=gqa))
    except RuntimeError as exc:
        reasons = "; ".join(str(w.message) for w in seen) or str(exc)
        raise Unsupported(f"{what}: the forced SDPA backend cannot run this spec: {reasons}") from None
    finally:
        flags.restore(before)
    return SDPA_BACKENDS.get(choice, str(choice))


def _build(spec, device: str, q_len: int, kv_len: int, causal: bool, what: str, forced: str | None) -> Case:
    import torch
    import torch.nn.functional as F

    if torch.device(device).type == "cpu" and spec.dtype == "fp32":  # SDPA's CPU kernels multiply through oneDNN
        from .gemm import require_fp32_cpu_matmul

        require_fp32_cpu_matmul()
    dt = torch_dtype(spec.dtype)
    g = torch.Generator(device).manual_seed(seed_of(spec))  # drawn on the device: fast for large inputs
    b, hq, hkv, d = spec.batch, spec.num_heads, spec.num_kv_heads, spec.head_dim

    def tensor(heads, length):
        return torch.randn(b, heads, length, d, generator=g, device=device).to(dtype=dt)

    if torch.device(device).type == "cuda":
        # As a model's QKV projection leaves them: q (and a prompt's k, v) are head views of one packed
        # [batch, tokens, (heads + 2 kv_heads) * head_dim] output, head_dim contiguous; a decode step's k, v
        # are its contiguous cache. Contiguous copies ran a prompt's attention 13-18 % faster than the same
        # kernel inside a model.
        packed = torch.randn(b, q_len, (hq + 2 * hkv) * d, generator=g, device=device).to(dtype=dt)

        def head_view(start, heads):
            return packed[..., start * d:(start + heads) * d].view(b, q_len, heads, d).transpose(1, 2)

        q = head_view(0, hq)
        if q_len == kv_len:
            k, v = head_view(hq, hkv), head_view(hq + hkv, hkv)
        else:
            k, v = tensor(hkv, kv_len), tensor(hkv, kv_len)
    else:
        q, k, v = tensor(hq, q_len), tensor(hkv, kv_len), tensor(hkv, kv_len)
    gqa = hq != hkv
    notes = {}
    flags = _Flags(forced) if forced else None
    if forced == "math" and torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        raise Unsupported(f"{what}: the torch-math contract computes fp16/bf16 in fp32; this process allows "
                          f"fp16/bf16 reductions (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False))")
    algorithm = _choice(q, k, v, causal, gqa, flags, what)
    if forced and algorithm != forced:
        raise Unsupported(f"{what}: forcing SDPA backend {forced} selected {algorithm}")
    if algorithm == "flash" and q.device.type == "cuda":
        import torch.nn.attention as sdpa

        impl = getattr(sdpa, "current_flash_attention_impl", lambda: None)()  # FA3/FA4 when activated
        notes["flash_impl"] = str(impl or "FA2 (built in)")
    inputs = (q, k, v)

    if flags is None:
        def call(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    else:
        enable, restore = flags.enable, flags.restore

        def call(q, k, v):
            before = enable()
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            finally:
                restore(before)

    fn = bind(call, inputs)
    # (batch, head) pairs spread from (first batch, first head) to (last batch, last head): both ends of both axes, and
    # with GQA the first and last kv head. (Strides of large primes left whole halves unchecked: heads 0-3 of 8.)
    last = ORACLE_PAIRS - 1
    pairs = [(i * (b - 1) // last, i * (hq - 1) // last) for i in range(ORACLE_PAIRS)]
    # Query positions the oracle recomputes: all of a short prompt; else the first, the last and random ones. The
    # fp64 scores are [positions, kv_len]: every query's would be [q_len, kv_len], 8 GiB per pair at 32k tokens.
    rows = torch.randperm(q_len, generator=torch.Generator().manual_seed(seed_of(spec)))[:ORACLE_QUERIES - 2]
    rows = torch.cat([torch.tensor([0, q_len - 1]), rows]).unique().to(q.device)

    def check():
        out = fn()
        check_shape(out, (b, hq, q_len, d), what)
        got, ref = [], []
        for bi, hi in pairs:  # fp64 on the inputs' device: an independent plain softmax(QK^T)V
            q64 = q[bi, hi, rows].double()
            k64 = k[bi, hi // (hq // hkv)].double()
            v64 = v[bi, hi // (hq // hkv)].double()
            s = q64 @ k64.T / d ** 0.5
            if causal:  # SDPA's is_causal aligns the mask to the top-left corner: query i sees keys 0..i
                s = s.masked_fill(torch.arange(kv_len, device=s.device) > rows[:, None], float("-inf"))
            ref.append(torch.softmax(s, -1) @ v64)
            got.append(out[bi, hi, rows])
        check_close(torch.stack(got), torch.stack(ref), spec.dtype, what)

    pairs_scored = q_len * kv_len * (0.5 if causal and q_len == kv_len else 1.0)
    flops = 4.0 * b * hq * pairs_scored * d
    return Case(fn, check, flops=flops, bytes=float(_held_bytes(spec, q_len, kv_len)), algorithm=algorithm,
                notes={"sdpa_backend": algorithm, **notes}, inputs=inputs, call=call,
                # q, k, v of a prompt come from the QKV projection just run; a decode step's new q does, its
                # KV cache (read whole) does not
                warm=(0, 1, 2) if q_len == kv_len else (0,))


def _held_bytes(spec, q_len: int, kv_len: int) -> int:
    """Bytes of q, k, v and the output in their dtype: the least the case holds at once."""
    return DTYPE_BYTES[spec.dtype] * (2 * spec.batch * spec.num_heads * q_len * spec.head_dim
                                      + 2 * spec.batch * spec.num_kv_heads * kv_len * spec.head_dim)


def _peak_bytes(spec, q_len: int, kv_len: int) -> int:
    """The most a CPU build holds at once: q, k and v drawn one by one in fp32, each beside its copy in the spec's
    dtype and the copies drawn before it."""
    size = DTYPE_BYTES[spec.dtype]
    q, kv = spec.batch * spec.num_heads * q_len * spec.head_dim, spec.batch * spec.num_kv_heads * kv_len * spec.head_dim
    drawing = 4 + size * (size != 4)
    return max(_held_bytes(spec, q_len, kv_len), drawing * q, size * q + drawing * kv, size * (q + kv) + drawing * kv)


class AttentionPrefill:
    sdpa_backend: str | None = None  # None: SDPA chooses; else the one backend enabled

    @staticmethod
    def held_bytes(spec: AttentionPrefillArgs) -> int:
        return _held_bytes(spec, spec.seq_len, spec.seq_len)

    @staticmethod
    def peak_bytes(spec: AttentionPrefillArgs) -> int:
        return _peak_bytes(spec, spec.seq_len, spec.seq_len)

    def build(self, spec: AttentionPrefillArgs, device: str) -> Case:
        return _build(spec, device, spec.seq_len, spec.seq_len, spec.causal, "attention_prefill", self.sdpa_backend)


class AttentionDecode:
    sdpa_backend: str | None = None

    @staticmethod
    def held_bytes(spec: AttentionDecodeArgs) -> int:
        return _held_bytes(spec, 1, spec.kv_len)

    @staticmethod
    def peak_bytes(spec: AttentionDecodeArgs) -> int:
        return _peak_bytes(spec, 1, spec.kv_len)

    def build(self, spec: AttentionDecodeArgs, device: str) -> Case:
        return _build(spec, device, 1, spec.kv_len, False, "attention_decode", self.sdpa_backend)


# One runner class per forced SDPA backend (AttentionPrefillFlash, AttentionDecodeMath, ...): the registry
# names runners by import string, one per entry.
for _backend in ("flash", "efficient", "cudnn", "math"):
    for _base in (AttentionPrefill, AttentionDecode):
        _name = f"{_base.__name__}{_backend.capitalize()}"
        globals()[_name] = type(_name, (_base,), {"sdpa_backend": _backend, "__module__": __name__})
del _backend, _base, _name
