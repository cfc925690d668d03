"""The host KV pool: CPU (pinned when CUDA is present) copies of device KV, page by page.

It mirrors one ``DeviceKVPool``'s geometry (page size, layers, MHA/MLA kind, token shape,
dtype) with its own slots and allocator. Two buffer layouts:

- ``layer_first``: the device layout (``[layers, 2, num_slots, heads, head_dim]`` or
  ``[layers, num_slots, latent_dim]``), so a copy is one ``index_select``/``index_copy_``
  per layer;
- ``page_first``: ``[num_pages, layers, 2, page_size, heads, head_dim]`` or
  ``[num_pages, layers, page_size, latent_dim]``: one page is contiguous over all layers,
  which is what a storage tier below wants to move.

Reads and writes use ``[layers, n, *token_shape]`` values whatever the layout.

Device-to-host copies come in two halves (``begin_from_device``, then ``land``) because the
final write into arbitrary host slots is a CPU scatter, which no CUDA stream can order: the
bytes are gathered on the device and DMA'd into a pinned staging tensor, and only after
that DMA has completed are they scattered into the pool. Scattering straight from a
``non_blocking`` D2H result would read the staging memory before the DMA wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from types import ModuleType
from typing import Literal

import torch

from hiradix._slots import PageAllocator, SlotError, SlotPool, check_int, native_core
from hiradix.device_pool import (
    DeviceKVPool,
    KVLayout,
    check_layer,
    gather_slot_major,
    scatter_slot_major,
)

HostLayout = Literal["layer_first", "page_first"]


@dataclass
class StagedCopy:
    """The first half of a device-to-host copy: its bytes are (or, once ``ready`` has
    fired, will be) in ``staging``; ``HostKVPool.land`` puts them into ``host_slots``."""

    pool: HostKVPool  # the pool that began it, the only one that may land it
    host_slots: torch.Tensor  # checked CPU slot ids of ``pool``, none twice
    layer: int | None  # None: all layers
    staging: torch.Tensor  # CPU; [layers, n, *token_shape], or [n, *token_shape] for a layer
    ready: torch.cuda.Event | None  # fires when the DMA into staging is done; None: done
    keep_alive: tuple[torch.Tensor, ...]  # device-side tensors the DMA still uses
    landed: bool = False


def resolve_pin(pin_memory: object) -> bool:
    """``pin_memory`` None means: pin iff CUDA is available. Pinning without CUDA fails."""
    if pin_memory is None:
        return torch.cuda.is_available()
    if not isinstance(pin_memory, bool):
        raise SlotError("pin_memory", f"must be a bool or None, got {type(pin_memory).__name__}")
    if pin_memory and not torch.cuda.is_available():
        raise SlotError("pin_memory", "pinned memory needs CUDA, which is not available")
    return pin_memory


def host_slots_for(device_pool: DeviceKVPool, ratio: object, size_bytes: object) -> int:
    """Host capacity, in slots, from exactly one of ``ratio`` (of the device capacity) or
    ``size_bytes``; rounded down to whole pages, at least one page."""
    if (ratio is None) == (size_bytes is None):
        raise SlotError("ratio/size_bytes", "give exactly one of ratio and size_bytes")
    page = device_pool.page_size
    if ratio is not None:
        if not isinstance(ratio, int | float) or isinstance(ratio, bool):
            raise SlotError("ratio", f"must be a number, got {type(ratio).__name__}")
        if not math.isfinite(ratio) or ratio <= 0:
            raise SlotError("ratio", f"must be finite and > 0, got {ratio}")
        # The decimal the caller wrote (0.29, not 0.28999...), so 0.29 * 100 slots is 29.
        exact = Fraction(repr(ratio)) if isinstance(ratio, float) else Fraction(ratio)
        slots, argument = math.floor(exact * device_pool.num_slots), "ratio"
    else:
        check_int(size_bytes, "size_bytes", minimum=1)
        assert isinstance(size_bytes, int)
        slots, argument = size_bytes // device_pool.bytes_per_token, "size_bytes"
    slots -= slots % page
    if slots < page:
        raise SlotError(argument, f"gives fewer than one page ({page} slots) of host memory")
    return slots


class HostKVPool(SlotPool):
    """Host copies of KV with the geometry of a device pool, in ``num_slots`` slots of
    their own; on CPU, pinned if ``pin_memory`` (None: iff CUDA is available)."""

    def __init__(self, device_pool: DeviceKVPool, *, num_slots: int,
                 layout: HostLayout = "layer_first", pin_memory: bool | None = None) -> None:
        if not isinstance(device_pool, DeviceKVPool):
            raise SlotError("device_pool", f"must be a DeviceKVPool, got "
                                           f"{type(device_pool).__name__}")
        if layout not in ("layer_first", "page_first"):
            raise SlotError("layout", f"must be 'layer_first' or 'page_first', got {layout!r}")
        pinned = resolve_pin(pin_memory)
        self.allocator = PageAllocator(num_slots, device_pool.page_size)  # checks num_slots
        self.layout: HostLayout = layout
        self.kv_layout: KVLayout = device_pool.layout
        self.layers = device_pool.layers
        self.token_shape = device_pool.token_shape
        self.dtype = device_pool.dtype
        self.bytes_per_token = device_pool.bytes_per_token
        self.pinned = pinned
        self.kv = torch.empty(self._buffer_shape(), dtype=self.dtype, pin_memory=pinned).zero_()
        # ``_row_plan``'s cache: the device pool it was made for, and the plan.
        self._plan_for: DeviceKVPool | None = None
        self._plan: RowPlan | None = None
        self._bits = native_core()  # the core is picked when the pool is built

    @classmethod
    def for_device(cls, device_pool: DeviceKVPool, *, ratio: float | None = None,
                   size_bytes: int | None = None, layout: HostLayout = "layer_first",
                   pin_memory: bool | None = None) -> HostKVPool:
        """A host pool for ``device_pool`` sized by exactly one of ``ratio`` (host slots =
        floor(ratio * device slots)) or ``size_bytes`` (floor(size_bytes / bytes_per_token)
        slots), rounded down to whole pages; at least one page."""
        if not isinstance(device_pool, DeviceKVPool):
            raise SlotError("device_pool", f"must be a DeviceKVPool, got "
                                           f"{type(device_pool).__name__}")
        num_slots = host_slots_for(device_pool, ratio, size_bytes)
        return cls(device_pool, num_slots=num_slots, layout=layout, pin_memory=pin_memory)

    def _buffer_shape(self) -> tuple[int, ...]:
        if self.layout == "layer_first":
            if self.kv_layout == "mha":
                return (self.layers, 2, self.num_slots, *self.token_shape[1:])
            return (self.layers, self.num_slots, *self.token_shape)
        pages, size = self.num_slots // self.page_size, self.page_size
        if self.kv_layout == "mha":
            return (pages, self.layers, 2, size, *self.token_shape[1:])
        return (pages, self.layers, size, *self.token_shape)

    # -- geometry --------------------------------------------------------------------

    def mismatch(self, device_pool: DeviceKVPool) -> str | None:
        """Why ``device_pool``'s geometry differs from this pool's, or None if it does not."""
        mine = (self.page_size, self.layers, self.kv_layout, self.token_shape, self.dtype)
        theirs = (device_pool.page_size, device_pool.layers, device_pool.layout,
                  device_pool.token_shape, device_pool.dtype)
        if mine == theirs:
            return None
        return (f"geometry (page_size, layers, layout, token_shape, dtype) {theirs} differs "
                f"from the host pool's {mine}")

    def _page_index(self, slots: torch.Tensor, layer: int | None
                    ) -> tuple[torch.Tensor | slice, ...]:
        """The advanced index of ``slots`` into ``kv`` (``layer`` None) or ``kv[:, layer]``
        of the page_first layout: (page, the layer and K/V axes, offset in page)."""
        between = int(layer is None) + int(self.kv_layout == "mha")
        return (slots // self.page_size, *([slice(None)] * between), slots % self.page_size)

    def _gather(self, slots: torch.Tensor, layer: int | None) -> torch.Tensor:
        """A new CPU tensor of the values of checked ``slots``: ``[layers, n, *token_shape]``
        (``layer`` None) or ``[n, *token_shape]``."""
        if self.layout == "layer_first":
            buffer = self.kv if layer is None else self.kv[layer]
            return gather_slot_major(buffer, slots, all_layers=layer is None,
                                     mha=self.kv_layout == "mha")
        buffer = self.kv if layer is None else self.kv[:, layer]
        picked = buffer[self._page_index(slots, layer)]  # the slot axis comes first
        return picked if layer is not None else picked.movedim(0, 1)

    def _scatter(self, slots: torch.Tensor, values: torch.Tensor, layer: int | None) -> None:
        """Write CPU ``values`` (shaped as ``_gather`` returns) into checked ``slots``, which
        hold no slot twice."""
        if self.layout == "layer_first":
            buffer = self.kv if layer is None else self.kv[layer]
            scatter_slot_major(buffer, slots, values, all_layers=layer is None,
                               mha=self.kv_layout == "mha")
            return
        buffer = self.kv if layer is None else self.kv[:, layer]
        buffer[self._page_index(slots, layer)] = values if layer is not None else \
            values.movedim(1, 0)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` (``[layers, len(slots), *token_shape]``) into ``slots`` (no slot
        twice)."""
        checked = self.check_slots(slots, unique=True)
        self.check_values(values, checked.numel())
        self._scatter(checked, values.to("cpu"), None)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the values of ``slots``, ``[layers, len(slots), *token_shape]`` (CPU)."""
        return self._gather(self.check_slots(slots), None).contiguous()

    # -- copies between the tiers --------------------------------------------------------

    def _check_copy(self, device_pool: object, device_slots: object, host_slots: object,
                    layer: object, non_blocking: object, *, to_host: bool
                    ) -> tuple[DeviceKVPool, torch.Tensor, torch.Tensor, int | None]:
        """Validate a copy's arguments; return the device pool, both slot tensors (CPU)
        and the layer. The destination may hold no slot twice."""
        if not isinstance(device_pool, DeviceKVPool):
            raise SlotError("device_pool", f"must be a DeviceKVPool, got "
                                           f"{type(device_pool).__name__}")
        reason = self.mismatch(device_pool)
        if reason is not None:
            raise SlotError("device_pool", reason)
        device = device_pool.check_slots(device_slots, "device_slots", unique=not to_host)
        host = self.check_slots(host_slots, "host_slots", unique=to_host)
        if device.numel() != host.numel():
            raise SlotError("host_slots", f"holds {host.numel()} slots but device_slots holds "
                                          f"{device.numel()}")
        checked_layer = None if layer is None else check_layer(layer, self.layers)
        if not isinstance(non_blocking, bool):
            raise SlotError("non_blocking", f"must be a bool, got {type(non_blocking).__name__}")
        if non_blocking and not self.pinned:
            raise SlotError("non_blocking", "needs a pinned host pool")
        return device_pool, device, host, checked_layer

    def begin_from_device(self, device_pool: DeviceKVPool, device_slots: torch.Tensor,
                          host_slots: torch.Tensor, *, layer: int | None = None,
                          non_blocking: bool = False) -> StagedCopy:
        """First half of a device-to-host copy, enqueued on the current stream: gather
        ``device_slots`` on the device and copy them into a CPU staging tensor. With
        ``non_blocking`` (pinned pools only) on a CUDA device the host does not wait; the
        returned ``ready`` event fires when the staging bytes are there. The device bytes
        are read when the stream gets there, not now. Nothing in this pool changes until
        ``land``."""
        pool, device, host, layer = self._check_copy(device_pool, device_slots, host_slots,
                                                     layer, non_blocking, to_host=True)
        return self._begin(pool, device, host, layer, non_blocking)

    def _begin(self, pool: DeviceKVPool, device: torch.Tensor, host: torch.Tensor,
               layer: int | None, non_blocking: bool) -> StagedCopy:
        """``begin_from_device`` on arguments ``_check_copy`` has passed."""
        index = pool.to_index(device)
        gathered = pool.gather(index, layer).contiguous()
        if pool.device.type == "cuda" and non_blocking:
            staging = torch.empty(gathered.shape, dtype=self.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(pool.device))
            return StagedCopy(self, host, layer, staging, ready, (index, gathered))
        # Blocking: on CUDA this waits for the current stream; on CPU, gathered is new.
        return StagedCopy(self, host, layer, gathered.to("cpu"), None, ())

    def land(self, staged: StagedCopy) -> None:
        """Second half: wait for the staging DMA (if still running), then write the staged
        bytes into their host slots. Each staged copy lands once."""
        if not isinstance(staged, StagedCopy):
            raise SlotError("staged", f"must be a StagedCopy, got {type(staged).__name__}")
        if staged.pool is not self:
            raise SlotError("staged", "was begun by another host pool")
        if staged.landed:
            raise SlotError("staged", "has already landed")
        if staged.ready is not None:
            staged.ready.synchronize()
        self._scatter(staged.host_slots, staged.staging, staged.layer)
        staged.landed = True

    def copy_from_device(self, device_pool: DeviceKVPool, device_slots: torch.Tensor,
                         host_slots: torch.Tensor, layer: int | None = None,
                         non_blocking: bool = False) -> None:
        """Copy ``device_slots`` of ``device_pool`` into ``host_slots`` (no slot twice), one
        layer or all (``layer`` None). The host bytes are in place on return: with
        ``non_blocking`` the DMA runs through pinned staging and the host waits for that
        copy alone (not for the whole device); use ``begin_from_device``/``land`` to not
        wait at all."""
        pool, device, host, checked = self._check_copy(device_pool, device_slots, host_slots,
                                                       layer, non_blocking, to_host=True)
        self.copy_from_device_unchecked(pool, device, host, checked, non_blocking)

    def copy_from_device_unchecked(self, device_pool: DeviceKVPool, device_slots: torch.Tensor,
                                   host_slots: torch.Tensor, layer: int | None = None,
                                   non_blocking: bool = False) -> None:
        """``copy_from_device`` without its argument checks, for callers whose arguments
        are valid by construction (the copy engine, which checked them at ``submit``; the
        cache, copying slots its allocators handed out): CPU int64 slot tensors of equal
        length, in range, no host slot twice; a pool of this geometry. Validated once at
        the public boundary, not again on every internal hop (issue 13)."""
        plan = None if layer is not None else self._row_plan(device_pool)
        if plan is not None:
            plan.copy(plan.device, device_slots, plan.host, host_slots)
            return
        self.land(self._begin(device_pool, device_slots, host_slots, layer, non_blocking))

    def _row_plan(self, pool: DeviceKVPool) -> RowPlan | None:
        """How a whole copy goes row to row with ``pool``, with no staging; None unless
        both buffers are on the CPU in the same slot-major layout (the common CPU case,
        and the fast one). Worked out once per device pool (neither buffer is ever
        replaced): the shapes and views cost more than a small copy (issue 13)."""
        if self._plan_for is not pool:
            self._plan = self._make_row_plan(pool)
            self._plan_for = pool
        return self._plan

    def _make_row_plan(self, pool: DeviceKVPool) -> RowPlan | None:
        if pool.device.type != "cpu" or self.layout != "layer_first":
            return None
        slot_axis = 2 if self.kv_layout == "mha" else 1
        mine, theirs = list(self.kv.shape), list(pool.kv.shape)
        del mine[slot_axis], theirs[slot_axis]
        if mine != theirs:
            return None
        return RowPlan.of(pool.kv, self.kv, self._bits)

    def copy_to_device(self, device_pool: DeviceKVPool, host_slots: torch.Tensor,
                       device_slots: torch.Tensor, layer: int | None = None,
                       non_blocking: bool = False, *,
                       on_layer: Callable[[int], None] | None = None
                       ) -> tuple[torch.Tensor, ...]:
        """Copy ``host_slots`` into ``device_slots`` (no slot twice) of ``device_pool``, one
        layer or all (``layer`` None), enqueued on the current stream.

        The host bytes are read now (into a staging tensor, pinned for ``non_blocking``);
        the device write is ordered on the current stream, so with ``non_blocking`` on
        CUDA the host does not wait. With ``on_layer``, layers are copied one by one and
        ``on_layer(l)`` is called right after layer ``l``'s copy is enqueued (the CUDA
        engine records a per-layer event there). Returns the tensors the enqueued work
        still uses: keep them alive until it is complete.
        """
        pool, device, host, layer = self._check_copy(device_pool, device_slots, host_slots,
                                                     layer, non_blocking, to_host=False)
        if on_layer is not None and not callable(on_layer):
            raise SlotError("on_layer", f"must be callable or None, got "
                                        f"{type(on_layer).__name__}")
        return self.copy_to_device_unchecked(pool, host, device, layer, non_blocking,
                                             on_layer=on_layer)

    def copy_to_device_unchecked(self, pool: DeviceKVPool, host: torch.Tensor,
                                 device: torch.Tensor, layer: int | None = None,
                                 non_blocking: bool = False, *,
                                 on_layer: Callable[[int], None] | None = None
                                 ) -> tuple[torch.Tensor, ...]:
        """``copy_to_device`` without its argument checks (as for
        ``copy_from_device_unchecked``; here no device slot twice)."""
        plan = None if on_layer is not None or layer is not None else self._row_plan(pool)
        if plan is not None:
            plan.copy(plan.host, host, plan.device, device)
            return ()
        index = pool.to_index(device)
        slot_axis = None
        if pool.device.type == "cuda" and non_blocking and self.layout == "layer_first":
            staged, slot_axis = self._stage_slot_major(host, layer)
        else:
            staged = self._gather(host, layer).contiguous()  # so each layer is one DMA
            if pool.device.type == "cuda" and non_blocking:
                staged = staged.pin_memory()
        keep: list[torch.Tensor] = [index, staged]
        mha = int(self.kv_layout == "mha")

        def enqueue(part: torch.Tensor, axis: int | None, into: int | None) -> None:
            """DMA ``part`` (its slot axis ``axis`` where it is in the host buffer's order,
            None where in the values') and scatter it into layer ``into`` (None: all)."""
            values = part.to(pool.device, non_blocking=non_blocking)
            pool.scatter(index, values if axis is None else values.movedim(axis, axis - mha),
                         into)
            keep.append(values)

        if on_layer is None:
            enqueue(staged, slot_axis, layer)
            return tuple(keep)
        layers = [layer] if layer is not None else list(range(self.layers))
        # One layer of an all-layer staging has its slot axis one lower.
        part_axis = None if slot_axis is None else slot_axis - int(layer is None)
        for current in layers:
            enqueue(staged if layer is not None else staged[current], part_axis, current)
            on_layer(current)
        return tuple(keep)

    def _stage_slot_major(self, host: torch.Tensor, layer: int | None
                          ) -> tuple[torch.Tensor, int]:
        """The rows of ``host`` (one layer or all) gathered straight into pinned staging
        in the ``layer_first`` buffer's own axis order, and the slot axis there: one
        ``index_select``, no permuting copy and no second copy to pin it. For a copy to
        CUDA, where the values' order is a view: the permute and the pinning copy had cost
        about ten times the DMA (issue 13, ``bench_transfer`` on an H200)."""
        buffer = self.kv if layer is None else self.kv[layer]
        dim = int(layer is None) + int(self.kv_layout == "mha")  # as in gather_slot_major
        shape = list(buffer.shape)
        shape[dim] = host.numel()
        staged = torch.empty(shape, dtype=self.dtype, pin_memory=True)
        torch.index_select(buffer, dim, host, out=staged)
        return staged, dim


# Up to this many bytes a row copy is one gather and one scatter over every plane at
# once: per-op overhead dominates small copies (issue 13: 3 vs 20 µs for 16 rows of the
# bench's tiny KV), while large ones go plane by plane, where the slot axis leads
# (about 3x faster for 300 rows of 32 layers x 8 heads x 128).
ONE_OP_BYTES = 4 << 20


@dataclass(frozen=True)
class RowPlan:
    """Row-to-row copies between a device and a host buffer, both slot-major on the
    CPU: each viewed as ``[planes, slots, *row]`` (a plane per layer, and K/V), and the
    most slots a copy moves in one op (``ONE_OP_BYTES``)."""

    device: torch.Tensor
    host: torch.Tensor
    one_op_slots: int
    # The C row copy (``_pagebits.copy_rows``) where ``core()`` picks it and every row is
    # contiguous (always, for the pools' own buffers); None: the torch ops below.
    bits: ModuleType | None
    row_bytes: int

    @classmethod
    def of(cls, device_kv: torch.Tensor, host_kv: torch.Tensor,
           bits: ModuleType | None) -> RowPlan:
        planes = device_kv.dim() - (3 if device_kv.dim() == 5 else 2)  # MHA [L, 2, S, H, D];
        device = device_kv.flatten(0, planes - 1) if planes > 1 else device_kv  # MLA [L, S, C]
        host = host_kv.flatten(0, planes - 1) if planes > 1 else host_kv
        plane_bytes = device.shape[0] * math.prod(device.shape[2:]) * device_kv.element_size()
        if not (device[0, 0].is_contiguous() and host[0, 0].is_contiguous()):
            bits = None
        row_bytes = math.prod(device.shape[2:]) * device_kv.element_size()
        return cls(device, host, ONE_OP_BYTES // max(plane_bytes, 1), bits, row_bytes)

    def copy(self, src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
             dst_slots: torch.Tensor) -> None:
        """``dst[:, dst_slots] = src[:, src_slots]`` (``src``/``dst``: this plan's two
        views): one ``index_copy_`` over all planes for a small copy, else plane by plane
        (the slot axis then leads, about 2.5x faster than one index_copy_ on a middle
        axis of the whole tensor, or a staged, permuted copy). In C: a memcpy per row,
        plane by plane (issue 13: a fifth of the torch ops' time for the bench's rows)."""
        if self.bits is not None:
            size = src.element_size()
            assert src_slots.is_cpu and dst_slots.is_cpu and len(src_slots) == len(dst_slots)
            assert src_slots.dtype == dst_slots.dtype == torch.int64
            copied = self.bits.copy_rows(
                src.data_ptr(), src.stride(0) * size, src.stride(1) * size, src.shape[1],
                src_slots.data_ptr(), src_slots.stride(0),
                dst.data_ptr(), dst.stride(0) * size, dst.stride(1) * size, dst.shape[1],
                dst_slots.data_ptr(), dst_slots.stride(0),
                len(src_slots), src.shape[0], self.row_bytes)
            assert copied, "copied a row out of range"
            return
        if len(src_slots) <= self.one_op_slots:
            dst.index_copy_(1, dst_slots, src.index_select(1, src_slots))
            return
        for index in range(src.shape[0]):
            dst[index].index_copy_(0, dst_slots, src[index].index_select(0, src_slots))
