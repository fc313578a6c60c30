"""Precision names (``precision.param_dtype``, ``precision.reduce_dtype``) and their sizes.

The estimator counts bytes with ``DTYPE_BYTES``; the trainer maps the same names to
torch dtypes with ``TORCH_NAMES`` (``getattr(torch, TORCH_NAMES[name])``). Both are keyed
by ``llmforge.config.choices.Dtype`` (a member or its plain name finds the entry). This
module imports no torch.
"""

from __future__ import annotations

from llmforge.config.choices import Dtype

#: Bytes per element of each precision name.
DTYPE_BYTES: dict[str, int] = {Dtype.FP32: 4, Dtype.BF16: 2, Dtype.FP16: 2}
DTYPES = Dtype.names()
#: The torch dtype (an attribute of ``torch``) of each precision name.
TORCH_NAMES = {Dtype.FP32: "float32", Dtype.BF16: "bfloat16", Dtype.FP16: "float16"}
