"""Precision names (``precision.param_dtype``, ``precision.reduce_dtype``) and their sizes.

The estimator counts bytes with ``DTYPE_BYTES``; the trainer maps the same names to
torch dtypes with ``TORCH_NAMES`` (``getattr(torch, TORCH_NAMES[name])``). This module
imports no torch.
"""

from __future__ import annotations

#: Bytes per element of each precision name.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPES = tuple(DTYPE_BYTES)
#: The torch dtype (an attribute of ``torch``) of each precision name.
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
