"""Where a row of KV starts in a pool's buffer, in bytes: the index math of the copy kernels.

A copy moves *rows*: the bytes of one unit (a slot, or a whole page of slots) in one
*plane* (a layer, and for MHA also K or V). Every pool buffer the kernels read or write
puts row ``(unit, plane)`` at

    (unit // per_page) * page_stride + (unit % per_page) * unit_stride + plane * plane_stride

with ``row_bytes`` contiguous bytes from there. For the slot-major buffers (the device
pool, and the ``layer_first`` host pool: ``[planes, slots, row]``) a page is one unit
(``per_page`` 1); for the ``page_first`` host pool (``[pages, planes, page_size, row]``) a
slot's page and its place in the page are separate terms. Addressing by whole pages makes a
row ``page_size`` slots long, so each kernel program moves one contiguous page per plane.

Pure arithmetic on the pools' geometry: no torch ops and no Triton, so it is checked on any
machine; the byte-for-byte tests of the kernels exercise it (INV-KV-INTEGRITY).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hiradix.device_pool import DeviceKVPool
from hiradix.errors import SlotError
from hiradix.host_pool import HostKVPool


@dataclass(frozen=True)
class RowAddressing:
    """The rows of one buffer: ``units`` units (slots or pages) by ``planes`` planes, each
    row ``row_bytes`` contiguous bytes at the offset the module docstring gives.

    ``page_stride >= per_page * unit_stride`` (a page's units lie inside its stride), so a
    row's offset grows with its unit and the last row ends the furthest (``extent_bytes``).
    """

    units: int
    planes: int
    row_bytes: int
    per_page: int
    page_stride: int
    unit_stride: int
    plane_stride: int

    def __post_init__(self) -> None:
        counts = {"units": self.units, "planes": self.planes, "row_bytes": self.row_bytes,
                  "per_page": self.per_page}
        for name, count in counts.items():
            if count < 1:
                raise SlotError(name, f"must be >= 1, got {count}")
        if self.units % self.per_page:
            raise SlotError("units", f"{self.units} is not a whole number of pages of "
                                     f"{self.per_page}")
        if min(self.page_stride, self.unit_stride, self.plane_stride) < 0:
            raise SlotError("page_stride", "strides must be >= 0")
        if self.page_stride < self.per_page * self.unit_stride:
            raise SlotError("page_stride", f"{self.page_stride} is shorter than a page's "
                                           f"{self.per_page} units of {self.unit_stride}")

    def offset(self, unit: int, plane: int) -> int:
        """Byte offset of row ``(unit, plane)`` (for reading the math, and the extent)."""
        page, within = divmod(unit, self.per_page)
        return page * self.page_stride + within * self.unit_stride + plane * self.plane_stride

    def extent_bytes(self) -> int:
        """One past the last byte any row of this buffer covers."""
        return self.offset(self.units - 1, self.planes - 1) + self.row_bytes

    def word_bytes(self) -> int:
        """The widest word (8, 4, 2 or 1 bytes) that divides the row and every stride, so a
        kernel may move rows as words of that size."""
        common = math.gcd(self.row_bytes, self.page_stride, self.unit_stride,
                          self.plane_stride)
        return next(w for w in (8, 4, 2, 1) if common % w == 0)

    def in_words(self, word: int) -> RowAddressing:
        """The same addressing counted in words of ``word`` bytes (which must divide it)."""
        assert all(x % word == 0 for x in (self.row_bytes, self.page_stride,
                                           self.unit_stride, self.plane_stride))
        return RowAddressing(self.units, self.planes, self.row_bytes // word, self.per_page,
                             self.page_stride // word, self.unit_stride // word,
                             self.plane_stride // word)


def _token_row_bytes(pool: DeviceKVPool | HostKVPool) -> tuple[int, int]:
    """Bytes of one slot's row in one plane, and planes per layer (2 for MHA: K and V)."""
    mha = pool.kv_layout == "mha" if isinstance(pool, HostKVPool) else pool.layout == "mha"
    row = pool.token_shape[1:] if mha else pool.token_shape
    return math.prod(row) * pool.kv.element_size(), 2 if mha else 1


def device_addressing(pool: DeviceKVPool, *, by_pages: bool) -> RowAddressing:
    """The device buffer (``[layers, 2, slots, heads, head_dim]`` or ``[layers, slots,
    latent]``, slot-major per plane), by slots or by whole pages."""
    return _slot_major(pool, by_pages)


def host_addressing(pool: HostKVPool, *, by_pages: bool) -> RowAddressing:
    """The host buffer in either layout, by slots or by whole pages."""
    if pool.layout == "layer_first":
        return _slot_major(pool, by_pages)
    token, per_layer = _token_row_bytes(pool)
    planes, page = pool.layers * per_layer, pool.page_size
    page_stride = planes * page * token  # [pages, planes, page_size, row]
    if by_pages:
        return RowAddressing(pool.num_slots // page, planes, page * token, 1, page_stride,
                             page_stride, page * token)
    return RowAddressing(pool.num_slots, planes, token, page, page_stride, token, page * token)


def _slot_major(pool: DeviceKVPool | HostKVPool, by_pages: bool) -> RowAddressing:
    token, per_layer = _token_row_bytes(pool)
    planes = pool.layers * per_layer
    unit = pool.page_size if by_pages else 1
    row = unit * token
    return RowAddressing(pool.num_slots // unit, planes, row, 1, row, row,
                         pool.num_slots * token)
