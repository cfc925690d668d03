"""Counters that the stateful tests fill and conftest prints at the end of a run."""

import copy
from collections import Counter
from collections.abc import Callable

import pytest

RUNS: Counter[str] = Counter()  # "examples", "steps", and one entry per rule
STORAGE_RUNS: Counter[str] = Counter()  # the same for test_storage_stateful.py


class Stepping:
    """Mixed into a model state machine: ``apply`` an operation to ``self.state`` and
    count it in ``tally``; check that an operation ``rejects`` bad input unchanged."""

    state: object
    tally: Counter[str]

    def apply(self, name: str, op: Callable[..., tuple[object, object]], *args: object,
              **kwargs: object) -> object:
        self.state, observation = op(self.state, *args, **kwargs)
        self.tally["steps"] += 1
        self.tally[name] += 1
        return observation

    def rejects(self, error: type[Exception], op: Callable[..., object], *args: object,
                **kwargs: object) -> None:
        """The op must raise ``error`` and leave its input state exactly as it was."""
        before = copy.deepcopy(self.state)
        with pytest.raises(error):
            op(self.state, *args, **kwargs)
        assert self.state == before
        self.tally["rejected"] += 1
