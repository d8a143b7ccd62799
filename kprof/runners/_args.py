"""Building blocks of KernelArgs: constrained field types shared by the kernel families."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["Size", "KernelArgs", "FloatDtype", "GemmDtype", "DTYPES"]

# A size is a positive int: zero and negative sizes are impossible values, refused at validation.
Size = Annotated[int, msgspec.Meta(gt=0, le=1 << 40)]
FloatDtype = Literal["bf16", "fp16", "fp32"]
GemmDtype = Literal["bf16", "fp16", "fp32", "fp8_e4m3"]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}


class KernelArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every table's spec. Field declaration order is the axis order of curve.json."""
