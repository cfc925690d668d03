"""Many ranks, one tree each: the agreement invariants of spec/12-ranks.md.

A tensor- or pipeline-parallel engine runs one cache per rank. Each rank's pools hold its
own shard of the KV, so slot numbers and free counts are the rank's own business; what
must agree is everything a scheduler can see: which pages are cached on which tier,
their locks, protections, hits and stamps, the copies in flight, the ongoing prefetches
and what they loaded. ``view`` projects a ``State`` onto that part (the rank view).

Ranks agree by collectives: each rank proposes a value and every rank gets the same
result, the MIN of the proposals (however it travels: an all-reduce within a tensor-
parallel group, a relay along the pipeline stages). ``Collective`` records one
call as one rank saw it; ``RankRecord`` is a rank's view after a step together with the
collectives it issued since the start. ``RANK_INVARIANTS`` holds one predicate per
spec ID over the records of every rank, in rank order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hiradix_model.keys import Key
from hiradix_model.state import Direction, State


@dataclass(frozen=True)
class PageView:
    """A page as every rank must see it: presence per tier, not the slots."""

    on_device: bool
    on_host: bool
    lock: int
    host_protect: int
    hits: int
    last_tick: int
    insert_tick: int
    priority: int


@dataclass(frozen=True)
class PrefetchView:
    request: str
    anchor: Key | None
    pages: int  # pages reserved for


@dataclass(frozen=True)
class RankView:
    """The rank-independent part of a rank's state (spec/12, 12.2)."""

    pages: tuple[tuple[Key, PageView], ...]  # sorted by key
    pending: tuple[tuple[Direction, tuple[Key, ...]], ...]  # issue order
    clock: int
    prefetches: tuple[PrefetchView, ...] = ()  # sorted by request
    loaded_tokens: tuple[tuple[str, int], ...] = ()  # sorted by request


def _order(key: Key) -> tuple[str, tuple[int, ...]]:
    return (key.namespace or "", key.tokens)


def view(state: State) -> RankView:
    """The rank view of ``state``: slot numbers, free sets and KV bytes dropped."""
    pages = tuple(sorted(((key, PageView(page.device is not None, page.host is not None,
                                         page.lock, page.host_protect, page.hits,
                                         page.last_tick, page.insert_tick, page.priority))
                          for key, page in state.pages.items()),
                         key=lambda item: _order(item[0])))
    pending = tuple((t.direction, t.pages) for t in state.pending)
    storage = state.storage
    if storage is None:
        return RankView(pages, pending, state.clock)
    prefetches = tuple(sorted((PrefetchView(p.request, p.anchor, len(p.pages))
                               for p in storage.prefetches), key=lambda p: p.request))
    loaded = tuple(sorted(storage.loaded_tokens.items()))
    return RankView(pages, pending, state.clock, prefetches, loaded)


@dataclass(frozen=True)
class Collective:
    """One collective as one rank issued it: its name (the decision it settles), the
    value this rank proposed and the result this rank received."""

    name: str
    proposed: int
    result: int


@dataclass(frozen=True)
class RankRecord:
    view: RankView
    collectives: tuple[Collective, ...]  # every collective since the start, in order


Ranks = tuple[RankRecord, ...]  # rank 0 first
RankPredicate = Callable[[Ranks], Iterator[str]]
RANK_INVARIANTS: dict[str, RankPredicate] = {}


def rank_invariant(spec_id: str) -> Callable[[RankPredicate], RankPredicate]:
    def register(predicate: RankPredicate) -> RankPredicate:
        assert spec_id not in RANK_INVARIANTS, spec_id
        RANK_INVARIANTS[spec_id] = predicate
        return predicate

    return register


@rank_invariant("INV-RANKS-AGREE")
def ranks_agree(ranks: Ranks) -> Iterator[str]:
    if not ranks:
        return
    first = ranks[0].view
    for index, record in enumerate(ranks[1:], start=1):
        if record.view != first:
            yield (f"rank {index}'s view differs from rank 0's: "
                   f"{_first_difference(first, record.view)}")


def _first_difference(a: RankView, b: RankView) -> str:
    for name in ("pages", "pending", "clock", "prefetches", "loaded_tokens"):
        left, right = getattr(a, name), getattr(b, name)
        if left != right:
            if name == "pages":
                mine, theirs = dict(left), dict(right)
                for key in sorted(set(mine) | set(theirs), key=_order):
                    if mine.get(key) != theirs.get(key):
                        return f"page {key}: {mine.get(key)} vs {theirs.get(key)}"
            return f"{name}: {left} vs {right}"
    return "none"


@rank_invariant("INV-RANKS-COLLECTIVES")
def ranks_collectives(ranks: Ranks) -> Iterator[str]:
    if not ranks:
        return
    first = [c.name for c in ranks[0].collectives]
    for index, record in enumerate(ranks[1:], start=1):
        mine = [c.name for c in record.collectives]
        if mine == first:
            continue
        at = next((i for i, (x, y) in enumerate(zip(first, mine, strict=False)) if x != y),
                  min(len(first), len(mine)))
        yield (f"rank {index} issued {len(mine)} collectives, rank 0 {len(first)}; they part "
               f"at #{at}: rank 0 {first[at] if at < len(first) else 'none'}, rank {index} "
               f"{mine[at] if at < len(mine) else 'none'}")


@rank_invariant("INV-RANKS-CONSENSUS")
def ranks_consensus(ranks: Ranks) -> Iterator[str]:
    """Each collective that every rank issued (INV-RANKS-COLLECTIVES covers the rest)
    gave every rank one result: the MIN of the proposals."""
    if not ranks:
        return
    count = min(len(r.collectives) for r in ranks)
    for at in range(count):
        calls = [r.collectives[at] for r in ranks]
        if len({c.name for c in calls}) != 1:
            continue
        agreed = min(c.proposed for c in calls)
        for index, call in enumerate(calls):
            if call.result != agreed:
                yield (f"collective #{at} {call.name!r}: rank {index} got "
                       f"{call.result}, the agreed value is {agreed}")


def check_ranks(ranks: Ranks) -> tuple[str, ...]:
    """The IDs of the rank invariants ``ranks`` violates."""
    return tuple(spec_id for spec_id, predicate in RANK_INVARIANTS.items()
                 if any(predicate(ranks)))


def rank_violations(ranks: Ranks) -> dict[str, list[str]]:
    found = {spec_id: list(predicate(ranks)) for spec_id, predicate in RANK_INVARIANTS.items()}
    return {spec_id: found[spec_id] for spec_id in found if found[spec_id]}
