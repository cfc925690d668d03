"""The (FULL, MAMBA) hybrid cache on the device tier (spec/13m): the operations of 13m.3.

Every public method checks all of its arguments before it changes anything: bad input
raises an ``InvalidArgument`` subclass naming the argument and leaves the cache as it
was. Node splits are the only structural change a lookup may make; they are invisible
to the spec (a node of k pages is k pages, its state and state lock on the last, 13m.8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hiradix._slots import is_int
from hiradix.component_args import (
    check_cache_config,
    check_count,
    check_page_runs,
    check_tokens,
    read_tick,
)
from hiradix.config import KVShape
from hiradix.errors import (
    ConfigError,
    ForeignNode,
    InvalidArgument,
    InvariantViolation,
    NotLocked,
    SlotError,
)
from hiradix.mamba.checker import Violation, violations
from hiradix.mamba.evict import evict_full, evict_states
from hiradix.mamba.node import MambaNode
from hiradix.mamba.pools import MambaPools
from hiradix.mamba.tree import MambaTree


class MambaMatch(NamedTuple):
    """What ``match_prefix`` returns (13m.3): the full slots of the pages from the root
    to ``last_node`` (the deepest node of the full hit holding a state; the root: none),
    and the full hit's length in tokens (the longest run of cached pages)."""

    full_slots: torch.Tensor
    last_node: MambaNode
    full_hit: int


