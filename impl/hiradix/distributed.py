"""Agreement across tensor-parallel ranks.

Every rank must acknowledge the same copies in the same step, or the ranks' trees drift
apart (and, under NCCL, the collectives deadlock). The cache asks for the minimum
finished count over ranks, every time, on every rank.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class RankSync(Protocol):
    def min(self, value: int) -> int:
        """The minimum of ``value`` over all ranks (every rank must call it)."""
        ...


class LocalSync:
    """A single rank: nothing to agree with."""

    def min(self, value: int) -> int:
        return value


class TorchDistributedSync:
    """all_reduce(MIN) over a process group (gloo on CPU tensors, as SGLang's TP group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        self.group = group

    def min(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())
