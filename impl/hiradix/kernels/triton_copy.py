"""Triton gather/scatter kernels between the device KV pool and the pinned host KV pool.

One kernel moves rows (see ``addressing``) from any buffer to any other: program
``(i, p)`` copies row ``(src_index[i], first_plane + p)`` of the source to row
``(dst_index[i], first_plane + p)`` of the destination, ``BLOCK`` words at a time. On a GPU
a pinned host buffer is passed as a pointer and read or written over PCIe in place (pinned
memory is mapped into the device's address space), so neither direction needs a CPU
gather, a staging tensor or a CPU scatter (issue 33). Under ``TRITON_INTERPRET=1`` the same
kernel runs on CPU tensors, which is how CI checks its index math.

A copy of whole pages (the cache's case: its allocators hand out pages) is addressed by
page, so each program moves a contiguous page of one plane; any other slot list is
addressed by slot. The bytes land exactly where ``HostKVPool``/``DeviceKVPool`` gathers
and scatters put them (INV-KV-INTEGRITY).

This module imports Triton; ``hiradix.kernels.load_copier`` is how the rest of hiradix
reaches it without depending on Triton.
"""

from __future__ import annotations

import torch

# Triton ships no type information (and .venv, where mypy runs in CI, has no Triton).
import triton  # type: ignore[import-not-found, import-untyped, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, import-untyped, unused-ignore]

from hiradix.device_pool import DeviceKVPool, check_layer
from hiradix.errors import SlotError
from hiradix.host_pool import HostKVPool
from hiradix.kernels import PreparedCopy
from hiradix.kernels.addressing import RowAddressing, device_addressing, host_addressing
from hiradix.pool_pair import check_pool_pair

