"""The page allocator shared by both KV pools, and the argument checks they share.

A pool's slots are the integers ``0 .. num_slots - 1`` (one slot holds one token's KV);
they are handed out and taken back in whole pages of ``page_size`` consecutive slots, page
``p`` being slots ``[p * page_size, (p + 1) * page_size)``. Bookkeeping is per page, so
``alloc`` and ``free`` cost O(pages), and slot tensors are built with one ``torch.add``.
Internally a page goes by its first slot (its *head*, ``p * page_size``), not by ``p``:
the slots of a run are then its head plus ``0 .. page_size - 1``, and a run's head is
one slice of the slots, with no division (issue 13).

Every check runs before any change: a call that raises ``SlotError`` leaves the allocator
(and the pool using it) exactly as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Final, Literal, NoReturn

import torch

from hiradix.errors import ConfigError, SlotError

try:  # the C loops (setup.py builds them; absent where no compiler was found)
    from hiradix import _pagebits
except ImportError:  # pragma: no cover - only where the extension was not built
    _pagebits = None

__all__ = ["PageAllocator", "SlotError", "SlotMarks", "SlotPool", "core"]

Core = Literal["native", "python"]
CORE_VARIABLE = "HIRADIX_CORE"

UNIT_VIEWS = 1024  # lengths whose slices of ones and zeros an allocator keeps


def is_int(value: object) -> bool:
    """True for a Python ``int`` that is not a ``bool`` (``True`` is no slot count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, argument: str, *, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ``SlotError(argument)``."""
    if not is_int(value):
        raise SlotError(argument, f"must be an int, got {type(value).__name__}")
    assert isinstance(value, int)
    if value < minimum:
        raise SlotError(argument, f"must be >= {minimum}, got {value}")
    return value


def describe(value: object) -> str:
    """A short description of a would-be slot tensor, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__


def check_slot_tensor(slots: object, argument: str, num_slots: int, *,
                      unique: bool = False) -> torch.Tensor:
    """Validate a tensor of slot ids of a pool with ``num_slots`` slots; return it on CPU.

    It must be a 1-D ``torch.int64`` tensor (any device; a CUDA one is copied to CPU to be
    checked), every entry in ``[0, num_slots)``, and with ``unique`` no entry twice (a copy
    destination: two writes to one slot would race).
    """
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        raise SlotError(argument, f"must be a 1-D torch.int64 tensor, got {describe(slots)}")
    if slots.device.type == "meta":  # no values to check, and .cpu() would raise
        raise SlotError(argument, "is on the meta device: slot ids need values")
    cpu = slots.cpu()
    if cpu.numel() == 0:
        return cpu
    low, high = int(cpu.min()), int(cpu.max())
    if low < 0 or high >= num_slots:
        bad = low if low < 0 else high
        raise SlotError(argument, f"slot {bad} is out of range [0, {num_slots})")
    if unique and torch.unique(cpu).numel() != cpu.numel():
        values, counts = torch.unique(cpu, return_counts=True)
        twice = int(values[counts > 1][0])
        raise SlotError(argument, f"holds slot {twice} more than once")
    return cpu


def core() -> Core:
    """The bookkeeping core an allocator built now uses (issue 13): ``native`` (the C loops
    of ``_pagebits.c``) where they were built, else ``python`` (the torch ops below, the
    readable version of the same checks). ``HIRADIX_CORE=python`` picks the torch ops even
    where C is built, so that the conformance suite runs on both; ``HIRADIX_CORE=native``
    insists on C."""
    wanted = os.environ.get(CORE_VARIABLE, "")
    if wanted == "python" or (wanted == "" and _pagebits is None):
        return "python"
    if wanted not in ("", "native"):
        raise ConfigError(CORE_VARIABLE, f"must be 'native' or 'python', got {wanted!r}")
    if _pagebits is None:
        raise ConfigError(CORE_VARIABLE, "is 'native' but hiradix._pagebits is not built "
                                         "(reinstall with a C compiler: pip install -e .)")
    return "native"


def native_core() -> ModuleType | None:
    """The C module if ``core()`` picks it, else None."""
    return _pagebits if core() == "native" else None


class PageAllocator:
    """Free/allocated bookkeeping for ``num_slots`` slots in pages of ``page_size``.

    The free pages form a stack (LIFO): ``alloc`` hands out the most recently freed pages
    first, in the order they were freed, and a fresh allocator hands out pages 0, 1, 2, ...
    Reusing freed pages at once is deliberate: a slot used after its free is then
    overwritten as early as possible, so such bugs show up in tests.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        check_int(page_size, "page_size", minimum=1)
        check_int(num_slots, "num_slots", minimum=1)
        if num_slots % page_size:
            raise SlotError("num_slots", f"must be a multiple of page_size {page_size}, "
                                         f"got {num_slots}")
        self._num_slots = num_slots
        self._page_size = page_size
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        # Indexed by slot: 1 at the head of each allocated page, 0 everywhere else (a free
        # page's head and every slot that is no head). ``release`` subtracts 1 per head it
        # is given and checks for zeros, which finds a page released twice (in one call
        # or across calls), a page never allocated and a run that does not start at a
        # page start (its "head" is no head, so always 0) with three tensor ops
        # (index_add_, index_select, equal; issue 13). One int32 per slot: a pool's KV
        # is far more per slot.
        self._held = torch.zeros(num_slots, dtype=torch.int32)
        self._ones = torch.ones(num_slots // page_size, dtype=torch.int32)
        self._zeros = torch.zeros(num_slots // page_size, dtype=torch.int32)
        # (ones, zeros) of each length up to UNIT_VIEWS, sliced once (a slice costs
        # about as much as the op that uses it).
        self._units: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # For ``repeated``: a position per slot (no state: overwritten by every call) and
        # the positions 0, 1, 2, ... it compares with.
        self._scratch = torch.zeros(num_slots, dtype=torch.int32)
        self._positions = torch.arange(num_slots // page_size, dtype=torch.int32)
        # The free pages' heads as a stack in one int64 tensor: ``_stack[_top:]``, its top at
        # ``_top``, growing downwards so that pages keep their order on the way in and
        # out. ``alloc`` and ``free`` are a slice each, not a Python list turned into a
        # tensor (which cost ~20 ns a page: most of an insert's time, issue 13).
        self._stack = torch.empty(num_slots // page_size, dtype=torch.int64)
        self._top = 0
        # The C loops, where ``core()`` picks them, over these two buffers (never replaced).
        self._bits = native_core()
        self.core: Core = "python" if self._bits is None else "native"
        self._held_at = self._held.data_ptr()
        self._stack_at = self._stack.data_ptr()
        self.reset()

    @property
    def num_slots(self) -> int:
        """Capacity, in slots."""
        return self._num_slots

    @property
    def page_size(self) -> int:
        """Slots per page."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        """Capacity, in pages."""
        return self._num_slots // self._page_size

    @property
    def num_free_slots(self) -> int:
        """Free capacity, in slots (always whole pages)."""
        return (self.num_pages - self._top) * self._page_size

    def reset(self) -> None:
        """Free every page; the next ``alloc`` starts again from page 0."""
        self._held.zero_()
        torch.arange(0, self._num_slots, self._page_size, dtype=torch.int64, out=self._stack)
        self._top = 0

    def slots_from(self, heads: torch.Tensor) -> torch.Tensor:
        """Each of ``heads`` (int64 slots) followed by its next ``page_size - 1`` slots:
        the slots of the pages whose heads they are;
        ``heads`` itself when a page is one slot."""
        if self._page_size == 1:
            return heads
        return torch.add(self._offsets, heads.unsqueeze(1)).view(-1)

    def _push(self, heads: torch.Tensor) -> None:
        """Put the pages of ``heads`` on the free stack, the first one on top: the next
        ``alloc`` hands them out first, in this order."""
        count = heads.numel()
        self._stack[self._top - count:self._top] = heads
        self._top -= count

    def can_alloc(self, num_tokens: int) -> bool:
        """Whether ``alloc(num_tokens)`` would succeed now; its argument checks, and no
        change (a rank's proposal before the allocation it decides, spec/12 12.6)."""
        return self._pages_for(num_tokens) <= self.num_pages - self._top

    def _pages_for(self, num_tokens: int) -> int:
        check_int(num_tokens, "num_tokens", minimum=0)
        if num_tokens % self._page_size:
            raise SlotError("num_tokens", f"must be a multiple of page_size "
                                          f"{self._page_size}, got {num_tokens}")
        return num_tokens // self._page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots as whole pages; None (and no change) if too few
        pages are free. Returns an int64 CPU tensor of slot ids."""
        count = self._pages_for(num_tokens)
        if count > self.num_pages - self._top:
            return None
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        heads = self._stack[self._top:self._top + count]  # a view of the stack
        if self._bits is not None:
            self._bits.mark_held(self._held_at, self._stack_at, self._top, count)
        else:
            self._held.index_fill_(0, heads, 1)
        self._top += count
        # The caller's own tensor: a later free overwrites this part of the stack.
        return heads.clone() if self._page_size == 1 else self.slots_from(heads)

    def _check_free(self, slots: object) -> torch.Tensor:
        """Validate a ``free`` argument; return its pages' heads (int64, CPU)."""
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise SlotError("slots", f"must be a 1-D torch.int64 tensor, got {describe(slots)}")
        if slots.device.type == "meta":
            raise SlotError("slots", "is on the meta device: slot ids need values")
        size = self._page_size
        if slots.numel() % size:
            raise SlotError("slots", f"length {slots.numel()} is not a multiple of page_size "
                                     f"{size}")
        groups = slots.cpu().reshape(-1, size)
        out_of_range = (groups < 0) | (groups >= self._num_slots)
        if bool(out_of_range.any()):
            bad = int(groups[out_of_range][0])
            raise SlotError("slots", f"slot {bad} is out of range [0, {self._num_slots}) "
                                     "(not a slot of this pool)")
        first = groups[:, 0]
        whole = (first % size == 0) & (groups == first[:, None] + self._offsets).all(dim=1)
        if not bool(whole.all()):
            index = int((~whole).nonzero()[0])
            raise SlotError("slots", f"entries [{index * size}, {(index + 1) * size}) "
                                     f"= {groups[index].tolist()} are not one page's slots "
                                     "in order")
        held = self._held[first] != 0
        if not bool(held.all()):
            page = int(first[~held][0]) // size
            raise SlotError("slots", f"page {page} (slots from {page * size}) is not allocated "
                                     "(double free, or never allocated)")
        values, counts = torch.unique(first, return_counts=True)
        if bool((counts > 1).any()):
            page = int(values[counts > 1][0]) // size
            raise SlotError("slots", f"page {page} appears more than once (double free)")
        return first

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages, given as their slots (any page order, each page's slots in
        order); the whole call is checked before any page is freed."""
        heads = self._check_free(slots)
        if heads.numel() == 0:
            return
        self._held.index_fill_(0, heads, 0)
        self._push(heads)

    def release(self, slots: torch.Tensor) -> None:
        """Return whole pages that their owner (the cache's tree) knows are its own: no
        argument checks, the cost of ``free`` on the eviction path. Still asserted, since
        a slip here corrupts the free list silently: every page head is an allocated
        page's, and no page is released twice in one call or across calls (#10, issue
        16). Every assert runs before any change. The cache releases an operation's slots
        in one call (issue 13), so the asserts cost a few tensor ops per operation.

        The slots behind each head are not compared here (issue 13: three ops, a fifth of
        an eviction): the tree's copies are whole pages in order from the moment they
        enter it (``alloc``'s runs, insert's R7 check of caller slots), nodes never write
        their slot tensors and split only at page boundaries, and ``check_invariants``
        audits every copy (INV-TREE-WELL-FORMED) and every slot's owner (INV-DEVICE-/
        HOST-POOL-CONSERVATION)."""
        self.release_parts((slots,))

    def release_parts(self, parts: Sequence[torch.Tensor],
                      unmark: SlotMarks | None = None) -> None:
        """``release`` of the slots of ``parts`` taken together (no page twice across
        them either; all or nothing), without concatenating them first; ``unmark``: flags
        to clear for every slot released (the cache's ownership, SlotMarks), in the same
        call. An eviction's or a host-room release is one such call (issue 13)."""
        if not parts:
            return
        bits = self._bits
        if bits is not None:  # in C: the same checks, in one loop over the heads
            runs: list[int] = []
            int64 = torch.int64
            for slots in parts:
                # The C loop reads raw memory: CPU int64 tensors, or nothing at all. (Per
                # part of an eviction, so the cheapest reads: ``stride()``'s one element
                # costs half of ``stride(0)``'s argument parsing; issue 29.)
                assert slots.dtype is int64 and slots.is_cpu and slots.ndim == 1
                runs += (slots.data_ptr(), slots.numel(), *slots.stride())
            # The C loop clears a flag per released slot: the flags must cover this pool.
            assert unmark is None or unmark.num_slots == self._num_slots
            top = bits.release(self._held_at, self._num_slots, self._stack_at, self._top,
                               0 if unmark is None else unmark.address, self._page_size,
                               tuple(runs))
            if top < 0:  # nothing changed
                self._explain_refused_release(parts, unmark)
            self._top = top
            return
        slots = parts[0] if len(parts) == 1 else torch.cat(list(parts))
        if unmark is not None:  # every slot indexes a flag: all in range before any change
            assert slots.numel() == 0 or (int(slots.min()) >= 0 and
                                          int(slots.max()) < self._num_slots), \
                "released a slot out of range"
        self._release_torch(slots)
        if unmark is not None:
            unmark.set(slots, False)

    def _release_torch(self, slots: torch.Tensor) -> None:
        size = self._page_size
        if size == 1:
            heads = slots  # every slot is a whole page
        else:
            assert slots.numel() % size == 0, "released slots that are not whole pages"
            # A run that starts no page has a head with count 0: the count check's.
            heads = slots[::size]
        count = heads.numel()
        assert count <= self._ones.numel(), "released a page twice in one call"
        # index_add_ stops at an index out of range with the counts before it changed:
        # checked first, so that a failed release changes nothing (the C loop checks too).
        assert count == 0 or (int(heads.min()) >= 0 and int(heads.max()) < self._num_slots), \
            "released a slot out of range"
        held = self._held
        ones, zeros = self._unit(count)
        held.index_add_(0, heads, ones, alpha=-1)
        # Every count back to 0, or one went to -1 (torch.equal: cheaper than any()).
        if not torch.equal(held.index_select(0, heads), zeros):  # undo, explain
            held.index_add_(0, heads, ones)
            assert not bool(heads.remainder(size).any()), \
                "released slots that are not whole pages"
            assert not self.repeated(heads), "released a page twice in one call"
            raise AssertionError("released a page that is not allocated")
        self._push(heads)

    def _explain_refused_release(self, parts: Sequence[torch.Tensor],
                                 unmark: SlotMarks | None) -> NoReturn:
        """Why the C loop refused a ``release_parts`` (it changed nothing): the assert
        that names the reason."""
        size = self._page_size
        assert all(p.numel() % size == 0 for p in parts), \
            "released slots that are not whole pages"
        slots = torch.cat(list(parts))
        checked = slots if unmark is not None else slots[::size]
        assert not bool(((checked < 0) | (checked >= self._num_slots)).any()), \
            "released a slot out of range"
        heads = slots[::size]
        assert not bool(heads.remainder(size).any()), \
            "released slots that are not whole pages"
        assert not self.repeated(heads), "released a page twice in one call"
        raise AssertionError("released a page that is not allocated")

    def repeated(self, slots: torch.Tensor) -> bool:
        """Whether a slot of ``slots`` (int64, each in range; page heads, say) occurs
        twice: each slot records its position in ``slots``; a repeated one kept only one
        of its positions, so reading the positions back differs. Three ops,
        O(len(slots)), no sort. Only called with at most one slot per page's worth."""
        count = slots.numel()
        if count > self._positions.numel():  # more than there are pages: one repeats
            return True
        positions = self._positions[:count]
        self._scratch.index_copy_(0, slots, positions)
        return not torch.equal(self._scratch.index_select(0, slots), positions)

    def allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """A bool per slot of ``slots`` (in range, int64): whether its page is allocated."""
        # index_select, not indexing: on a busy machine a parallel gather waited ms.
        heads = slots if self._page_size == 1 else slots - slots.remainder(self._page_size)
        return self._held.index_select(0, heads) != 0

    def _unit(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` ones and ``count`` zeros (int32, count <= num_pages)."""
        unit = self._units.get(count)
        if unit is None:
            unit = (self._ones[:count], self._zeros[:count])
            if count <= UNIT_VIEWS:
                self._units[count] = unit
        return unit

    def held_once(self, heads: torch.Tensor) -> bool:
        """Whether every slot of ``heads`` (int64, in range) is the head of an allocated
        page and none occurs twice: with 1 taken from each one's count, every count is 0
        (a repeated or free page's, or a slot's that is no head, went below). The counts
        are restored."""
        count = heads.numel()
        if count > self._ones.numel():  # more than there are pages: a page repeats
            return False
        if self._bits is not None:
            assert heads.dtype == torch.int64 and heads.is_cpu and heads.dim() == 1
            return bool(self._bits.held_once(self._held_at, self._num_slots, heads.data_ptr(),
                                             count, heads.stride(0)))
        held = self._held
        ones, zeros = self._unit(count)
        held.index_add_(0, heads, ones, alpha=-1)
        once = torch.equal(held.index_select(0, heads), zeros)
        held.index_add_(0, heads, ones)
        return once

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot``'s page is allocated."""
        check_int(slot, "slot", minimum=0)
        if slot >= self._num_slots:
            raise SlotError("slot", f"slot {slot} is out of range [0, {self._num_slots})")
        return bool(self._held[slot - slot % self._page_size])

    def free_slots(self) -> frozenset[int]:
        """Every free slot id (O(free slots); meant for invariant checks)."""
        return frozenset(self.slots_from(self._stack[self._top:]).tolist())


class SlotMarks:
    """A flag per slot of a pool, set and tested a slot tensor (CPU int64) at a time: the
    cache's record of which device slots a node owns (issue 12). C loops where ``core()``
    picks them, else one torch op per call."""

    def __init__(self, num_slots: int) -> None:
        self.tensor = torch.zeros(num_slots, dtype=torch.bool)
        # Fixed for the flags' life, and read by every eviction's release: attributes,
        # not properties (issue 29: a property is a Python call per read).
        self.num_slots: Final = num_slots
        # Where the flags live (one byte each), for a C loop that clears them as it
        # releases the slots (``PageAllocator.release_parts``).
        self.address: Final = self.tensor.data_ptr()
        self._bits = native_core()

    def set(self, slots: torch.Tensor, value: bool) -> None:
        """Flag (``value`` True) or unflag every slot of ``slots`` (each in range)."""
        if self._bits is None:
            self.tensor.index_fill_(0, slots, value)
            return
        assert slots.dtype == torch.int64 and slots.is_cpu and slots.dim() == 1
        done = self._bits.set_marks(self.address, self.num_slots, slots.data_ptr(),
                                    slots.numel(), slots.stride(0), value)
        assert done, "flagged a slot out of range"

    def any(self, slots: torch.Tensor) -> bool | None:
        """Whether a slot of ``slots`` is flagged; None if one is out of range."""
        if self._bits is None:
            try:  # a CPU index_select checks the range itself
                return bool(self.tensor.index_select(0, slots).any())
            except IndexError:
                return None
        assert slots.dtype == torch.int64 and slots.is_cpu and slots.dim() == 1
        found = self._bits.any_marked(self.address, self.num_slots, slots.data_ptr(),
                                      slots.numel(), slots.stride(0))
        return None if found < 0 else bool(found)


class SlotPool:
    """What both KV pools share: a page allocator and the checks on their slot ids."""

    allocator: PageAllocator
    dtype: torch.dtype
    token_shape: tuple[int, ...]
    layers: int

    def value_shape(self, count: int) -> tuple[int, ...]:
        """The shape of values for ``count`` slots: ``[layers, count, *token_shape]``."""
        return (self.layers, count, *self.token_shape)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    # The owner's slots (``claim``): None, a caller may free any allocated page;
    # ALL_SLOTS, every allocated slot is the owner's; else the flags of the owner's.
    _owned: SlotMarks | Literal["all"] | None = None

    def claim(self, owned: SlotMarks | Literal["all"]) -> None:
        """Hand the pool to an owner (a cache, at each reset): from then on ``free``
        refuses, with ``SlotError`` on ``slots`` and nothing freed, every slot the owner
        holds: those flagged in ``owned`` (the device pool: the tree's slots, issue 34),
        or with ``"all"`` every allocated one (the host pool: only the tree and the
        storage tier hold host slots, spec/09 9.2, and they give them back with
        ``release``)."""
        self._owned = owned

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slots in whole pages, or None if too few are free."""
        return self.allocator.alloc(num_tokens)

    def can_alloc(self, num_tokens: int) -> bool:
        """Whether ``alloc(num_tokens)`` would succeed now (see ``PageAllocator``)."""
        return self.allocator.can_alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        """Free whole pages a caller holds, given as their slots (see
        ``PageAllocator.free``); a slot the pool's owner holds (``claim``) is refused:
        freeing it would let the next ``alloc`` hand out the owner's KV."""
        owned = self._owned
        if owned is not None:
            checked = check_slot_tensor(slots, "slots", self.num_slots)
            if owned == "all":
                if checked.numel():
                    raise SlotError("slots", "every allocated slot of this pool is its "
                                             "cache's (tree or storage tier): a caller holds "
                                             "none to free")
            elif owned.any(checked):
                position = int(owned.tensor[checked].nonzero()[0])
                raise SlotError("slots", f"slot {int(checked[position])} (slots[{position}]) "
                                         "belongs to a cached node; only slots the caller "
                                         "holds may be freed")
        self.allocator.free(slots)

    def release(self, slots: torch.Tensor) -> None:
        """The cache returning pages it owns (see ``PageAllocator.release``)."""
        self.allocator.release(slots)

    def release_parts(self, parts: Sequence[torch.Tensor],
                      unmark: SlotMarks | None = None) -> None:
        """Several runs released as one (see ``PageAllocator.release_parts``)."""
        self.allocator.release_parts(parts, unmark)

    def free_slots(self) -> frozenset[int]:
        """Every free slot id (for invariant checks)."""
        return self.allocator.free_slots()

    @property
    def num_free_slots(self) -> int:
        """Free capacity, in slots."""
        return self.allocator.num_free_slots

    def reset(self) -> None:
        """Free every slot. The KV bytes are left as they are (nobody may read them)."""
        self.allocator.reset()

    def check_slots(self, slots: object, argument: str = "slots", *,
                    unique: bool = False) -> torch.Tensor:
        """Validate slot ids of this pool (1-D int64, in range; ``unique``: none twice);
        return them on CPU."""
        return check_slot_tensor(slots, argument, self.num_slots, unique=unique)

    def check_values(self, values: object, count: int) -> torch.Tensor:
        """Validate values for ``count`` slots: a tensor of this dtype shaped
        ``value_shape(count)`` (any device)."""
        expected = self.value_shape(count)
        if not isinstance(values, torch.Tensor):
            raise SlotError("values", f"must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != self.dtype:
            raise SlotError("values", f"must have dtype {self.dtype}, got {values.dtype}")
        if tuple(values.shape) != expected:
            raise SlotError("values", f"must have shape {list(expected)}, "
                                      f"got {list(values.shape)}")
        return values
