"""Every bug planted by tests/impl_mutants.py is found by the exhaustive refinement of its
tiny scope, and the unpatched implementation passes that scope (spec/14 14.4; issue 32),
so the list behind tests/explore_vs_check.py cannot rot. The one the refinement cannot
see by construction stay unseen: if one is ever found, its ``blind`` note is wrong."""

from __future__ import annotations

import pytest
from impl_mutants import MUTANTS, Mutant, explore_refinement

from hiradix.conformance.explore import replay
from hiradix_model.explore import Scope

FOUND = [m for m in MUTANTS if m.blind is None]
BLIND = [m for m in MUTANTS if m.blind is not None]
SCOPES = sorted({m.scope for m in MUTANTS}, key=repr)


def test_at_least_eight_mutants_of_different_kinds_are_found() -> None:
    assert len(FOUND) >= 8
    assert len({m.kind for m in FOUND}) == len(FOUND)
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    for mutant in MUTANTS:  # each says what it breaks, when it shows and what sees it
        assert "Shows " in (mutant.replacement.__doc__ or ""), mutant.name


@pytest.mark.parametrize("scope", SCOPES, ids=repr)
def test_the_unpatched_implementation_passes_every_scope(scope: Scope) -> None:
    search = explore_refinement(scope)
    assert search.mismatch is None and search.complete


@pytest.mark.parametrize("mutant", FOUND, ids=lambda m: m.name)
def test_the_refinement_finds_each_mutant(mutant: Mutant) -> None:
    with mutant.planted():
        search = explore_refinement(mutant.scope)
    assert search.mismatch is not None, f"{mutant.name} went unseen in its scope"
    assert 1 <= len(search.mismatch.path) <= 6
    # The patch is gone afterwards, and the path that failed replays cleanly without it.
    assert mutant.owner.__dict__[mutant.method] is not mutant.replacement
    replay(mutant.scope, search.mismatch.path)


@pytest.mark.parametrize("mutant", BLIND, ids=lambda m: m.name)
def test_what_the_refinement_cannot_see_stays_unseen(mutant: Mutant) -> None:
    with mutant.planted():
        search = explore_refinement(mutant.scope)
    assert search.mismatch is None and search.complete, (
        f"{mutant.name} was found: its note ({mutant.blind}) no longer holds")