MAX_BLOCK_WORDS = 1024  # words one loop step of a program moves (8 KiB of int64 words)
INDEX_DTYPES = (torch.int32, torch.int64)
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _row_offset(unit, plane, per_page, page_stride, unit_stride, plane_stride):  # type: ignore[no-untyped-def]
    """``RowAddressing.offset`` in the kernel (int64: a buffer may pass 2**31 words)."""
    return (unit // per_page) * page_stride + (unit % per_page) * unit_stride \
        + plane * plane_stride


@triton.jit  # type: ignore[untyped-decorator, unused-ignore]
def _copy_rows_kernel(src, dst, src_index, dst_index,  # type: ignore[no-untyped-def]
                      src_per_page, src_page_stride, src_unit_stride, src_plane_stride,
                      dst_per_page, dst_page_stride, dst_unit_stride, dst_plane_stride,
                      first_plane, row_words, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    plane = (first_plane + tl.program_id(1)).to(tl.int64)
    src_unit = tl.load(src_index + row).to(tl.int64)
    dst_unit = tl.load(dst_index + row).to(tl.int64)
    src_start = _row_offset(src_unit, plane, src_per_page, src_page_stride, src_unit_stride,
                            src_plane_stride)
    dst_start = _row_offset(dst_unit, plane, dst_per_page, dst_page_stride, dst_unit_stride,
                            dst_plane_stride)
    for first in range(0, row_words, BLOCK):
        words = first + tl.arange(0, BLOCK)
        inside = words < row_words  # the partial tail of a row
        tl.store(dst + dst_start + words, tl.load(src + src_start + words, mask=inside),
                 mask=inside)


def _words(buffer: torch.Tensor, word: int) -> torch.Tensor:
    """A contiguous buffer as a flat tensor of ``word``-byte integers (bytes unchanged)."""
    return buffer.reshape(-1).view(torch.uint8).view(_WORD_DTYPES[word])


def _check_buffer(buffer: object, at: object, argument: str) -> tuple[torch.Tensor,
                                                                      RowAddressing]:
    if not isinstance(buffer, torch.Tensor):
        raise SlotError(argument, f"must be a torch.Tensor, got {type(buffer).__name__}")
    if not isinstance(at, RowAddressing):
        raise SlotError(f"{argument}_at", f"must be a RowAddressing, got {type(at).__name__}")
    if not buffer.is_contiguous():
        raise SlotError(argument, "must be contiguous")
    size = buffer.numel() * buffer.element_size()
    if at.extent_bytes() > size:
        raise SlotError(f"{argument}_at", f"reaches byte {at.extent_bytes()} of a "
                                          f"{size}-byte buffer")
    return buffer, at


def _check_index(index: object, argument: str, units: int, device: torch.device
                 ) -> torch.Tensor:
    if not isinstance(index, torch.Tensor) or index.dtype not in INDEX_DTYPES \
            or index.dim() != 1:
        shown = (f"a {index.dim()}-D {index.dtype} tensor" if isinstance(index, torch.Tensor)
                 else type(index).__name__)
        raise SlotError(argument, f"must be a 1-D torch.int32 or torch.int64 tensor, got "
                                  f"{shown}")
    if index.device != device:
        raise SlotError(argument, f"must be on {device} (where the kernel runs), got "
                                  f"{index.device}")
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= units:
            raise SlotError(argument, f"unit {low if low < 0 else high} is out of range "
                                      f"[0, {units})")
    return index


def kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    """Where a copy between ``src`` and ``dst`` runs: the CUDA device of either (the other
    must then be on it too, or be pinned host memory), else the CPU (the interpreter)."""
    on_cuda = [t.device for t in (src, dst) if t.is_cuda]
    if not on_cuda:
        return torch.device("cpu")
    for name, tensor in (("src", src), ("dst", dst)):
        if tensor.is_cuda and tensor.device != on_cuda[0]:
            raise SlotError(name, f"is on {tensor.device}, the other buffer on {on_cuda[0]}")
        if not tensor.is_cuda and not tensor.is_pinned():
            raise SlotError(name, "is host memory that is not pinned: a GPU cannot read or "
                                  "write it in place")
    return on_cuda[0]


def copy_rows(src: torch.Tensor, src_at: RowAddressing, src_index: torch.Tensor,
              dst: torch.Tensor, dst_at: RowAddressing, dst_index: torch.Tensor,
              planes: range) -> None:
    """``dst`` row ``(dst_index[i], p) = src`` row ``(src_index[i], p)`` for every ``i``
    and every plane ``p`` in ``planes``, enqueued on the current stream (CUDA) or run now
    (interpreter). Validated: contiguous buffers that hold every row of their addressing,
    one row length and plane count on both sides, 1-D int32/int64 indexes of equal length
    on the kernel's device and in range, a step-1 ``planes`` inside the plane count. A
    destination unit given twice is a race (not checked: the engines never pass one).
    Raises ``SlotError`` naming the argument; nothing is written then."""
    src, src_at = _check_buffer(src, src_at, "src")
    dst, dst_at = _check_buffer(dst, dst_at, "dst")
    if (src_at.row_bytes, src_at.planes) != (dst_at.row_bytes, dst_at.planes):
        raise SlotError("dst_at", f"rows of {dst_at.row_bytes} bytes in {dst_at.planes} "
                                  f"planes, the source's of {src_at.row_bytes} in "
                                  f"{src_at.planes}")
    device = kernel_device(src, dst)
    src_index = _check_index(src_index, "src_index", src_at.units, device)
    dst_index = _check_index(dst_index, "dst_index", dst_at.units, device)
    if src_index.numel() != dst_index.numel():
        raise SlotError("dst_index", f"holds {dst_index.numel()} units but src_index holds "
                                     f"{src_index.numel()}")
    if not isinstance(planes, range) or planes.step != 1 or not \
            0 <= planes.start <= planes.stop <= src_at.planes:
        raise SlotError("planes", f"must be a step-1 range inside [0, {src_at.planes}], got "
                                  f"{planes!r}")
    copy_rows_unchecked(src, src_at, src_index, dst, dst_at, dst_index, planes)


def copy_rows_unchecked(src: torch.Tensor, src_at: RowAddressing, src_index: torch.Tensor,
                        dst: torch.Tensor, dst_at: RowAddressing, dst_index: torch.Tensor,
                        planes: range) -> None:
    """``copy_rows`` for callers whose arguments hold by construction (``PageCopier``):
    validated once where they enter, not on every launch (issue 13)."""
    rows = src_index.numel()
    if rows == 0 or len(planes) == 0:
        return  # a grid may not be empty
    word = min(src_at.word_bytes(), dst_at.word_bytes())
    src_words, dst_words = src_at.in_words(word), dst_at.in_words(word)
    block = min(triton.next_power_of_2(src_words.row_bytes), MAX_BLOCK_WORDS)
    _copy_rows_kernel[(rows, len(planes))](
        _words(src, word), _words(dst, word), src_index, dst_index,
        src_words.per_page, src_words.page_stride, src_words.unit_stride,
        src_words.plane_stride,
        dst_words.per_page, dst_words.page_stride, dst_words.unit_stride,
        dst_words.plane_stride,
        planes.start, src_words.row_bytes, BLOCK=block,
        num_warps=max(1, min(8, block // 64)))  # about two words per thread


class PageCopier:
    """Copies between one device pool and one host pool through ``copy_rows`` (issue 33).

    A CUDA device pool needs a pinned host pool (the kernel reads and writes it in place);
    a CPU device pool is for the interpreter (``TRITON_INTERPRET=1``), where the tests run.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        device_pool, host_pool = check_pool_pair(device_pool, host_pool)
        if device_pool.device.type == "cuda" and not host_pool.pinned:
            raise SlotError("host_pool", "must be pinned: the kernels read and write it in "
                                         "place from the GPU")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._device_at = {p: device_addressing(device_pool, by_pages=p) for p in (False, True)}
        self._host_at = {p: host_addressing(host_pool, by_pages=p) for p in (False, True)}
        self._per_layer = self._device_at[False].planes // device_pool.layers
        self._in_page = torch.arange(device_pool.page_size)

    def _pages(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The page ids of ``slots`` if they are whole pages in order within each page,
        else None (then the copy goes slot by slot)."""
        page = self.device_pool.page_size
        if page == 1 or slots.numel() % page:
            return None
        grid = slots.reshape(-1, page)
        heads = grid[:, 0]
        if bool((heads % page).any()) or not torch.equal(grid, heads[:, None] + self._in_page):
            return None
        return heads // page

    def prepare(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> PreparedCopy:
        """The indexes for a copy between checked CPU int64 slot tensors of equal length
        (the engine's ``Copy`` holds them), moved to the device on the current stream."""
        device_pages, host_pages = self._pages(device_slots), self._pages(host_slots)
        by_pages = device_pages is not None and host_pages is not None
        if by_pages:
            assert device_pages is not None and host_pages is not None
            device_slots, host_slots = device_pages, host_pages
        to_index = self.device_pool.to_index
        return PreparedCopy(to_index(device_slots), to_index(host_slots), by_pages)

    def d2h(self, copy: PreparedCopy) -> None:
        """Every layer of the copy's device rows into its host rows (a backup)."""
        at = self._device_at[copy.by_pages]
        copy_rows_unchecked(self.device_pool.kv, at, copy.device_index, self.host_pool.kv,
                            self._host_at[copy.by_pages], copy.host_index, range(at.planes))

    def h2d_layer(self, copy: PreparedCopy, layer: int) -> None:
        """Layer ``layer`` of the copy's host rows into its device rows (a load-back, which
        the engine follows with that layer's event)."""
        check_layer(layer, self.device_pool.layers)
        first = layer * self._per_layer
        copy_rows_unchecked(self.host_pool.kv, self._host_at[copy.by_pages], copy.host_index,
                            self.device_pool.kv, self._device_at[copy.by_pages],
                            copy.device_index, range(first, first + self._per_layer))

    def addressing(self, *, by_pages: bool) -> tuple[RowAddressing, RowAddressing]:
        """The device and the host buffer's addressing (for ``copy_rows`` callers)."""
        return self._device_at[by_pages], self._host_at[by_pages]
