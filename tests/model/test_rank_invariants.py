"""The rank invariants (spec/12) hold on agreeing ranks and each corruption trips its ID."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hiradix_model import Key, Page
from hiradix_model.ranks import RANK_INVARIANTS, check_ranks, rank_violations, view

import scenario
from rank_mutants import RANK_MUTANTS, healthy


@pytest.mark.parametrize("world", [1, 2, 4])
def test_agreeing_ranks_satisfy_every_rank_invariant(world: int) -> None:
    assert rank_violations(healthy(world)) == {}


@pytest.mark.parametrize("spec_id", sorted(RANK_MUTANTS))
def test_rank_corruption_is_caught_by_its_own_id_only(spec_id: str) -> None:
    corrupted = RANK_MUTANTS[spec_id](healthy(4))
    assert check_ranks(corrupted) == (spec_id,), rank_violations(corrupted)
    assert rank_violations(corrupted)[spec_id], "a failing predicate must say what it found"


def test_every_rank_predicate_has_a_mutant() -> None:
    assert set(RANK_INVARIANTS) == set(RANK_MUTANTS)


def test_the_view_ignores_slot_numbers_but_not_presence() -> None:
    """Ranks' pools differ (a fuller pool hands out other slots): the view must not see
    slots, but must see a page leaving a tier."""
    state = scenario.build()
    shifted = {key: replace(page, device=None if page.device is None
                            else tuple(s + 100 for s in page.device))
               for key, page in state.pages.items()}
    assert view(replace(state, pages=shifted)) == view(state)
    key = next(k for k, p in state.pages.items() if p.host is not None and p.device is not None)
    dropped: dict[Key, Page] = dict(state.pages)
    dropped[key] = replace(state.pages[key], host=None)
    assert view(replace(state, pages=dropped)) != view(state)
