"""SGLang 0.5.23's (FULL, MAMBA) ``UnifiedRadixCache`` with HiCache, on the device tier.

The cache ``adapters.sglang_mamba`` drives, given SGLang's host tier as
``--enable-hierarchical-cache`` gives it: ``init_hicache`` (``attach_hybrid_pool_to_unified_cache``
-> ``build_hybrid_mamba_stack``) builds a KV host pool, a ``MambaPoolHost`` and a
``HybridCacheController``. The model stays device-tier only (spec/13m, as spec/13 13.8 does
for SWA):

- The view is the device state: a node without a device full value (host-only: backed up
  and evicted) is no page, and nor is anything below it (``sanity_check``: no device value
  under an evicted parent). A page's state is its device Mamba value; a state backed up
  and evicted from the device is a state tombstone. A device eviction that leaves a node
  host-only is, seen from the device, a deletion; an insert over a host-only node
  (``_unevict_node_on_insert`` re-adopts the caller's slots and state) a creation.
- ``insert``'s prefix: SGLang's ``prefix_len`` counts the host-only tokens it re-adopted
  (DEV-H4 of spec/13 13.7); the device part is what was cached on the device before the
  call, the shorter of the two.
- ``match_prefix``: SGLang's match accepts a node whose state is on the host only (a hit a
  load back would restore, ``MambaComponent.create_match_validator``); the hit reported
  is the deepest node at or above SGLang's ``best_match_node`` whose state is on the
  device, with the full slots up to it, and ``load_back`` then acts on the host hit as the
  scheduler does (``init_load_back``).
- Copies complete asynchronously: at the start of every call and before every view the
  adapter polls the controller as the scheduler does once per step
  (``check_hicache_events``) until nothing is in flight.
- CPU patches (none in SGLang's code): ``MambaPoolHost`` unpinned (pinning needs CUDA) in
  the ``page_first_direct`` layout (the only ones it takes), and its two direct copies as
  plain indexing (``_state_to_host`` / ``_state_to_device``; the host buffers are
  ``[slot, layer, 1, *shape]``).
- ``own_check``: ``sglang_mamba``'s (SGLang's ``sanity_check``, which with HiCache also
  covers host leaves and host LRUs, and the device pool balances), then per host pool (KV,
  MAMBA) that the slots the nodes' host values name and the pool's free list (``free_slots``
  and the staged ``release_slots``) partition the pool: none held twice, none both free
  and held, none neither.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Literal

import torch

from hiradix.conformance.mamba.engine import (
    MambaHit,
    MambaHostPageView,
    MambaHostView,
    MambaPageView,
    MambaView,
)
from hiradix.engines.protocol import EngineUnavailable, probe_engine
from hiradix.engines.sglang.mamba import NAME as DEVICE_NAME
from hiradix.engines.sglang.mamba import SglangMambaAdapter
from hiradix.engines.sglang.mamba import probe as probe_device
from hiradix.engines.sglang.swa import SETUP, VERSIONS, host_free_slots
from hiradix.engines.sglang.unified import load_back_as_scheduled
from hiradix_model import Key
from hiradix_model.mamba import MambaConfig

NAME = f"{DEVICE_NAME}-hicache"
MambaPolicy = Literal["write_through", "write_back"]
MAMBA_POLICIES: tuple[MambaPolicy, ...] = ("write_through", "write_back")
HICACHE_RATIO = 1.0  # host pools of the device pools' size: host eviction in short runs
LAYOUT = "page_first_direct"  # the layout MambaPoolHost takes and the copies below cover
SETTLE_POLLS = 4  # as sglang_swa: on CPU a copy is acked by the first poll after it
_HOST_MODULE = "sglang.srt.mem_cache.pool_host.mamba"
_POOL_NAMES = "sglang.srt.mem_cache.hicache_storage"
_patched = False


def _state_to_host(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                   src_indices: torch.Tensor, dst_indices: torch.Tensor,
                   page_size: int) -> None:
    """``transfer_kv_all_layer_direct_lf_pf`` for a Mamba state on CPU: every device layer
    (``[slot, *shape]``) of each destination in turn into host ``[slot, layer, 1, *shape]``."""
    layers = len(src_ptrs) // len(dst_ptrs)
    source, target = src_indices.to(torch.int64), dst_indices.to(torch.int64)
    for i, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[target, layer, 0] = src_ptrs[i * layers + layer].index_select(0, source)


def _state_to_device(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                     src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                     page_size: int) -> None:
    """``transfer_kv_per_layer_direct_pf_lf`` for a Mamba state on CPU: one layer of a
    load, host ``[slot, layer, 1, *shape]`` into the device layer ``[slot, *shape]``."""
    source = src_indices.to(torch.int64)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst.index_copy_(0, dst_indices.to(torch.int64), src[source, layer_id, 0])


def _patch_host_pool() -> None:
    """The CPU patches of the module docstring, once per process."""
    global _patched
    if _patched:
        return
    module: Any = importlib.import_module(_HOST_MODULE)  # its copies are set below
    defaults = module.MambaPoolHost.__init__.__kwdefaults__
    if defaults is None or "pin_memory" not in defaults:
        raise AttributeError("MambaPoolHost.__init__ has no keyword pin_memory")
    defaults["pin_memory"] = False  # pinning needs CUDA
    module.transfer_kv_all_layer_direct_lf_pf = _state_to_host
    module.transfer_kv_per_layer_direct_pf_lf = _state_to_device
    _patched = True


def probe(engine: str = NAME) -> str:
    """As ``sglang_mamba.probe``, and the HiCache entry points and Mamba host pool this
    adapter drives."""
    version = probe_device(engine)

    def load() -> None:
        module = importlib.import_module(_HOST_MODULE)
        for name in ("backup_from_device_all_layer", "load_to_device_per_layer"):
            if not callable(getattr(module.MambaPoolHost, name, None)):
                raise AttributeError(f"MambaPoolHost has no {name}")
        importlib.import_module(_POOL_NAMES).PoolName("mamba")
        _patch_host_pool()
    probe_engine(engine, "sglang", VERSIONS, "UnifiedRadixCache with HiCache and a Mamba "
                 "component", SETUP, load)
    return version


class SglangMambaHiCacheAdapter(SglangMambaAdapter):
    """``SglangMambaAdapter`` with SGLang's host tier under ``policy`` (module docstring)."""

    def __init__(self, config: MambaConfig, policy: MambaPolicy) -> None:
        if policy not in MAMBA_POLICIES:
            raise ValueError(f"{NAME}: policy must be one of {MAMBA_POLICIES}, got {policy!r}")
        self.policy = policy
        self.name = f"{NAME}-{policy}"
        # Where the last match ended on both tiers, in a 1-tuple (None: no match yet; a
        # match that ended at the root is (None,)).
        self._host_match: tuple[Key | None] | None = None
        self._match: Any = None  # the last match's MatchResult, for ``load_back``
        probe(self.name)
        self._hicache_on = False
        self.args: Any = None  # the published ServerArgs (``_publish_args``)
        super().__init__(config)
        self.cache.init_hicache(self.args, self.params)
        controller = self.cache.cache_controller
        if controller is None or controller.write_policy != policy:
            raise EngineUnavailable(f"{self.name}: asked for {policy}, the controller runs "
                                    f"{None if controller is None else controller.write_policy}")
        pools = importlib.import_module(_POOL_NAMES).PoolName
        group = self.cache.host_pool_group
        kv_host, mamba_host = group.get_pool(pools.KV), group.get_pool(pools.MAMBA)
        # (pool, its slot count): a KV host pool counts logical slots; MambaPoolHost
        # one slot per state (no logical / physical split).
        self.host_pools = {self.full_ct: (kv_host, int(kv_host.logical_size)),
                           self.mamba_ct: (mamba_host, int(mamba_host.size))}
        self._hicache_on = True

    def _publish_args(self) -> None:
        """What the server publishes before building its caches: HiCache on under the
        policy, host pools sized off the device pools, direct copies (patched), the
        Mamba host layout; the Mamba chunk as ``sglang_mamba`` seeds it."""
        args = self.m["args"].ServerArgs(
            model_path="dummy", device="cpu", page_size=self.ps, enable_hierarchical_cache=True,
            hicache_ratio=HICACHE_RATIO, hicache_size=0, hicache_mem_layout=LAYOUT,
            hicache_write_policy=self.policy, hicache_io_backend="direct",
            hicache_storage_backend=None, radix_eviction_policy="lru")
        args._mamba_cache_chunk_size = self.ps
        self.m["context"].publish(args, role="test")
        self.args = args

    # -- copies in flight ---------------------------------------------------------------

    def _settle(self) -> None:
        """Poll the controller as the scheduler does after each step until no copy is in
        flight: a write-through holds a lock on its node until its ack, which the
        device-tier model does not have."""
        if not self._hicache_on:
            return
        for _ in range(SETTLE_POLLS):
            self.cache.check_hicache_events()
            if not self.cache.ongoing_write_through and not self.cache.ongoing_load_back:
                return
        raise AssertionError(f"{self.name}: copies still in flight after {SETTLE_POLLS} "
                             f"polls: write {sorted(self.cache.ongoing_write_through)}, "
                             f"load {sorted(self.cache.ongoing_load_back)}")

    def _tick(self) -> None:
        self._settle()
        super()._tick()

    # -- the calls whose meaning the host tier changes ----------------------------------

    def _hit(self, key: Key, got: Any) -> MambaHit:
        """The device part of SGLang's hit (module docstring)."""
        node = self.tree.node_by_id(got.best_match_node)
        self._host_match = (self._page_of(node.id),)  # where it ends on either tier
        self._match = got
        # Up from SGLang's hit to the deepest state on the device (module docstring).
        while node is not self.tree.root_node and \
                node.component_data[self.mamba_ct].value is None:
            node = node.parent
        slots = self.tree.collect_full_device_indices(node.id, self.tree.root_node.id)
        full_hit = len(self._cached_full(key, self._pages()))
        return MambaHit(full=self._full_out(slots.tolist()), page=self._page_of(node.id),
                        full_hit=full_hit)

    def last_host_match(self) -> Key | None:
        """Of the last ``match_prefix`` (HostMatchingMambaEngine): SGLang's
        ``best_match_node`` as a page (None: the root)."""
        if self._host_match is None:
            raise ValueError(f"{self.name}: no match with host hits to report")
        return self._host_match[0]

    def load_back(self) -> tuple[int, Key | None, int | None]:
        """Act on the last ``match_prefix``'s host hit as the server's scheduler does
        (HostLoadingMambaEngine, ``sglang_unified.load_back_as_scheduled``), the loads
        acknowledged before it returns. A node whose
        state is on the host only gives the request a state slot of its own
        (``prepare_load_back``, components/mamba.py:794-819), which the caller holds
        after it (DEV-M14)."""
        if self._match is None:
            raise ValueError(f"{self.name}: no match with host hits to load back")
        self._tick()
        got, self._match = self._match, None  # a match is loaded back once
        req = SimpleNamespace(
            rid=self.name, session=None, kv=self.req_kv(), last_node=got.last_device_node,
            best_match_node=got.best_match_node, host_hit_length=int(got.host_hit_length),
            swa_host_hit_length=0, mamba_host_hit_length=int(got.mamba_host_hit_length))
        tokens, last = load_back_as_scheduled(self.env, self.cache, got, req, self.name)
        self._settle()
        slot = None
        if req.kv.mamba_pool_idx is not None:
            slot = int(req.kv.mamba_pool_idx) - 1  # as ``alloc_state`` numbers them
            self.held_states.add(slot)
        return tokens, self._page_of(last), slot

    def insert(self, key: Key, full_slots: Sequence[int], state: int) -> tuple[int, bool]:
        cached = len(self._cached_full(key, self._pages())) if isinstance(key, Key) else 0
        prefix, taken = super().insert(key, full_slots, state)
        self._settle()  # the backups this insert queued (write_through)
        return min(prefix, cached), taken

    # -- the view -----------------------------------------------------------------------

    def _device_nodes(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        """The nodes with a device full value: host-only nodes, and so their subtrees,
        give no page (module docstring)."""
        return ((end, node) for end, node in self._walk()
                if node.component_data[self.full_ct].value is not None)

    def host_only(self) -> list[tuple[int, ...]]:
        """Where the nodes whose full KV is on the host only end (for tests and
        coverage counts: the states the view leaves out)."""
        return sorted(end for end, node in self._walk()
                      if node.component_data[self.full_ct].value is None
                      and node.component_data[self.full_ct].host_value is not None)

    def node(self, page: Key) -> Any:
        """SGLang's node that ends where ``page`` ends (ValueError: none)."""
        self._require_page(page, "page")
        found = self._node_ending_at(page)
        if found is None:
            raise ValueError(f"{self.name}: no node ends at {page}")
        return found

    def observe(self) -> MambaView:
        self._settle()
        view = super().observe()
        return replace(view, host=self._host_view(view.pages))

    def _host_view(self, on_device: Mapping[Key, MambaPageView]) -> MambaHostView:
        """The host tier as 13m.8b's state: per page of each node with a host value, its
        host full slots and, on the node's last page, its host state slot (pages with
        neither are left out); each host pool's free slots (staged frees included); the
        code layer 0 holds in each held host slot (KV: ``page_first_direct``
        ``[K/V, page, layer, token, head, dim]``; states: ``temporal_buffer``
        ``[slot, layer, 1, *shape]``, its first element, as the device view reads)."""
        pages: dict[Key, MambaHostPageView] = {}
        for end, node in self._walk():
            full_value = node.component_data[self.full_ct].host_value
            state_value = node.component_data[self.mamba_ct].host_value
            if full_value is None and state_value is None:
                continue
            full = [] if full_value is None else full_value.tolist()
            state = None if state_value is None else int(state_value[0])
            width = len(node.key.token_ids)
            for offset in range(0, width, self.ps):
                last = offset + self.ps == width
                page = MambaHostPageView(full=tuple(full[offset:offset + self.ps]),
                                         state=state if last else None)
                if page.full or page.state is not None:
                    pages[Key(end[:len(end) - width + offset + self.ps], None)] = page
        (kv_host, kv_size), (state_host, state_size) = (self.host_pools[self.full_ct],
                                                        self.host_pools[self.mamba_ct])
        held_full = {s for p in pages.values() for s in p.full}
        held_states = {p.state for p in pages.values() if p.state is not None}
        # DEV-M13: under write_back, host pressure reclaims the full host copies of pages
        # still on the device and keeps their host states. A host-only page without a
        # full host copy is no part of it.
        exempt = frozenset(k for k, p in pages.items() if not p.full and k in on_device) \
            if self.policy == "write_back" else frozenset()
        return MambaHostView(
            pages=pages, full_slots=kv_size, state_slots=state_size,
            full_free=host_free_slots(kv_host), state_free=host_free_slots(state_host),
            full_kv=_codes_at(kv_host.kv_buffer[0, :, 0, :, 0, 0].flatten().tolist(),
                              held_full),
            state_kv=_codes_at(state_host.temporal_buffer[:, 0, 0].flatten(1)[:, 0].tolist(),
                               held_states),
            exempt={"INV-MAMBA-HOST-ONLY-WITH-FULL": exempt} if exempt else {})

    def _own_check(self) -> str | None:
        problem = super()._own_check()
        if problem is not None:
            return problem
        problems = self.host_problems()
        return "; ".join(problems) if problems else None

    def host_problems(self) -> list[str]:
        """Per host pool: node host values and the free list partition it (module
        docstring)."""
        problems: list[str] = []
        for ct, (pool, size) in self.host_pools.items():
            owned: dict[int, int] = {}  # host slot -> the node whose host value holds it
            for _, node in self._walk():
                value = node.component_data[ct].host_value
                for slot in [] if value is None else value.tolist():
                    if slot in owned:
                        problems.append(f"{ct.name} host slot {slot} held by nodes "
                                        f"{owned[slot]} and {node.id}")
                    owned[slot] = node.id
            free = pool.free_slots.tolist() + [s for part in pool.release_slots
                                               for s in part.tolist()]
            if len(free) != len(set(free)):
                problems.append(f"{ct.name} host free list holds a slot twice")
            if pool.available_size() != len(free):
                problems.append(f"{ct.name} host available_size {pool.available_size()} "
                                f"!= {len(free)} free slots")
            both = set(free) & owned.keys()
            lost = set(range(size)) - set(free) - owned.keys()
            if both:
                problems.append(f"{ct.name} host slots both free and held: {sorted(both)}")
            if lost:
                problems.append(f"{ct.name} host slots neither free nor held: {sorted(lost)}")
        return problems


def _codes_at(values: list[float], slots: set[int]) -> dict[int, int]:
    """slot -> code for ``slots`` of a host pool's layer-0 values (NaN: never written)."""
    return {slot: int(values[slot]) for slot in sorted(slots) if not math.isnan(values[slot])}


def build_hicache(policy: MambaPolicy) -> Callable[[MambaConfig], SglangMambaHiCacheAdapter]:
    """The builder of ``SglangMambaHiCacheAdapter``s under ``policy``."""
    if policy not in MAMBA_POLICIES:
        raise ValueError(f"{NAME}: policy must be one of {MAMBA_POLICIES}, got {policy!r}")

    def build_with(config: MambaConfig) -> SglangMambaHiCacheAdapter:
        return SglangMambaHiCacheAdapter(config, policy)
    return build_with


# One builder per write policy, for the registry (``hiradix.engines.catalog``).
build_write_through = build_hicache("write_through")
build_write_back = build_hicache("write_back")
