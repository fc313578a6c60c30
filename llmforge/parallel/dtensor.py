"""Reading the local shard of a tensor that may be a DTensor."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's shard of ``t`` (``t`` itself when it is a plain tensor or None)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of ``t``."""
    return local(t).numel()
