"""Spec IDs, model predicates and failing tests are in one-to-one correspondence."""

from __future__ import annotations

import re
from pathlib import Path

from hiradix_model import INVARIANTS

from mutants import MUTANTS

SPEC = Path(__file__).resolve().parents[1] / "spec"

HEADING = re.compile(r"^### (INV-[A-Z0-9-]+)$", re.MULTILINE)
MENTION = re.compile(r"INV-[A-Z0-9]+(?:-[A-Z0-9]+)*")


def defined_ids() -> set[str]:
    return set(HEADING.findall((SPEC / "05-invariants.md").read_text()))


def test_spec_defines_at_least_twelve_invariants() -> None:
    assert len(defined_ids()) >= 12


def test_every_spec_id_has_a_predicate_and_every_predicate_is_in_the_spec() -> None:
    assert defined_ids() == set(INVARIANTS)


def test_every_spec_id_has_a_test_that_can_fail_on_it() -> None:
    assert defined_ids() == set(MUTANTS)


def test_spec_mentions_only_defined_ids() -> None:
    defined = defined_ids()
    for page in SPEC.glob("*.md"):
        unknown = set(MENTION.findall(page.read_text())) - defined
        assert not unknown, f"{page.name} mentions undefined IDs {sorted(unknown)}"
