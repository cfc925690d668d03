"""The two pools of a (FULL, MAMBA) cache (spec/13m, 13m.2 and 13m.3 ``alloc`` /
``free`` / ``alloc_state`` / ``write_state`` / ``free_state`` / ``fork``).

- The full pool is a ``DeviceKVPool`` (pages of ``page_size`` slots, one token's KV a
  slot); ``owned`` flags the tree's slots, and ``free`` refuses them.
- The state pool holds one Mamba state a slot: a tensor ``[state_slots, layers,
  state_dim]`` with a page-size-1 allocator (LIFO, as the full pool's) and the set of
  slots the tree owns. A state slot is *held* (the caller's) when allocated and not owned.

``checksum`` is the fingerprint the checker uses for INV-MAMBA-CONTENT: exact integer
arithmetic over the bytes, so a page's checksum does not depend on how many pages were
summed with it.
"""

from __future__ import annotations

import torch

from hiradix._slots import PageAllocator, SlotMarks, check_slot_tensor, is_int
from hiradix.component_args import check_page_runs
from hiradix.config import KVShape
from hiradix.device_pool import DeviceKVPool
from hiradix.errors import SlotError


def checksum(rows: torch.Tensor) -> torch.Tensor:
    """One int64 fingerprint per row of ``rows`` (any dtype): its bytes weighted by their
    position, summed exactly (a changed or moved byte changes it)."""
    data = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).to(torch.int64)
    weights = torch.arange(1, data.shape[1] + 1, dtype=torch.int64, device=data.device)
    return (data * weights).sum(dim=1)


