"""Bounded campaigns of Hypothesis state machines: batches of examples until a deadline.

The component campaigns (spec/13 and 13m) share this loop: cycle through configurations,
run ``batch`` examples of each configuration's machine, stop at the deadline, at an
example count or at the first failure, and seed every batch under a seeded campaign so
that it replays as far as its time reaches. A failure is shrunk for at most
``SHRINK_SECONDS`` (Hypothesis checks that bound between test cases), so that a failing
campaign overruns its deadline by that much and one test case at most.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from hypothesis import HealthCheck, seed, settings
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

SHRINK_SECONDS = 30


@contextlib.contextmanager
def shrinking_bounded(seconds: int) -> Iterator[None]:
    """Hypothesis's own bound on shrinking (``MAX_SHRINKING_SECONDS``, a module attribute
    it documents as patchable, 300 s by default) set to ``seconds`` meanwhile."""
    if not hasattr(hypothesis_engine, "MAX_SHRINKING_SECONDS"):
        raise RuntimeError("hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS is "
                           "gone: a failing campaign's shrinking would not be bounded")
    before = hypothesis_engine.MAX_SHRINKING_SECONDS
    hypothesis_engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        hypothesis_engine.MAX_SHRINKING_SECONDS = before


@dataclass
class ComponentCampaign:
    """A campaign of one component machine: what it reached and its failure, if any.
    Each kind names its components and what it should reach (the summary lists the
    ones it did not): ``reach`` always, and each entry of ``reach_when`` where the
    machine counted examples under its key (say, ``scheduled_examples``: the engine
    also takes requests as its server's scheduler hands them over)."""

    components: ClassVar[str]
    kind: ClassVar[str] = "hybrid"  # how results and failures name the campaign
    reach: ClassVar[tuple[str, ...]]
    reach_when: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = ()
    engine: str
    configs: int = 0
    reached: Counter[str] = field(default_factory=Counter)
    failure: str | None = None  # the failing example as Hypothesis printed it, and why

    def expected(self) -> tuple[str, ...]:
        """What this campaign should have reached, given the engine it ran."""
        return self.reach + tuple(name for gate, names in self.reach_when
                                  if self.reached[gate] for name in names)

    def missed(self) -> list[str]:
        return [name for name in self.expected() if not self.reached[name]]

    def describe(self) -> str:
        counts = ", ".join(f"{name} {self.reached[name]}" for name in self.expected())
        missed = self.missed()
        return (f"hybrid {self.components}, engine {self.engine}: "
                f"{self.reached['examples']} examples, {self.reached['checks']} checked "
                f"steps over {self.configs} configurations; {counts}"
                + (f"; not reached: {', '.join(missed)}" if missed else ""))


@dataclass
class Batches:
    """What ran: the configurations reached and, at a failure, the failing example as
    Hypothesis printed it and why."""

    configs: int = 0
    failure: str | None = None


def run_batches(configs: Sequence[object],
                machine: Callable[[object], type[RuleBasedStateMachine]],
                reached: Counter[str], *, until: float, examples: int | None = None,
                steps: int = 30, batch: int = 3, seeded: int | None = None,
                clock: Callable[[], float] = time.monotonic,
                shrink_seconds: int = SHRINK_SECONDS) -> Batches:
    """Run ``machine(config)`` for each configuration in turn, ``batch`` examples of
    ``steps`` steps at a time, until ``until`` (on ``clock``) or until ``reached``
    counts ``examples`` examples; stop at the first failure."""
    result = Batches()
    for index in itertools.count():
        if clock() >= until or (examples is not None and reached["examples"] >= examples):
            break
        config = configs[index % len(configs)]
        result.configs = min(len(configs), index + 1)
        report: list[object] = []
        options = settings(max_examples=batch, stateful_step_count=steps, deadline=None,
                           database=None, suppress_health_check=list(HealthCheck),
                           print_blob=False, derandomize=False)
        test = get_state_machine_test(machine(config), settings=options)
        if seeded is not None:
            test = seed(seeded * 1_000_003 + index)(test)
        try:
            with with_reporter(report.append), shrinking_bounded(shrink_seconds):
                test()
        except Exception as failure:  # the reporting boundary: a disagreement, a broken
            # invariant, a choice the model refuses or a crash of the engine is a finding.
            result.failure = "\n".join([f"configuration {config}", *map(str, report),
                                        f"{type(failure).__name__}: {failure}"])
            break
    return result


C = TypeVar("C", bound=ComponentCampaign)


def run_campaign_of(result: C, configs: Sequence[object],
                    machine: Callable[[object, Counter[str]], type[RuleBasedStateMachine]],
                    *, until: float, examples: int | None = None, steps: int = 30,
                    batch: int = 3, seeded: int | None = None,
                    clock: Callable[[], float] = time.monotonic) -> C:
    """``run_batches`` over ``configs`` with ``machine(config, result.reached)``,
    recorded into ``result``."""
    ran = run_batches(configs, lambda config: machine(config, result.reached), result.reached,
                      until=until, examples=examples, steps=steps, batch=batch,
                      seeded=seeded, clock=clock)
    result.configs, result.failure = ran.configs, ran.failure
    return result
