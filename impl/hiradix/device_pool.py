"""The device (GPU) KV pool: the KV tensors a forward pass reads, plus their page allocator.

One slot holds one token's KV for every layer. Two buffer layouts, both slot-major within
a layer so that a layer's KV is one tensor a forward pass can index by slot:

- ``mha``: ``kv[layers, 2, num_slots, heads, head_dim]`` (K at index 0, V at 1);
- ``mla``: ``kv[layers, num_slots, latent_dim]`` (one compressed latent per token).

Values move in and out as ``[layers, n, *token_shape]`` (``token_shape`` is
``(2, heads, head_dim)`` or ``(latent_dim,)``): one row per slot, whatever the layout, so
tests and engine adapters can compare bytes across tiers.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from hiradix._slots import PageAllocator, SlotError, SlotPool, check_int, is_int

KVLayout = Literal["mha", "mla"]


def check_device(device: object) -> torch.device:
    """Validate a ``device`` argument: a CPU device, or a CUDA device that exists."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise SlotError("device", f"{device!r} is not a device: {error}") from error
    if not isinstance(device, torch.device):
        raise SlotError("device", f"must be a torch.device or str, got {type(device).__name__}")
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise SlotError("device", f"must be a cpu or cuda device, got {device}")
    if not torch.cuda.is_available():
        raise SlotError("device", f"{device} requested but CUDA is not available")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise SlotError("device", f"{device} does not exist "
                                  f"({torch.cuda.device_count()} CUDA devices)")
    return device


def check_layer(layer: object, layers: int, argument: str = "layer") -> int:
    """Validate a layer index in ``[0, layers)``."""
    if not is_int(layer):
        raise SlotError(argument, f"must be an int, got {type(layer).__name__}")
    assert isinstance(layer, int)
    if not 0 <= layer < layers:
        raise SlotError(argument, f"layer {layer} is out of range [0, {layers})")
    return layer


def gather_slot_major(buffer: torch.Tensor, index: torch.Tensor, *, all_layers: bool,
                      mha: bool) -> torch.Tensor:
    """Rows ``index`` of a slot-major buffer (the whole ``kv``, or ``kv[layer]``), as a new
    tensor shaped ``[layers, n, *token_shape]`` (all layers) or ``[n, *token_shape]``.

    The slot axis of ``kv`` is 1 (+1 for the K/V axis of MHA); MHA values put the K/V axis
    after the slot axis, hence the ``movedim``.
    """
    dim = int(all_layers) + int(mha)
    return buffer.index_select(dim, index).movedim(dim, dim - int(mha))


def scatter_slot_major(buffer: torch.Tensor, index: torch.Tensor, values: torch.Tensor, *,
                       all_layers: bool, mha: bool) -> None:
    """Write ``values`` (shaped as ``gather_slot_major`` returns) into rows ``index``.
    ``index`` must hold no slot twice (``index_copy_`` would race)."""
    dim = int(all_layers) + int(mha)
    buffer.index_copy_(dim, index, values.movedim(dim - int(mha), dim))


class DeviceKVPool(SlotPool):
    """KV tensors of ``num_slots`` slots on ``device`` (zero-initialised), with a page
    allocator. Slot tensors are int64; values are ``[layers, n, *token_shape]``."""

    def __init__(
        self,
        *,
        num_slots: int,
        page_size: int,
        layers: int,
        layout: KVLayout = "mha",
        heads: int = 1,
        head_dim: int = 8,
        latent_dim: int = 16,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> None:
        allocator = PageAllocator(num_slots, page_size)  # checks num_slots and page_size
        check_int(layers, "layers", minimum=1)
        if layout not in ("mha", "mla"):
            raise SlotError("layout", f"must be 'mha' or 'mla', got {layout!r}")
        check_int(heads, "heads", minimum=1)
        check_int(head_dim, "head_dim", minimum=1)
        check_int(latent_dim, "latent_dim", minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise SlotError("dtype", f"must be a floating-point torch.dtype, got {dtype!r}")
        checked_device = check_device(device)
        self.allocator = allocator
        self.layers = layers
        self.layout: KVLayout = layout
        self.heads = heads
        self.head_dim = head_dim
        self.latent_dim = latent_dim
        self.dtype = dtype
        self.token_shape: tuple[int, ...] = (
            (2, heads, head_dim) if layout == "mha" else (latent_dim,))
        shape = ((layers, 2, num_slots, heads, head_dim) if layout == "mha"
                 else (layers, num_slots, latent_dim))
        self.kv = torch.zeros(shape, dtype=dtype, device=checked_device)
        self.device: torch.device = self.kv.device  # with its index, e.g. cuda:0

    # -- geometry --------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Bytes one slot occupies, over all layers."""
        return self.layers * math.prod(self.token_shape) * self.kv.element_size()

    def to_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Checked CPU slot ids as an index tensor on this pool's device. On CUDA the ids go
        through pinned memory without blocking the host; the copy is ordered on the
        current stream, before whatever the caller enqueues next there."""
        if self.device.type != "cuda":
            return slots
        return slots.pin_memory().to(self.device, non_blocking=True)

    def gather(self, index: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Unchecked read for the copy layer: ``index`` comes from ``check_slots`` then
        ``to_index``. Returns ``[layers, n, *token_shape]`` (``layer`` None) or
        ``[n, *token_shape]``, on this pool's device, enqueued on the current stream."""
        buffer = self.kv if layer is None else self.kv[layer]
        return gather_slot_major(buffer, index, all_layers=layer is None,
                                 mha=self.layout == "mha")

    def scatter(self, index: torch.Tensor, values: torch.Tensor, layer: int | None = None) -> None:
        """Unchecked write for the copy layer: ``index`` as for ``gather`` and holding no
        slot twice; ``values`` on this device, shaped as ``gather`` returns."""
        buffer = self.kv if layer is None else self.kv[layer]
        scatter_slot_major(buffer, index, values, all_layers=layer is None,
                           mha=self.layout == "mha")

    # -- bytes -----------------------------------------------------------------------

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` (``[layers, len(slots), *token_shape]``) into ``slots`` (no slot
        twice), on the current stream."""
        checked = self.check_slots(slots, unique=True)
        self.check_values(values, checked.numel())
        self.scatter(self.to_index(checked), values.to(self.device))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the values of ``slots``, ``[layers, len(slots), *token_shape]``, on
        this pool's device."""
        checked = self.check_slots(slots)
        return self.gather(self.to_index(checked)).contiguous()

    def layer_view(self, layer: int) -> torch.Tensor:
        """The buffer of one layer, as a forward pass indexes it by slot (a view, no copy):
        ``[2, num_slots, heads, head_dim]`` for MHA (K = ``[0]``, V = ``[1]``),
        ``[num_slots, latent_dim]`` for MLA."""
        return self.kv[check_layer(layer, self.layers)]
