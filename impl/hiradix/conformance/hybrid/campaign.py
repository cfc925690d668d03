"""A bounded campaign of the hybrid machine over (FULL, SWA) configurations.

``hiradix check`` gives one a share of its budget for our cache (beside the two-tier
campaign and the rank campaign) and the whole budget for a hybrid engine
(``--engine sglang-swa``). Configurations vary the page size, the window (one token,
just over a page, three pages) and keep both pools small, so that allocations run short
and both evictions happen.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, seed, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test

from hiradix.conformance.hybrid.machine import Build, make_swa_machine
from hiradix_model.hybrid import SwaConfig

# What a campaign should reach; the summary lists the ones it did not.
REACH = ("healed", "healed_keeping_full", "inserted_tombstones", "tombstoned",
         "evict_full", "evict_swa", "alloc_short", "release_swa", "finish")


def hybrid_configs(page_sizes: Sequence[int]) -> list[SwaConfig]:
    """Every configuration a campaign cycles through."""
    return [SwaConfig(page_size=ps, full_slots=10 * ps, swa_slots=5 * ps, window=window)
            for ps in page_sizes for window in (1, ps + 1, 3 * ps)]


@dataclass
class HybridCampaign:
    engine: str
    configs: int = 0
    reached: Counter[str] = field(default_factory=Counter)
    failure: str | None = None  # the failing example as Hypothesis printed it, and why

    def describe(self) -> str:
        counts = ", ".join(f"{name} {self.reached[name]}" for name in REACH)
        missed = [name for name in REACH if not self.reached[name]]
        return (f"hybrid (FULL, SWA), engine {self.engine}: {self.reached['examples']} examples, "
                f"{self.reached['checks']} checked steps over {self.configs} configurations; "
                f"{counts}" + (f"; not reached: {', '.join(missed)}" if missed else ""))


def run_campaign(engine: str, build: Build, page_sizes: Sequence[int], *, until: float,
                 examples: int | None = None, steps: int = 30, batch: int = 3,
                 seeded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> HybridCampaign:
    """Batches of ``batch`` examples, cycling through the configurations, until ``until``
    (on ``clock``) or, given ``examples``, until that many ran; stops at the first
    failure. Under ``seeded`` each batch has its own
    seed, so that a seeded campaign replays (as far as its time reaches)."""
    result = HybridCampaign(engine)
    configs = hybrid_configs(page_sizes)
    for index in itertools.count():
        if clock() >= until or (examples is not None and result.reached["examples"] >= examples):
            break
        config = configs[index % len(configs)]
        result.configs = min(len(configs), index + 1)
        machine = make_swa_machine(build, config, result.reached)
        report: list[object] = []
        options = settings(max_examples=batch, stateful_step_count=steps, deadline=None,
                           database=None, suppress_health_check=list(HealthCheck),
                           print_blob=False, derandomize=False)
        test = get_state_machine_test(machine, settings=options)
        if seeded is not None:
            test = seed(seeded * 1_000_003 + index)(test)
        try:
            with with_reporter(report.append):
                test()
        except Exception as failure:  # the reporting boundary: a disagreement, a broken
            # invariant, a choice the model refuses or a crash of the engine is a finding.
            result.failure = "\n".join([f"configuration {config}", *map(str, report),
                                        f"{type(failure).__name__}: {failure}"])
            break
    return result
