"""What a campaign did, for the summary of ``hiradix check``."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from hiradix_model import Config, trace


class TimeUp(KeyboardInterrupt):
    """A new example began after the campaign's deadline (``Tally.deadline``). Hypothesis
    stops at once on a ``KeyboardInterrupt`` (in generation or in shrinking) without
    recording the example; any other exception it would take for a failure, or (another
    ``BaseException``) for data generation that behaves differently between runs of the
    same choices (FlakyStrategyDefinition)."""


@dataclass
class Tally:
    """What a campaign did: for the summary of ``hiradix check``."""

    examples: int = 0
    steps: int = 0  # operations issued to both the implementation and the model
    checks: int = 0  # rule executions, each followed by the full comparison
    ops: Counter[str] = field(default_factory=Counter)
    exercised: Counter[str] = field(default_factory=Counter)  # steps where an ID had work
    last_trace: list[trace.Step] = field(default_factory=list)  # the latest example's steps
    last_config: Config | None = None  # the latest example's model configuration
    # The latest step the model rejected, if no step came after it in its example: the
    # last line of a failure's trace (a refusal the machine expected is not traced).
    last_rejected: trace.Step | None = None
    # The latest example that ran to its end without failing (``--record``): the latest
    # example may be one the budget cut short after a step or two.
    clean_trace: list[trace.Step] | None = None
    clean_config: Config | None = None
    faults: Counter[str] = field(default_factory=Counter)  # storage faults, by kind
    states: Counter[str] = field(default_factory=Counter)  # steps per coverage.COVERAGE
    swarm: Counter[str] = field(default_factory=Counter)  # examples per swarm draw
    rules: Counter[str] = field(default_factory=Counter)  # executions per machine rule
    # Per request served, in order: (tokens asked, device hit tokens, host hit tokens), for
    # ``hiradix check --report`` (hit rate over time per tier).
    hits: list[tuple[int, int, int]] = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() after which no example or step begins

    def begin_example(self) -> None:
        """Count an example about to run; ``TimeUp`` if the time budget is spent."""
        self.check_time()
        self.examples += 1
        self.last_rejected = None

    def failure_trace(self) -> list[trace.Step]:
        """The latest example's steps, ending with the step the model rejected if that
        was its last (the line ``hiradix replay`` is to stop at)."""
        return [*self.last_trace, *([self.last_rejected] if self.last_rejected else [])]

    def example_passed(self) -> None:
        """The latest example ran to its end and passed: what ``--record`` writes."""
        self.clean_trace, self.clean_config = self.last_trace, self.last_config

    def check_time(self) -> None:
        """``TimeUp`` if the time budget is spent: called between the steps of an example
        too, so that one slow example (a large page size) cannot outlast ``--seconds``."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeUp
