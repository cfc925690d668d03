"""Copy kernels between the device and host KV pools (issue 33), optional: they need Triton.

``addressing`` is the index math (plain Python); ``triton_copy`` the kernels and their
launcher, importable only where Triton is. ``load_copier`` is the one way in for the rest
of hiradix: the copier for two pools, or the one-line reason there is none, so a caller
falls back to its staging path and can say why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool


@dataclass(frozen=True)
class PreparedCopy:
    """The indexes of one copy on the kernel's device, by page or by slot: they must stay
    alive until the copy's last kernel has run (``CudaCopyEngine`` keeps them in its
    ``Copy``)."""

    device_index: torch.Tensor
    host_index: torch.Tensor
    by_pages: bool


class Copier(Protocol):
    """Moves a copy's rows between the device pool and the host pool it was built for,
    enqueued on the current stream, reading and writing the host pool in place."""

    def prepare(self, device_slots: torch.Tensor, host_slots: torch.Tensor
                ) -> PreparedCopy: ...

    def d2h(self, copy: PreparedCopy) -> None: ...

    def h2d_layer(self, copy: PreparedCopy, layer: int) -> None: ...


def triton_missing() -> str | None:
    """Why Triton cannot be used here (one line), or None where it imports."""
    try:
        import triton  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: F401
    except ImportError as error:
        return (f"triton does not import ({error}); pip install 'hiradix[triton]' or a CUDA "
                "build of torch, which ships it")
    return None


def load_copier(device_pool: DeviceKVPool, host_pool: HostKVPool) -> Copier | str:
    """The Triton copier for a CUDA device pool and a pinned host pool, or why not."""
    missing = triton_missing()
    if missing is not None:
        return missing
    if device_pool.device.type != "cuda":
        return f"the device pool is on {device_pool.device}: the kernels run on CUDA"
    if not host_pool.pinned:
        return "the host pool is not pinned: the GPU cannot read or write it in place"
    from hiradix.kernels.triton_copy import PageCopier  # imports Triton

    copier: Copier = PageCopier(device_pool, host_pool)
    return copier
