"""A bounded campaign of the flat machine over flat-tier configurations.

Configurations vary the chunk size (``hiradix check``'s page sizes stand for it) and keep
both tiers small -- a CPU tier of two or three chunks; disk tiers of an odd number of
objects, whose evictions split a chunk's layers, and of an even one, which keeps pinned
chunks whole -- so that both evict and stores run short.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hiradix.conformance.batches import ComponentCampaign, run_campaign_of
from hiradix.conformance.flat.machine import Build, make_flat_machine
from hiradix_model.flat import FlatConfig

# What a campaign should reach; the summary lists the ones it did not.
REACH: tuple[str, ...] = ("stored_chunks", "cpu_victims", "disk_victims", "disk_skipped",
                          "partial_disk_chunks", "cpu_hits", "disk_hits", "retrieves",
                          "pinned_lookups", "releases", "clears")


def flat_configs(chunk_sizes: Sequence[int]) -> list[FlatConfig]:
    """Every configuration a campaign cycles through."""
    return [FlatConfig(chunk_tokens=size, layers=2, cpu_objects=cpu, disk_objects=disk)
            for size in chunk_sizes for cpu, disk in ((4, 5), (6, 7), (4, 4))]


class FlatCampaign(ComponentCampaign):
    components = "(CPU, DISK)"
    kind = "flat tiers"
    reach = REACH

    def describe(self) -> str:
        counts = ", ".join(f"{name} {self.reached[name]}" for name in self.reach)
        steered = ", ".join(f"{name[len('steered '):]} {count}"
                            for name, count in sorted(self.reached.items())
                            if name.startswith("steered "))
        missed = self.missed()
        return (f"flat tiers {self.components}, engine {self.engine}: "
                f"{self.reached['examples']} examples, {self.reached['checks']} checked "
                f"steps over {self.configs} configurations; {counts}"
                + (f"; steered around: {steered}" if steered else "")
                + (f"; not reached: {', '.join(missed)}" if missed else ""))


def run_campaign(engine: str, build: Build, page_sizes: Sequence[int], *, until: float,
                 examples: int | None = None, steps: int = 30, batch: int = 3,
                 seeded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> FlatCampaign:
    """Batches cycling through ``flat_configs(page_sizes)`` (page sizes as chunk sizes)
    until ``until`` or ``examples``; stops at the first failure."""
    return run_campaign_of(
        FlatCampaign(engine), flat_configs(page_sizes),
        lambda config, reached: make_flat_machine(build, _flat(config), reached),
        until=until, examples=examples, steps=steps, batch=batch, seeded=seeded, clock=clock)


def _flat(config: object) -> FlatConfig:
    assert isinstance(config, FlatConfig)
    return config
