"""Counters that the stateful tests fill and conftest prints at the end of a run."""

from collections import Counter

RUNS: Counter[str] = Counter()  # "examples", "steps", and one entry per rule
STORAGE_RUNS: Counter[str] = Counter()  # the same for test_storage_stateful.py
