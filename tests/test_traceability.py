"""Spec IDs, model predicates and failing tests are in one-to-one correspondence."""

from __future__ import annotations

import re
from pathlib import Path

from flat_mutants import FLAT_MUTANTS
from mamba_mutants import MAMBA_MUTANTS
from swa_mutants import SWA_MUTANTS

from hiradix_model import INVARIANTS
from hiradix_model.flat import BYTES_INVARIANT, FLAT_INVARIANTS
from hiradix_model.hybrid import HOST_MATCH_INVARIANT, MATCH_INVARIANT, SWA_INVARIANTS
from hiradix_model.mamba import HOST_MATCH_INVARIANT as MAMBA_HOST_MATCH_INVARIANT
from hiradix_model.mamba import MAMBA_INVARIANTS
from hiradix_model.mamba import MATCH_INVARIANT as MAMBA_MATCH_INVARIANT
from hiradix_model.ranks import RANK_INVARIANTS

from mutants import MUTANTS
from rank_mutants import RANK_MUTANTS

SPEC = Path(__file__).resolve().parents[1] / "spec"

HEADING = re.compile(r"^### (INV-[A-Z0-9-]+)$", re.MULTILINE)
MENTION = re.compile(r"INV-[A-Z0-9]+(?:-[A-Z0-9]+)*")


# The single-rank invariants (predicates over a State), the rank invariants of spec/12
# (predicates over every rank's record) and the hybrid ones of spec/13 and 13m (over an
# SwaState or a MambaState; the match invariants over a state and a match, tested by
# test_hybrid, test_hybrid_host, test_mamba, test_mamba_host and the machines).
# LMCache's flat tiers (spec/15 15.6) likewise, INV-FLAT-BYTES over what a retrieve served.
PAGES = ("05-invariants.md", "12-ranks.md", "13-components.md", "13m-mamba.md",
         "15-lmcache.md")
MATCHES = {MATCH_INVARIANT, HOST_MATCH_INVARIANT, MAMBA_MATCH_INVARIANT,
           MAMBA_HOST_MATCH_INVARIANT, BYTES_INVARIANT}
HYBRID = set(SWA_INVARIANTS) | set(MAMBA_INVARIANTS) | set(FLAT_INVARIANTS) | MATCHES


def defined_ids() -> set[str]:
    return {i for page in PAGES for i in HEADING.findall((SPEC / page).read_text())}


def test_spec_defines_at_least_twelve_invariants() -> None:
    assert len(defined_ids()) >= 12


def test_every_spec_id_has_a_predicate_and_every_predicate_is_in_the_spec() -> None:
    assert defined_ids() == set(INVARIANTS) | set(RANK_INVARIANTS) | HYBRID
    assert not set(INVARIANTS) & set(RANK_INVARIANTS)
    assert not (set(INVARIANTS) | set(RANK_INVARIANTS)) & HYBRID


def test_every_spec_id_has_a_test_that_can_fail_on_it() -> None:
    assert defined_ids() == (set(MUTANTS) | set(RANK_MUTANTS) | set(SWA_MUTANTS)
                             | set(MAMBA_MUTANTS) | set(FLAT_MUTANTS) | MATCHES)


def test_spec_mentions_only_defined_ids() -> None:
    defined = defined_ids()
    for page in SPEC.glob("*.md"):
        unknown = set(MENTION.findall(page.read_text())) - defined
        assert not unknown, f"{page.name} mentions undefined IDs {sorted(unknown)}"
