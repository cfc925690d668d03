"""The (FULL, SWA) hybrid cache on the device tier (spec/13): the operations of 13.3.

Every public method checks all of its arguments before it changes anything: bad input
raises an ``InvalidArgument`` subclass naming the argument and leaves the cache as it
was. Node splits are the only structural change a lookup may make; they are invisible
to the spec (a node of k pages is k pages, spec/13 13.8).
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
from hiradix.hybrid.checker import violations
from hiradix.hybrid.evict import evict_full, evict_swa
from hiradix.hybrid.node import SwaNode
from hiradix.hybrid.pools import NO_PAIR, SwaPools
from hiradix.hybrid.tree import SwaTree


class SwaMatch(NamedTuple):
    """What ``match_prefix`` returns: the full slots of the matched pages, root first,
    and the node ending at the deepest matched page (the root: nothing matched)."""

    full_slots: torch.Tensor
    last_node: SwaNode


class SwaCache:
    """A radix tree over pages with a full pool and an SWA pool (spec/13).

    ``window`` is W in tokens; a page's window is the last ``ceil(W / page_size)`` pages
    of its path. ``clock`` returns the tick stamped on the nodes an insert or match
    touches (eviction takes the least recently touched first); it must never decrease.
    """

    def __init__(self, *, page_size: int, full_slots: int, swa_slots: int, window: int,
                 clock: Callable[[], int], kv: KVShape | None = None,
                 device: torch.device | str = "cpu") -> None:
        check_cache_config(page_size, {"full_slots": full_slots, "swa_slots": swa_slots},
                           clock, kv)
        if not is_int(window) or window < 1:
            raise ConfigError("window", f"must be an int >= 1 (tokens), got {window!r}")
        self.page_size = page_size
        self.window = window
        self.window_pages = -(-window // page_size)
        self.clock = clock
        self.pools = SwaPools(full_slots=full_slots, swa_slots=swa_slots, page_size=page_size,
                              kv=KVShape() if kv is None else kv, device=device)
        self.tree = SwaTree(self, page_size, self.window_pages)

    @property
    def root(self) -> SwaNode:
        return self.tree.root

    def _tick(self) -> int:
        return read_tick(self.clock)

    def _check_node(self, node: object) -> SwaNode:
        if not self.tree.owns(node):
            raise ForeignNode("node", f"{node!r} is not a node of this cache (or was evicted)")
        assert isinstance(node, SwaNode)
        return node

    # -- the caller's pairs (13.3 alloc, free_swa, free) -----------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Full slots of ``num_tokens`` fresh pairs (whole pages; the full->SWA mapping
        set), or None and no change if either pool is short. Evicts nothing."""
        return self.pools.alloc(num_tokens)

    def free_swa(self, full_slots: torch.Tensor) -> None:
        """Drop the SWA halves of held pairs, whole pages (13.3 ``free_swa``)."""
        self.pools.free_swa(full_slots)

    def free(self, full_slots: torch.Tensor) -> None:
        """Return held pairs, whole pages, both halves (13.3 ``free``)."""
        self.pools.free(full_slots)

    def write_kv(self, full_slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write each held pair's KV (``[layers, n, *token_shape]``) into both halves."""
        self.pools.write_kv(full_slots, values)

    def read_full(self, slots: torch.Tensor) -> torch.Tensor:
        """The full pool's values of ``slots``, ``[layers, n, *token_shape]``."""
        return self.pools.full.read(slots)

    def read_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """The SWA pool's values of ``slots``, ``[layers, n, *token_shape]``."""
        return self.pools.swa.read(slots)

    # -- insert (13.3) ---------------------------------------------------------------------

    def insert(self, key_tokens: Sequence[int], full_slots: torch.Tensor,
               swa_evicted: int) -> int:
        """Cache ``key_tokens`` from ``full_slots`` (one per token): held pairs, or at a
        cached page that page's own slots (what a match gave the caller); held pairs
        before ``swa_evicted`` have no SWA half. Spec/13 13.3 ``insert``: a new page is
        a tombstone before ``swa_evicted`` and live from it; a cached tombstone page at
        or after it, given held pairs, heals: unlocked, it takes the caller's pairs and
        frees its old full slots; locked (a running request reads its full slots), it
        keeps them and takes only the SWA halves. Any other cached page keeps its slots
        and the caller keeps its pairs there (duplicates). A partial last page is not
        cached. Returns the tokens cached before the call."""
        key = check_tokens(key_tokens, "key_tokens")
        ps = self.page_size
        aligned = len(key) - len(key) % ps
        segments = self.tree.cached_run(key, aligned)
        cached = segments[-1].start + segments[-1].matched if segments else 0
        own_slots = (torch.cat([seg.node.full[:seg.matched] for seg in segments]) if segments
                     else torch.empty(0, dtype=torch.int64))
        full, own = self.pools.check_held_or_cached(full_slots, "full_slots", own_slots)
        if full.numel() != len(key):
            raise SlotError("full_slots", f"has {full.numel()} slots for the {len(key)} "
                                          "tokens of key_tokens")
        check_count(swa_evicted, "swa_evicted")
        if swa_evicted > len(key) or swa_evicted % ps:
            raise InvalidArgument("swa_evicted", f"must be a multiple of {ps} within the key "
                                                 f"({len(key)} tokens), got {swa_evicted}")
        halves = self.pools.halves(full)
        self._check_halves(halves, full, own, swa_evicted)
        # Per cached page: whether it heals (a tombstone at or after swa_evicted, given
        # held pairs); a page with one of its own slots in full_slots is left as it is.
        heals = [False] * (cached // ps)
        for seg in segments:
            if not seg.node.live:
                for index in range(max(seg.start, swa_evicted) // ps,
                                   (seg.start + seg.matched) // ps):
                    heals[index] = not bool(own[index * ps:(index + 1) * ps].any())
        taken_pages = [full[i * ps:(i + 1) * ps] for i, heal in enumerate(heals) if heal]
        check_page_runs(torch.cat([*taken_pages, full[cached:aligned]]), ps, "full_slots")
        tick = self._tick()

        taken: list[torch.Tensor] = []
        released: list[torch.Tensor] = []
        node = self.root
        for seg in segments:
            node = seg.node
            end = seg.start + seg.matched
            pages = heals[seg.start // ps:end // ps]
            last = end == cached
            if seg.matched < len(node.tokens) and (any(pages) or (last and cached < aligned)):
                node = self.tree.split(node, seg.matched)
            start = seg.start
            while start < end:  # maximal runs of pages that heal, or not, top down
                flag = pages[(start - seg.start) // ps]
                stop = start
                while stop < end and pages[(stop - seg.start) // ps] == flag:
                    stop += ps
                part = node if stop == end else self.tree.split(node, stop - start)
                if flag:
                    self._heal(part, full[start:stop], halves[start:stop], taken, released)
                start = stop
        if cached < aligned:
            if cached < swa_evicted:  # new pages before swa_evicted: tombstones
                node = self.tree.add(node, key[cached:swa_evicted], full[cached:swa_evicted],
                                     None, tick)
            if max(cached, swa_evicted) < aligned:
                begin = max(cached, swa_evicted)
                node = self.tree.add(node, key[begin:aligned], full[begin:aligned],
                                     halves[begin:aligned], tick)
            taken.append(full[cached:aligned])
        for visited in node.path():
            visited.last_tick = tick
        if taken:
            self.pools.adopt(torch.cat(taken))
        self.pools.release(released, [])
        return cached

    def _heal(self, node: SwaNode, full: torch.Tensor, halves: torch.Tensor,
              taken: list[torch.Tensor], released: list[torch.Tensor]) -> None:
        """A tombstone takes the caller's pairs ``full`` -> ``halves`` (13.3 healing)."""
        if node.lock_ref > 0:
            # A running request reads the page's full slots: freeing them would serve it
            # the KV of their next owner. Keep them; take only the SWA halves.
            self.pools.rehome(full, node.full)
        else:
            released.append(node.full)
            node.full = full
            taken.append(full)
        node.swa = halves

    @staticmethod
    def _check_halves(halves: torch.Tensor, full: torch.Tensor, own: torch.Tensor,
                      swa_evicted: int) -> None:
        """A held pair before ``swa_evicted`` has no SWA half, one at or after it has one
        (the tree's own slots are no pairs of the caller's)."""
        paired = halves != NO_PAIR
        wrong = paired.clone()
        wrong[swa_evicted:] = ~paired[swa_evicted:]
        wrong &= ~own
        if bool(wrong.any()):
            index = int(wrong.nonzero()[0])
            where = "an SWA half before" if index < swa_evicted else "no SWA half at or after"
            raise SlotError("full_slots", f"pair {int(full[index])} at position {index} has "
                                          f"{where} swa_evicted={swa_evicted}")

    # -- match_prefix (13.3) -------------------------------------------------------------

    def match_prefix(self, key_tokens: Sequence[int]) -> SwaMatch:
        """The longest cached prefix of ``key_tokens`` a request can resume after: it ends
        at the deepest cached page whose window is all live (spec/13 13.3
        ``match_prefix``, INV-SWA-MATCH-LIVE). Stamps the matched path."""
        key = check_tokens(key_tokens, "key_tokens")
        tick = self._tick()
        ps = self.page_size
        aligned = len(key) - len(key) % ps
        # Within a live node the live run grows by one a page and min(WP, depth) by at
        # most one, so a node's last page is the deepest of it with a live window, if any
        # is: only node ends (of the matched part) are candidates.
        best, best_tokens = self.root, 0  # the answer, and its matched tokens
        run = 0  # live pages ending at the current depth
        for seg in self.tree.cached_run(key, aligned):
            run = run + seg.matched // ps if seg.node.live else 0
            depth = (seg.start + seg.matched) // ps
            if seg.node.live and run >= min(self.window_pages, depth):
                best, best_tokens = seg.node, seg.matched
        if best is not self.root and best_tokens < len(best.tokens):
            best = self.tree.split(best, best_tokens)
        path = best.path()
        for visited in path:
            visited.last_tick = tick
        parts = [n.full for n in reversed(path)]
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return SwaMatch(slots, best)

    def node_at(self, key_tokens: Sequence[int]) -> SwaNode | None:
        """The node ending exactly after ``key_tokens`` (whole pages; the root for none),
        splitting a node there if needed; None if those pages are not all cached."""
        key = check_tokens(key_tokens, "key_tokens")
        if len(key) % self.page_size:
            raise InvalidArgument("key_tokens", f"must be whole pages of {self.page_size}, "
                                                f"got {len(key)} tokens")
        segments = self.tree.cached_run(key, len(key))
        if not segments:
            return None if key else self.root
        last = segments[-1]
        if last.start + last.matched < len(key):
            return None
        if last.matched < len(last.node.tokens):
            return self.tree.split(last.node, last.matched)
        return last.node

    # -- locks (13.3) ----------------------------------------------------------------------

    def inc_lock_ref(self, node: SwaNode) -> None:
        """Lock ``node``'s path (full) and its window (SWA), spec/13 13.3 ``inc_lock_ref``.
        The node holding the window's edge is split there, so the SWA lock covers exactly
        the window's pages. Its window must be live (a caller locks what a match gave)."""
        node = self._check_node(node)
        if node is self.root:
            return
        nodes, _ = self.tree.window(node)
        dead = [n for n in nodes if not n.live]
        if dead:
            raise InvalidArgument("node", f"its window has a tombstone ({dead[0]!r}): "
                                          "only a page a match returned can be locked")
        for n in self.tree.window_exact(node):
            n.swa_lock_ref += 1
        node.anchored_locks += 1
        for n in node.path():
            n.lock_ref += 1

    def dec_swa_lock(self, node: SwaNode) -> None:
        """Release only the SWA part of one lock taken at ``node``, once per lock (13.3
        ``dec_swa_lock``)."""
        node = self._check_node(node)
        if node is self.root:
            return
        if node.anchored_locks - node.released_locks <= 0:
            # A second release of one lock would take a window count another lock holds.
            raise NotLocked("node", f"{node!r} holds no lock taken there that still "
                                    "holds its window")
        self._check_swa_locked(node)
        for n in self.tree.window_exact(node):
            n.swa_lock_ref -= 1
        node.released_locks += 1

    def dec_lock_ref(self, node: SwaNode, swa_released: bool) -> None:
        """Release one lock taken at ``node``: its path, and its window unless
        ``swa_released`` -- then it must be a lock whose window ``dec_swa_lock`` released
        (13.3 ``dec_lock_ref``)."""
        node = self._check_node(node)
        if not isinstance(swa_released, bool):
            raise InvalidArgument("swa_released", f"must be a bool, got "
                                                  f"{type(swa_released).__name__}")
        if node is self.root:
            return
        if node.anchored_locks <= 0:  # O(1): the count inc_lock_ref keeps (issue 30)
            # A lock taken below (or none): releasing it here unbalances the path.
            raise NotLocked("node", f"{node!r} holds no lock taken there"
                                    + (" (its locks are held below it)" if node.lock_ref
                                       else ""))
        if swa_released:
            if node.released_locks <= 0:
                # Its window would stay locked for good: no release could reach it.
                raise NotLocked("swa_released", f"no lock taken at {node!r} released "
                                                "its window (dec_swa_lock) first")
            node.released_locks -= 1
        else:
            if node.anchored_locks - node.released_locks <= 0:
                raise NotLocked("swa_released", f"every lock taken at {node!r} released "
                                                "its window already: pass True")
            self._check_swa_locked(node)
            for n in self.tree.window_exact(node):
                n.swa_lock_ref -= 1
        node.anchored_locks -= 1
        for n in node.path():
            n.lock_ref -= 1

    def _check_swa_locked(self, node: SwaNode) -> None:
        nodes, _ = self.tree.window(node)
        unlocked = [n for n in nodes if n.swa_lock_ref <= 0]
        if unlocked:
            raise NotLocked("node", f"its window holds no SWA lock at {unlocked[0]!r}")

    # -- eviction (13.3) -------------------------------------------------------------------

    def evict_full(self, num_tokens: int) -> int:
        """Delete unlocked leaves, least recently used first, until ``num_tokens`` full
        tokens are free or no unlocked leaf is left; the full tokens freed."""
        return evict_full(self.tree, self.pools, check_count(num_tokens, "num_tokens"))

    def evict_swa(self, num_tokens: int) -> int:
        """Take the SWA copies of live pages outside every SWA lock, least recently used
        first, until ``num_tokens`` SWA tokens are free or none is left; the SWA tokens
        freed."""
        return evict_swa(self.tree, self.pools, check_count(num_tokens, "num_tokens"))

    # -- audit -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Check spec/13's invariants (13.5) on the concrete tree and pools; raise
        ``InvariantViolation`` naming the first broken one, with every violation found."""
        found = violations(self.tree, self.pools)
        if found:
            raise InvariantViolation(found[0][0], [f"{i}: {d}" for i, d in found], self.dump())

    def dump(self) -> str:
        """The tree, one node per line, for error messages."""
        lines = [f"full free={self.pools.full.num_free_slots} "
                 f"swa free={self.pools.swa.num_free_slots}"]

        def show(node: SwaNode, depth: int) -> None:
            for child in node.children.values():
                swa = None if child.swa is None else child.swa.tolist()
                lines.append(f"{'  ' * depth}{child!r} full={child.full.tolist()} swa={swa}")
                show(child, depth + 1)

        show(self.root, 0)
        return "\n".join(lines)
