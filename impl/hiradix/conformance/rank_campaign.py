"""The main job's rank campaign (spec/12 12.7): ranks in lockstep, in this process.

``hiradix check`` gives part of its budget to runs of ``ranks.run_local``: each a world
of 2 to 4 ranks, skewed on purpose, with the three rank invariants checked on every rank
after every step (and each cache's own invariants). A run draws its world, skews and
seed from one generator, so ``--seed`` replays the campaign; a failure prints the run's
repr, which replays it.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from hiradix.conformance.ranks import RANK_INVARIANTS, RankReport, RankRun, draw_rank_run


@dataclass
class RankCampaign:
    """What the runs did, summed over ranks; ``failed`` is the first failing run."""

    runs: Counter[int] = field(default_factory=Counter)  # by world size
    steps: int = 0  # steps of one rank, summed over runs
    collectives: int = 0  # collectives issued, summed over ranks
    overruled: int = 0  # proposals a collective's minimum overruled, summed over ranks
    failed: tuple[RankRun, list[RankReport]] | None = None

    def add(self, run: RankRun, reports: list[RankReport]) -> None:
        self.runs[run.world] += 1
        self.steps += reports[0].steps
        self.collectives += sum(r.collectives for r in reports)
        self.overruled += sum(r.disagreements for r in reports)
        if any(r.failure for r in reports):
            self.failed = (run, reports)


def run_rank_campaign(rng: random.Random, *, until: float | None = None,
                      runs: int | None = None) -> RankCampaign:
    """Runs until the monotonic time ``until`` (at least one) or ``runs`` runs; stops at
    the first failing run."""
    campaign = RankCampaign()
    while True:
        run = draw_rank_run(rng)
        campaign.add(run, run.run())
        done = sum(campaign.runs.values())
        if campaign.failed is not None or (runs is not None and done >= runs) \
                or (until is not None and time.monotonic() >= until):
            return campaign


def describe(campaign: RankCampaign) -> str:
    worlds = ", ".join(f"{world} ranks: {n}" for world, n in sorted(campaign.runs.items()))
    return (f"ranks: {sum(campaign.runs.values())} lockstep runs ({worlds}), "
            f"{campaign.steps} steps on every rank, {campaign.collectives} collectives, "
            f"{campaign.overruled} proposals overruled; {', '.join(RANK_INVARIANTS)} "
            "checked on every rank after every step")


def failure_report(campaign: RankCampaign) -> str:
    """The failing run, each rank's failure, and a script that replays it."""
    assert campaign.failed is not None
    run, reports = campaign.failed
    lines = [f"FAILED on rank run {run!r}"]
    lines += [f"  rank {r.rank}: {r.failure}" for r in reports if r.failure]
    lines += ["", "Reproducer:",
              "from hiradix.conformance.ranks import RankRun, Skew",
              f"for report in {run!r}.run():",
              "    print(report.rank, report.failure)"]
    return "\n".join(lines)
