"""The two KV pools of a hybrid cache and the full->SWA mapping between them (spec/13,
13.2 and 13.3 ``alloc``, ``free_swa``, ``free``).

A *pair* is a full slot and the SWA slot that ``mapping[full]`` names; ``alloc`` makes
pairs page by page (full page ``i`` with SWA page ``i``, slot for slot), so the SWA
halves of a whole full page are always one whole SWA page in order. The mapping holds an
entry exactly for the full slots of live pages and of held pairs with an SWA half
(spec/13, 13.8): every operation that drops an SWA half clears its entry.

A full slot is *held* (the caller's) when it is allocated and the tree does not own it;
``owned`` flags the tree's full slots, and the full pool refuses to free them (``claim``).
SWA slots are never freed directly by a caller, so the SWA pool refuses every ``free``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hiradix._slots import SlotMarks, check_slot_tensor
from hiradix.component_args import check_page_runs
from hiradix.config import KVShape
from hiradix.device_pool import DeviceKVPool
from hiradix.errors import SlotError

NO_PAIR = -1  # a mapping entry for a full slot without an SWA half


class SwaPools:
    """A full pool and an SWA pool of the same KV shape, and the mapping between them."""

    def __init__(self, *, full_slots: int, swa_slots: int, page_size: int, kv: KVShape,
                 device: torch.device | str) -> None:
        self.full = DeviceKVPool(num_slots=full_slots, page_size=page_size, layers=kv.layers,
                                 layout=kv.layout, heads=kv.heads, head_dim=kv.head_dim,
                                 latent_dim=kv.latent_dim, dtype=kv.dtype, device=device)
        self.swa = DeviceKVPool(num_slots=swa_slots, page_size=page_size, layers=kv.layers,
                                layout=kv.layout, heads=kv.heads, head_dim=kv.head_dim,
                                latent_dim=kv.latent_dim, dtype=kv.dtype, device=device)
        self.page_size = page_size
        # Indexed by full slot: its SWA half, or NO_PAIR. On the CPU: it is bookkeeping,
        # read by the scheduler to build its SWA index, not by a kernel here.
        self.mapping = torch.full((full_slots,), NO_PAIR, dtype=torch.int64)
        self.owned = SlotMarks(full_slots)  # the tree's full slots
        self.full.claim(self.owned)
        self.swa.claim("all")

    # -- the caller's side -------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh pairs (whole pages) as their full slots, or None and no
        change if either pool is short."""
        if not (self.full.can_alloc(num_tokens) and self.swa.can_alloc(num_tokens)):
            return None  # can_alloc checked num_tokens (SlotError) before this
        full = self.full.alloc(num_tokens)
        swa = self.swa.alloc(num_tokens)
        assert full is not None and swa is not None
        self.mapping[full] = swa
        return full

    def check_held(self, slots: object, argument: str) -> torch.Tensor:
        """Validate full slots the caller holds: a 1-D int64 tensor, no slot twice, each
        allocated and not the tree's. Returns a CPU copy of them the caller may not touch."""
        checked, _ = self.check_held_or_cached(slots, argument, torch.empty(0, dtype=torch.int64))
        return checked

    def check_held_or_cached(self, slots: object, argument: str,
                             cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``check_held``, except that ``slots[i]`` may also be ``cached[i]``, the
        tree's own slot at that position (what a match gave the caller). Returns a CPU
        copy of the slots and a bool per slot: whether it is the tree's."""
        checked = check_slot_tensor(slots, argument, self.full.num_slots, unique=True).clone()
        owned = self.owned.tensor.index_select(0, checked)
        if checked.numel() == 0:
            return checked, owned
        allocated = self.full.allocator.allocated(checked)
        bad = ~allocated
        if bool(owned.any()):
            same = torch.zeros_like(owned)
            common = min(cached.numel(), checked.numel())
            same[:common] = checked[:common] == cached[:common]
            bad |= owned & ~same
        if bool(bad.any()):
            index = int(bad.nonzero()[0])
            slot = int(checked[index])
            raise SlotError(argument, f"slot {slot} ({argument}[{index}]) is "
                            + ("free" if not bool(allocated[index]) else "a cached page's")
                            + ": neither a pair the caller holds nor the cached page's own "
                              "slot at that position")
        return checked, owned

    def halves(self, full: torch.Tensor) -> torch.Tensor:
        """The mapping entries of these full slots (NO_PAIR: no SWA half), a new tensor."""
        return self.mapping.index_select(0, full)

    def free_swa(self, slots: object) -> None:
        """Drop the SWA halves of held pairs, whole pages (spec/13, 13.3 ``free_swa``)."""
        full = self.check_held(slots, "full_slots")
        check_page_runs(full, self.page_size, "full_slots")
        halves = self.halves(full)
        if bool((halves == NO_PAIR).any()):
            index = int((halves == NO_PAIR).nonzero()[0])
            raise SlotError("full_slots", f"slot {int(full[index])} (full_slots[{index}]) "
                                          "has no SWA half left to free")
        if halves.numel():
            self.swa.release(halves)
        self.mapping[full] = NO_PAIR

    def free(self, slots: object) -> None:
        """Return held pairs, whole pages, to both pools (spec/13, 13.3 ``free``)."""
        full = self.check_held(slots, "full_slots")
        check_page_runs(full, self.page_size, "full_slots")
        halves = self.halves(full)
        self.full.free(full)  # all checks above: this cannot refuse now
        with_half = halves != NO_PAIR
        # A pair's SWA half is dropped per whole page (free_swa), so the halves left are
        # whole SWA pages.
        if bool(with_half.any()):
            self.swa.release(halves[with_half])
        self.mapping[full] = NO_PAIR

    def write_kv(self, slots: object, values: object) -> None:
        """Write one token's KV per held pair into its full slot and, where the pair has
        one, its SWA half: the forward pass writes full and SWA layers alike (spec/13,
        13.3 ``alloc``). ``values`` is ``[layers, n, *token_shape]``."""
        full = self.check_held(slots, "full_slots")
        checked = self.full.check_values(values, full.numel())
        halves = self.halves(full)
        with_half = halves != NO_PAIR
        self.full.write(full, checked)
        if bool(with_half.any()):
            self.swa.write(halves[with_half], checked[:, with_half])

    # -- the tree's side -----------------------------------------------------------------

    def adopt(self, full: torch.Tensor) -> None:
        """The tree takes these held full slots (their pairs, if any, come along)."""
        self.owned.set(full, True)

    def rehome(self, caller_full: torch.Tensor, page_full: torch.Tensor) -> None:
        """A healed tombstone that keeps its full slots takes the SWA halves of the
        caller's pairs: they now pair with the page's slots; the caller's full slots stay
        held without an SWA half."""
        self.mapping[page_full] = self.mapping.index_select(0, caller_full)
        self.mapping[caller_full] = NO_PAIR

    def release(self, full_parts: Sequence[torch.Tensor],
                swa_parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give back the tree's copies: the full slots of ``full_parts`` (no longer
        owned) and each ``(full, swa)`` SWA copy (its mapping entries cleared), each
        pool in one call."""
        if swa_parts:
            self.swa.release_parts([swa for _, swa in swa_parts])
            for full, _ in swa_parts:
                self.mapping[full] = NO_PAIR
        if full_parts:
            self.full.release_parts(full_parts, unmark=self.owned)
