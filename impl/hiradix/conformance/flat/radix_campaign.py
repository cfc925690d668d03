"""A bounded campaign of a device radix tree over flat tiers (SGLang's ``LMCRadixCache``
over LMCache's tiers, spec/15 15.9).

Configurations: per page size, chunks of one or two pages (LMCache's chunk must be whole
pages: its mask is whole chunks), LMCache tiers as small as the flat campaign's (so that
both evict and stores run short) and a device tier of 24 slots (a request is at most 16
tokens: the device evicts too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hiradix.conformance.batches import run_campaign_of
from hiradix.conformance.flat.campaign import FlatCampaign
from hiradix.conformance.flat.engine import RadixConfig, RadixEngine
from hiradix.conformance.flat.radix_machine import make_radix_machine
from hiradix_model.flat import FlatConfig

DEVICE_SLOTS = 24
REACH: tuple[str, ...] = ("device_hits", "loads", "cpu_hits", "stored_chunks", "cpu_victims",
                          "disk_victims", "device_evicted")


class RadixCampaign(FlatCampaign):
    components = "(DEVICE, CPU, DISK)"
    kind = "LMCRadixCache"
    reach = REACH

    def describe(self) -> str:
        return "LMCRadixCache" + super().describe()[len("flat tiers"):]


def radix_configs(page_sizes: Sequence[int]) -> list[RadixConfig]:
    """Every configuration a campaign cycles through."""
    return [RadixConfig(FlatConfig(chunk_tokens=chunk, layers=2, cpu_objects=cpu,
                                   disk_objects=disk),
                        page_size=ps, device_pages=DEVICE_SLOTS // ps)
            for ps in page_sizes if DEVICE_SLOTS % ps == 0
            for chunk in sorted({ps * 2, max(ps, 2)})
            for cpu, disk in ((4, 5), (6, 7))]


def run_campaign(engine: str, build: Callable[[RadixConfig], RadixEngine],
                 page_sizes: Sequence[int], *, until: float, examples: int | None = None,
                 steps: int = 12, batch: int = 3, seeded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> RadixCampaign:
    """Batches cycling through ``radix_configs(page_sizes)`` until ``until`` or
    ``examples``; stops at the first failure."""
    return run_campaign_of(
        RadixCampaign(engine), radix_configs(page_sizes),
        lambda config, reached: make_radix_machine(build, _radix(config), reached),
        until=until, examples=examples, steps=steps, batch=batch, seeded=seeded, clock=clock)


def _radix(config: object) -> RadixConfig:
    assert isinstance(config, RadixConfig)
    return config
