"""One configuration of the conformance suite: policies, page size, layouts, capacities."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.config import CacheConfig
from hiradix.decisions import Recorder
from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.policies import Strategy, WritePolicy
from hiradix.transfer import make_engine
from hiradix_model import Config


@dataclass(frozen=True)
class Scenario:
    page_size: int = 2
    write_policy: WritePolicy = "write_through"
    eviction: Strategy = "lru"
    host_layout: Literal["layer_first", "page_first"] = "layer_first"
    kv_layout: Literal["mha", "mla"] = "mha"
    device_pages: int = 6  # small, so eviction happens often
    host_pages: int = 8
    threshold_pages: int = 1  # load_back_threshold, in pages
    device: str = "cpu"
    engine: Literal["controlled", "cuda"] = "controlled"
    # A storage tier (spec/09) over this backend, driven by the storage machine; None:
    # the two-tier machine.
    storage: Literal["memory", "file"] | None = None

    def slug(self) -> str:
        tier = f"_storage-{self.storage}" if self.storage else ""
        return (f"p{self.page_size}_{self.write_policy}_{self.eviction}_{self.host_layout}_"
                f"{self.kv_layout}_{self.engine}{tier}")

    def model_config(self) -> Config:
        return Config(page_size=self.page_size,
                      device_slots=self.device_pages * self.page_size,
                      host_slots=self.host_pages * self.page_size,
                      write_policy=self.write_policy, eviction=self.eviction,
                      load_back_threshold=self.threshold_pages * self.page_size)

    def build(self, clock: ManualClock, recorder: Recorder | None) -> HiRadixCache:
        device_pool = DeviceKVPool(num_slots=self.device_pages * self.page_size,
                                   page_size=self.page_size, layers=2, layout=self.kv_layout,
                                   heads=2, head_dim=2, latent_dim=3, dtype=torch.float16,
                                   device=self.device)
        host_pool = HostKVPool(device_pool, num_slots=self.host_pages * self.page_size,
                               layout=self.host_layout)
        engine = make_engine(self.engine, device_pool, host_pool)
        config = CacheConfig(page_size=self.page_size, write_policy=self.write_policy,
                             eviction=self.eviction,
                             load_back_threshold=self.threshold_pages * self.page_size)
        return HiRadixCache(config, device_pool, host_pool, engine, clock=clock,
                            recorder=recorder)
