"""A bounded campaign of the Mamba machine over (FULL, MAMBA) configurations.

``hiradix check`` gives one a share of its budget for our cache and the whole budget for
a Mamba engine (``--engine sglang-mamba``). Configurations vary the page size and keep
both pools small (three or five states), so that allocations run short and both
evictions happen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hiradix.conformance.batches import ComponentCampaign, run_campaign_of
from hiradix.conformance.mamba.machine import Build, make_mamba_machine
from hiradix_model.mamba import MambaConfig

# What a campaign should reach; the summary lists the ones it did not.
REACH: tuple[str, ...] = ("forks", "hits_on_a_state", "hits_past_the_state", "inserted_states",
         "refilled_state_tombstones", "state_tombstones", "evict_full", "evict_states",
         "state_short", "alloc_short", "release_state", "finish")
# Where the engine takes requests as its scheduler hands them over (ScheduledMambaEngine).
REACH_SCHEDULED: tuple[str, ...] = ("admitted", "admitted_on_a_copy", "chunks", "decode_steps",
                                    "states_published", "states_already_cached",
                                    "finished_requests", "aborted", "aborted_in_prefill",
                                    "retracted", "aborted_for_room")


def mamba_configs(page_sizes: Sequence[int]) -> list[MambaConfig]:
    """Every configuration a campaign cycles through."""
    return [MambaConfig(page_size=ps, full_slots=10 * ps, state_slots=states)
            for ps in page_sizes for states in (3, 5)]


class MambaCampaign(ComponentCampaign):
    components = "(FULL, MAMBA)"
    reach = REACH
    # With a host tier: the pages held to 13m.8b's invariants, and how often a labelled
    # deviation of the engine's configuration (DEV-M13) was met rather than failed.
    reach_when = (("scheduled_examples", REACH_SCHEDULED),
                  ("alloc_evicting_examples", ("evict_for_alloc_full",
                                               "evict_for_alloc_states")),
                  ("host_checks", ("host_pages_seen", "host_matches", "host_hits",
                                   "load_backs", "load_backs_state_only",
                                   "load_backs_evicting")),
                  ("host_deviation_checks", ("host_deviations_met",)))


def run_campaign(engine: str, build: Build, page_sizes: Sequence[int], *, until: float,
                 examples: int | None = None, steps: int = 30, batch: int = 3,
                 seeded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> MambaCampaign:
    """As the hybrid campaign: batches cycling through ``mamba_configs(page_sizes)``
    until ``until`` or ``examples``; stops at the first failure."""
    return run_campaign_of(
        MambaCampaign(engine), mamba_configs(page_sizes),
        lambda config, reached: make_mamba_machine(build, _mamba(config), reached),
        until=until, examples=examples, steps=steps, batch=batch, seeded=seeded, clock=clock)


def _mamba(config: object) -> MambaConfig:
    assert isinstance(config, MambaConfig)
    return config
