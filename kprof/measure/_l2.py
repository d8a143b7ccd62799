"""A cold L2 for every timed launch: the L2 size, the flush buffer, and how many input copies a graph needs."""

from __future__ import annotations

from typing import Callable

__all__ = ["l2_bytes", "flusher", "copies_for"]

_FALLBACK_L2 = 128 << 20  # when the device does not report its L2 size: above any current GPU's L2


def l2_bytes(device_index: int) -> int:
    """The device's L2 size in bytes (H200: 60 MiB), or a generous fallback when torch does not say."""
    import torch

    size = int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0) or 0)
    return size if size > 0 else _FALLBACK_L2


def flusher(device_index: int) -> tuple[Callable[[], object], int]:
    """(flush, bytes): `flush()` writes a buffer of twice the L2 with one fill kernel on the current stream,
    evicting every line the previous launch left. It runs between timed launches, never inside one."""
    import torch

    nbytes = 2 * l2_bytes(device_index)
    buf = torch.empty((nbytes + 3) // 4, dtype=torch.int32, device=torch.device("cuda", device_index))
    return buf.zero_, buf.numel() * 4  # the bound method keeps the buffer alive


def copies_for(input_bytes: int, l2: int) -> int:
    """Input copies a graph must rotate through so that their total bytes exceed 2x L2."""
    if input_bytes <= 0:
        raise ValueError("input_bytes must be positive")
    return 2 * l2 // input_bytes + 1
