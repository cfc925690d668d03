"""A bounded campaign of the hybrid machine over (FULL, SWA) configurations.

``hiradix check`` gives one a share of its budget for our cache (beside the two-tier
campaign and the rank campaign) and the whole budget for a hybrid engine
(``--engine sglang-swa``). Configurations vary the page size, the window (one token,
just over a page, three pages) and keep both pools small, so that allocations run short
and both evictions happen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hiradix.conformance.batches import ComponentCampaign, run_campaign_of
from hiradix.conformance.hybrid.machine import Build, make_swa_machine
from hiradix_model.hybrid import SwaConfig

# What a campaign should reach; the summary lists the ones it did not.
REACH: tuple[str, ...] = ("healed", "healed_keeping_full", "inserted_tombstones", "tombstoned",
         "evict_full", "evict_swa", "alloc_short", "release_swa", "finish")
# Where the engine takes requests as its scheduler hands them over (ScheduledSwaEngine).
REACH_SCHEDULED: tuple[str, ...] = ("admitted", "chunks", "chunk_tombstones", "decode_steps",
                                    "window_slides", "finished_requests", "aborted",
                                    "aborted_in_prefill", "retracted", "aborted_for_room")


def hybrid_configs(page_sizes: Sequence[int]) -> list[SwaConfig]:
    """Every configuration a campaign cycles through."""
    return [SwaConfig(page_size=ps, full_slots=10 * ps, swa_slots=5 * ps, window=window)
            for ps in page_sizes for window in (1, ps + 1, 3 * ps)]


class HybridCampaign(ComponentCampaign):
    components = "(FULL, SWA)"
    reach = REACH
    # With a host tier: the pages held to 13.8a's invariants, and how often a labelled
    # deviation of the engine's configuration (DEV-H11) was met rather than failed.
    reach_when = (("scheduled_examples", REACH_SCHEDULED),
                  ("alloc_evicting_examples", ("evict_for_alloc",)),
                  ("host_checks", ("host_pages_seen", "host_matches", "host_hits",
                                   "load_backs", "load_backs_swa_only",
                                   "load_backs_evicting")),
                  ("host_deviation_checks", ("host_deviations_met",)))


def run_campaign(engine: str, build: Build, page_sizes: Sequence[int], *, until: float,
                 examples: int | None = None, steps: int = 30, batch: int = 3,
                 seeded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> HybridCampaign:
    """Batches of ``batch`` examples, cycling through the configurations, until ``until``
    (on ``clock``) or, given ``examples``, until that many ran; stops at the first
    failure. Under ``seeded`` each batch has its own
    seed, so that a seeded campaign replays (as far as its time reaches)."""
    return run_campaign_of(
        HybridCampaign(engine), hybrid_configs(page_sizes),
        lambda config, reached: make_swa_machine(build, _swa(config), reached),
        until=until, examples=examples, steps=steps, batch=batch, seeded=seeded, clock=clock)


def _swa(config: object) -> SwaConfig:
    assert isinstance(config, SwaConfig)
    return config
