"""One corruption per rank invariant (spec/12): each breaks exactly what its ID forbids,
as a rank that decided alone would. Used by test_ranks.py and the traceability test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hiradix_model.ranks import Collective, PageView, RankRecord, Ranks, view

import scenario

# What the healthy ranks agreed on: rank 1's pool is fuller, so it proposes less, and
# both ranks received the minimum.
PROPOSALS = (("host free", (6, 4)), ("alloc host", (1, 1)), ("ack d2h", (2, 1)))


def healthy(world: int = 2) -> Ranks:
    shared = view(scenario.build_storage())
    records = []
    for rank in range(world):
        calls = tuple(Collective(name, values[min(rank, 1)], min(values[:world]))
                      for name, values in PROPOSALS)
        records.append(RankRecord(shared, calls))
    return tuple(records)


def backup_failed_on_one_rank(ranks: Ranks) -> Ranks:
    """Rank 1 found no host room and kept its page device-only (SGLang's write_backup
    deciding per rank)."""
    record = ranks[1]
    pages = list(record.view.pages)
    at = next(i for i, (_, page) in enumerate(pages) if page.on_host)
    key, page = pages[at]
    pages[at] = (key, PageView(**{**page.__dict__, "on_host": False}))
    return (ranks[0], replace(record, view=replace(record.view, pages=tuple(pages))),
            *ranks[2:])


def skipped_on_empty_queue(ranks: Ranks) -> Ranks:
    """Rank 1 had nothing to acknowledge and skipped the all-reduce."""
    record = ranks[1]
    return (ranks[0], replace(record, collectives=record.collectives[:-1]), *ranks[2:])


def kept_its_own_value(ranks: Ranks) -> Ranks:
    """Rank 0 acknowledged what it had finished instead of the minimum."""
    record = ranks[0]
    last = record.collectives[-1]
    return (replace(record, collectives=(*record.collectives[:-1],
                                         replace(last, result=last.proposed))), *ranks[1:])


RANK_MUTANTS: dict[str, Callable[[Ranks], Ranks]] = {
    "INV-RANKS-AGREE": backup_failed_on_one_rank,
    "INV-RANKS-COLLECTIVES": skipped_on_empty_queue,
    "INV-RANKS-CONSENSUS": kept_its_own_value,
}