class StatePool:
    """``num_slots`` Mamba states of ``layers`` x ``state_dim`` on ``device`` (zeros when
    built) and which of them the tree owns."""

    def __init__(self, *, num_slots: int, layers: int, state_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.allocator = PageAllocator(num_slots, 1)  # checks num_slots
        self.states = torch.zeros((num_slots, layers, state_dim), dtype=dtype, device=device)
        self.owned: set[int] = set()  # the tree's state slots

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def alloc(self) -> int | None:
        """One free slot, now held; None (and no change) if none is free."""
        got = self.allocator.alloc(1)
        return None if got is None else int(got[0])

    def check_held(self, slot: object, argument: str) -> int:
        """``slot`` as an int if the caller holds it (allocated, not the tree's)."""
        if not is_int(slot):
            raise SlotError(argument, f"must be an int state slot, got {type(slot).__name__}")
        assert isinstance(slot, int)
        if not 0 <= slot < self.num_slots:
            raise SlotError(argument, f"state slot {slot} is out of range [0, {self.num_slots})")
        if slot in self.owned:
            raise SlotError(argument, f"state slot {slot} is a cached page's, not the caller's")
        if not self.allocator.is_allocated(slot):
            raise SlotError(argument, f"state slot {slot} is free, not held by the caller")
        return slot

    def check_values(self, values: object, argument: str) -> torch.Tensor:
        """One state: a tensor of this pool's dtype shaped ``[layers, state_dim]``."""
        shape = tuple(self.states.shape[1:])
        if not isinstance(values, torch.Tensor):
            raise SlotError(argument, f"must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != self.states.dtype or tuple(values.shape) != shape:
            raise SlotError(argument, f"must be a {self.states.dtype} tensor of shape "
                                      f"{list(shape)}, got {values.dtype} {list(values.shape)}")
        return values

    def write(self, slot: int, values: torch.Tensor) -> None:
        """Store one state into a checked held ``slot`` (the forward pass)."""
        self.states[slot].copy_(values)

    def read(self, slot: int) -> torch.Tensor:
        """A copy of one slot's state, ``[layers, state_dim]``."""
        return self.states[slot].clone()

    def fork(self, source: int) -> int | None:
        """A fresh held slot holding a byte copy of ``source``'s state; None if full."""
        slot = self.alloc()
        if slot is not None:
            self.states[slot].copy_(self.states[source])
        return slot

    def free(self, slot: int) -> None:
        """Return a checked held slot."""
        self.allocator.free(torch.tensor([slot], dtype=torch.int64))

    def adopt(self, slot: int) -> None:
        """The tree takes a held slot."""
        self.owned.add(slot)

    def release(self, slots: list[int]) -> None:
        """The tree gives back slots it owns."""
        if slots:
            self.owned.difference_update(slots)
            self.allocator.release(torch.tensor(slots, dtype=torch.int64))

    def free_slots(self) -> frozenset[int]:
        return self.allocator.free_slots()


class MambaPools:
    """The full KV pool (``kv``'s shape) and the state pool of one cache."""

    def __init__(self, *, full_slots: int, state_slots: int, page_size: int, kv: KVShape,
                 state_dim: int, state_dtype: torch.dtype, device: torch.device | str) -> None:
        self.full = DeviceKVPool(num_slots=full_slots, page_size=page_size, layers=kv.layers,
                                 layout=kv.layout, heads=kv.heads, head_dim=kv.head_dim,
                                 latent_dim=kv.latent_dim, dtype=kv.dtype, device=device)
        self.states = StatePool(num_slots=state_slots, layers=kv.layers, state_dim=state_dim,
                                dtype=state_dtype, device=device)
        self.page_size = page_size
        self.owned = SlotMarks(full_slots)  # the tree's full slots
        self.full.claim(self.owned)

    # -- full slots, the caller's side -------------------------------------------------

    def check_held_or_own(self, slots: object, argument: str,
                          own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate full slots: a 1-D int64 tensor, no slot twice, each page either
        slots the caller holds or, within ``own`` (the cached pages' slots along the key,
        position by position), exactly that page's own slots (13m.3 ``insert``). Returns
        a CPU copy and, per page, whether it is the tree's own."""
        checked = check_slot_tensor(slots, argument, self.full.num_slots, unique=True).clone()
        ps = self.page_size
        if checked.numel() % ps:
            raise SlotError(argument, f"length {checked.numel()} is not whole pages of {ps}")
        owned = self.owned.tensor.index_select(0, checked)
        same = torch.zeros_like(owned)
        common = min(own.numel(), checked.numel())
        same[:common] = checked[:common] == own[:common]
        allocated = self.full.allocator.allocated(checked)
        bad = ~allocated | (owned & ~same)
        if bool(bad.any()):
            index = int(bad.nonzero()[0])
            what = "free" if not bool(allocated[index]) else "another cached page's"
            raise SlotError(argument, f"slot {int(checked[index])} ({argument}[{index}]) is "
                                      f"{what}: neither held by the caller nor the cached "
                                      "page's own slot at that position")
        per_page = owned.view(-1, ps) if checked.numel() else owned.view(0, ps)
        mixed = per_page.any(dim=1) & ~per_page.all(dim=1)
        if bool(mixed.any()):
            page = int(mixed.nonzero()[0])
            raise SlotError(argument, f"page {page} mixes a cached page's slots with held ones")
        return checked, per_page.all(dim=1)

    def check_held(self, slots: object, argument: str) -> torch.Tensor:
        """Full slots the caller holds, whole pages in pool order; a CPU copy."""
        checked, _ = self.check_held_or_own(slots, argument, torch.empty(0, dtype=torch.int64))
        check_page_runs(checked, self.page_size, argument)
        return checked

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh full slots (whole pages), or None and no change."""
        return self.full.alloc(num_tokens)

    def free(self, slots: object) -> None:
        """Return held full slots, whole pages (13m.3 ``free``)."""
        self.full.free(self.check_held(slots, "full_slots"))

    def write_kv(self, slots: object, values: object) -> None:
        """Write each held slot's KV (``[layers, n, *token_shape]``)."""
        full = self.check_held(slots, "full_slots")
        self.full.write(full, self.full.check_values(values, full.numel()))

    def page_checksums(self, full: torch.Tensor) -> torch.Tensor:
        """One checksum per page of ``full`` (whole pages) over every layer's KV."""
        values = self.full.read(full)  # [layers, n, *token_shape]
        pages = full.numel() // self.page_size
        by_page = values.movedim(1, 0).reshape(pages, self.page_size, *values.shape[:1],
                                               *values.shape[2:])
        return checksum(by_page)  # on the pool's device: no sync on the insert path

    def state_checksum(self, slot: int) -> torch.Tensor:
        """The checksum of one state slot's bytes."""
        return checksum(self.states.states[slot:slot + 1])[0]

    # -- the tree's side -------------------------------------------------------------------

    def adopt(self, full: torch.Tensor) -> None:
        """The tree takes these held full slots."""
        self.owned.set(full, True)

    def release(self, full_parts: list[torch.Tensor], states: list[int]) -> None:
        """Give back the tree's full slots of ``full_parts`` and its ``states``."""
        if full_parts:
            self.full.release_parts(full_parts, unmark=self.owned)
        self.states.release(states)
