"""Counters that the stateful tests fill and conftest prints at the end of a run."""

from collections import Counter

RUNS: Counter[str] = Counter()  # "examples", "steps", and one entry per rule