class MambaCache:
    """A radix tree over pages with a full KV pool and a Mamba state pool (spec/13m).

    ``clock`` returns the tick stamped on the nodes an insert or a match touches
    (evictions take the least recently touched first); it must never decrease. A state
    is ``kv.layers`` x ``state_dim`` values of ``state_dtype``. With ``checksums`` the
    cache fingerprints every page's KV and every state it takes (one read of them, on the
    pool's device, no sync), so that the checker can see a cached one overwritten
    (INV-MAMBA-CONTENT); without, that check has nothing to compare and is skipped.
    """

    def __init__(self, *, page_size: int, full_slots: int, state_slots: int,
                 clock: Callable[[], int], kv: KVShape | None = None, state_dim: int = 4,
                 state_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", checksums: bool = True) -> None:
        check_cache_config(page_size, {"full_slots": full_slots}, clock, kv)
        for name, value in (("state_slots", state_slots), ("state_dim", state_dim)):
            if not is_int(value) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        if not isinstance(state_dtype, torch.dtype) or not state_dtype.is_floating_point:
            raise ConfigError("state_dtype", f"must be a floating-point torch.dtype, got "
                                             f"{state_dtype!r}")
        if not isinstance(checksums, bool):
            raise ConfigError("checksums", f"must be a bool, got {type(checksums).__name__}")
        self.page_size = page_size
        self.checksums = checksums
        self.clock = clock
        self.pools = MambaPools(full_slots=full_slots, state_slots=state_slots,
                                page_size=page_size, kv=KVShape() if kv is None else kv,
                                state_dim=state_dim, state_dtype=state_dtype, device=device)
        self.tree = MambaTree(self, page_size)

    @property
    def root(self) -> MambaNode:
        return self.tree.root

    def _tick(self) -> int:
        return read_tick(self.clock)

    def _check_node(self, node: object) -> MambaNode:
        if not self.tree.owns(node):
            raise ForeignNode("node", f"{node!r} is not a node of this cache (or was evicted)")
        assert isinstance(node, MambaNode)
        return node

    # -- full slots, the caller's (13m.3 alloc, free) -----------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh full slots (whole pages), or None and no change if the
        pool is short. Evicts nothing."""
        return self.pools.alloc(num_tokens)

    def free(self, full_slots: torch.Tensor) -> None:
        """Return held full slots, whole pages (13m.3 ``free``)."""
        self.pools.free(full_slots)

    def write_kv(self, full_slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write held slots' KV, ``[layers, n, *token_shape]`` (the forward pass)."""
        self.pools.write_kv(full_slots, values)

    def read_full(self, slots: torch.Tensor) -> torch.Tensor:
        """The full pool's values of ``slots``, ``[layers, n, *token_shape]``."""
        return self.pools.full.read(slots)

    # -- state slots, the caller's (13m.3 alloc_state, write_state, free_state, fork) ---

    def alloc_state(self) -> int | None:
        """A fresh state slot, now held, or None and no change if none is free."""
        return self.pools.states.alloc()

    def write_state(self, slot: int, values: torch.Tensor) -> None:
        """Store the state (``[layers, state_dim]``) of a held slot (13m.3 ``write_state``:
        the forward pass moved the request on)."""
        held = self.pools.states.check_held(slot, "slot")
        self.pools.states.write(held, self.pools.states.check_values(values, "values"))

    def read_state(self, slot: int) -> torch.Tensor:
        """A copy of a state slot's values, ``[layers, state_dim]``."""
        if not is_int(slot) or not 0 <= slot < self.pools.states.num_slots:
            raise SlotError("slot", f"must be a state slot in [0, "
                                    f"{self.pools.states.num_slots}), got {slot!r}")
        return self.pools.states.read(slot)

    def free_state(self, slot: int) -> None:
        """Return a held state slot (13m.3 ``free_state``)."""
        self.pools.states.free(self.pools.states.check_held(slot, "slot"))

    def fork(self, node: MambaNode) -> int | None:
        """Copy the state cached at ``node`` into a fresh held slot (13m.3 ``fork``: copy
        on write, the cached one stays); None and no change if the pool is full."""
        checked = self._check_node(node)
        if checked.state is None:
            raise InvalidArgument("node", f"{checked!r} holds no state to fork")
        return self.pools.states.fork(checked.state)

    # -- insert (13m.3) --------------------------------------------------------------------

    def insert(self, key_tokens: Sequence[int], full_slots: torch.Tensor,
               state: int) -> tuple[int, bool]:
        """Cache ``key_tokens`` (whole pages, at least one) from ``full_slots`` (one per
        token: held slots, or at a cached page exactly that page's own slots) with the
        held state slot ``state`` (the state after the whole key). 13m.3 ``insert``:
        every page not cached becomes a page owning its slots; the key's last page takes
        ``state`` unless it holds one (a state tombstone there is refilled; a node that
        ends past it is split, the state on the new upper part). Returns the tokens
        cached before the call (their held slots stay the caller's) and whether the
        state was taken (if not, it stays the caller's). O(pages of the key)."""
        key = check_tokens(key_tokens, "key_tokens")
        ps = self.page_size
        if not key or len(key) % ps:
            raise InvalidArgument("key_tokens", f"must be a positive multiple of {ps} "
                                                f"tokens, got {len(key)}")
        steps = self.tree.walk(key)
        cached = steps[-1].start + steps[-1].matched if steps else 0
        own = (torch.cat([s.node.full[:s.matched] for s in steps]) if steps
               else torch.empty(0, dtype=torch.int64))
        full, own_pages = self.pools.check_held_or_own(full_slots, "full_slots", own)
        if full.numel() != len(key):
            raise SlotError("full_slots", f"has {full.numel()} slots for the {len(key)} "
                                          "tokens of key_tokens")
        held_pages = [full[i * ps:(i + 1) * ps] for i in range(len(key) // ps)
                      if not bool(own_pages[i])]
        if held_pages:
            check_page_runs(torch.cat(held_pages), ps, "full_slots")
        slot = self.pools.states.check_held(state, "state")
        tick = self._tick()

        node = self.root
        if steps:
            last = steps[-1]
            node = last.node if last.whole else self.tree.split(last.node, last.matched)
        if cached < len(key):
            node = self.tree.add(node, key[cached:], full[cached:], tick)
            if self.checksums:
                node.full_digest = self.pools.page_checksums(full[cached:])
            self.pools.adopt(full[cached:])
        taken = node.state is None
        if taken:
            node.state = slot
            if self.checksums:
                node.state_digest = self.pools.state_checksum(slot)
            self.pools.states.adopt(slot)
        for visited in node.path():
            visited.last_tick = tick
        return cached, taken

    # -- match_prefix (13m.3) --------------------------------------------------------------

    def match_prefix(self, key_tokens: Sequence[int]) -> MambaMatch:
        """The longest prefix of ``key_tokens`` a request can resume after: the deepest
        node of the full hit whose last page is in the hit and holds a state (13m.3,
        INV-MAMBA-MATCH-STATE; a state is only ever at a node's last page). Splits
        nothing; stamps the path to the answer. O(pages of the key)."""
        key = check_tokens(key_tokens, "key_tokens")
        tick = self._tick()
        steps = self.tree.walk(key)
        best = self.root
        for step in steps:
            if step.whole and step.node.state is not None:
                best = step.node
        path = best.path()
        for visited in path:
            visited.last_tick = tick
        parts = [n.full for n in reversed(path)]
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        full_hit = steps[-1].start + steps[-1].matched if steps else 0
        return MambaMatch(slots, best, full_hit)

    def node_at(self, key_tokens: Sequence[int]) -> MambaNode | None:
        """The node ending exactly after ``key_tokens`` (whole pages; the root for none),
        splitting a node there if needed; None if those pages are not all cached."""
        key = check_tokens(key_tokens, "key_tokens")
        if len(key) % self.page_size:
            raise InvalidArgument("key_tokens", f"must be whole pages of {self.page_size}, "
                                                f"got {len(key)} tokens")
        steps = self.tree.walk(key)
        if not steps:
            return None if key else self.root
        last = steps[-1]
        if last.start + last.matched < len(key):
            return None
        return last.node if last.whole else self.tree.split(last.node, last.matched)

    # -- locks (13m.3) ---------------------------------------------------------------------

    def _check_lock_call(self, node: object, flag: object, flag_name: str) -> MambaNode:
        """The node and the bool flag of a lock call, checked (before any change)."""
        checked = self._check_node(node)
        if not isinstance(flag, bool):
            raise InvalidArgument(flag_name, f"must be a bool, got {type(flag).__name__}")
        return checked

    def inc_lock_ref(self, node: MambaNode, with_state: bool) -> None:
        """Lock ``node``'s path (``lock`` on every node up to the root) and, if
        ``with_state``, its state (``state_lock`` on ``node``, whether or not it holds a
        state now). The root: a no-op."""
        checked = self._check_lock_call(node, with_state, "with_state")
        if checked is self.root:
            return
        for n in checked.path():
            n.lock_ref += 1
        checked.anchored_locks += 1
        if with_state:
            checked.state_lock_ref += 1

    def dec_state_lock(self, node: MambaNode) -> None:
        """Release only the state part of one lock on ``node`` (13m.3: a request that
        copied its state out needs the cached one no longer)."""
        checked = self._check_node(node)
        if checked is self.root:
            return
        if checked.state_lock_ref <= 0:
            raise NotLocked("node", f"{checked!r} holds no state lock")
        checked.state_lock_ref -= 1

    def dec_lock_ref(self, node: MambaNode, state_released: bool) -> None:
        """Release one lock on ``node``: its path, and its state part unless
        ``state_released`` (13m.3 ``dec_lock_ref``)."""
        checked = self._check_lock_call(node, state_released, "state_released")
        if checked is self.root:
            return
        if checked.anchored_locks <= 0:  # O(1): the count inc_lock_ref keeps (issue 30)
            # A lock taken below (or none): releasing it here unbalances the path.
            raise NotLocked("node", f"{checked!r} holds no lock taken there"
                                    + (" (its locks are held below it)" if checked.lock_ref
                                       else ""))
        # Among the locks taken here, one without its state part: a lock taken below
        # has none at this node, so ``lock_ref`` would count it wrongly (issue 30).
        if state_released and checked.anchored_locks <= checked.state_lock_ref:
            raise InvalidArgument("state_released", f"every lock taken at {checked!r} still "
                                                    "holds its state part")
        if not state_released and checked.state_lock_ref <= 0:
            raise NotLocked("node", f"{checked!r} holds no state lock")
        if not state_released:
            checked.state_lock_ref -= 1
        checked.anchored_locks -= 1
        for n in checked.path():
            n.lock_ref -= 1

    # -- eviction (13m.3) ------------------------------------------------------------------

    def evict_full(self, num_tokens: int) -> int:
        """Delete full leaves (no lock, no state lock, no child) least recently used
        first, whole nodes, until ``num_tokens`` full tokens are free or none is left;
        a deleted node's state goes too. Returns the full tokens freed."""
        return evict_full(self.tree, self.pools, check_count(num_tokens, "num_tokens"))

    def evict_states(self, num_states: int) -> int:
        """Take states without a state lock least recently used first until
        ``num_states`` are free or none is left: a full leaf goes whole, any other node
        keeps its full KV (a state tombstone). Returns the state slots freed."""
        return evict_states(self.tree, self.pools, check_count(num_states, "num_states"))

    # -- audit -----------------------------------------------------------------------------

    def violations(self) -> list[Violation]:
        """Every broken invariant of 13m.5 on the concrete cache, as (spec ID, what)."""
        return violations(self.tree, self.pools, checksums=self.checksums)

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` naming the first broken invariant of 13m.5, with
        every violation found and the tree."""
        found = self.violations()
        if found:
            raise InvariantViolation(found[0][0], [f"{i}: {d}" for i, d in found], self.dump())

    def dump(self) -> str:
        """The tree, one node per line, for error messages."""
        lines = [f"full free={self.pools.full.num_free_slots} "
                 f"state free={len(self.pools.states.free_slots())}"]

        def show(node: MambaNode, depth: int) -> None:
            for child in node.children.values():
                lines.append(f"{'  ' * depth}{child!r} full={child.full.tolist()}")
                show(child, depth + 1)

        show(self.root, 0)
        return "\n".join(lines)
