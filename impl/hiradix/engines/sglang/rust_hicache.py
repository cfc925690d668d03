"""Adapter for SGLang 0.5.23's ``UnifiedRadixCache`` with HiCache on its Rust tree core
(engine ``sglang-unified-rust-hicache``; spec/07r "The host tier").

The cache is built as the server builds it for ``--enable-hierarchical-cache``
(``sglang_unified.build`` with ``tree_core_backend="rust"``: the FULL component, then
``init_hicache``), write-through. Everything the device-tier adapter (``sglang_rust``)
reads is read the same way; what the host tier adds:

==============================  ==========================================================
what                             how it is observed
==============================  ==========================================================
host slots per node              ``is_backuped(h)``, then
                                 ``build_storage_backup_spec(h, False).host_value``
a node off the device            ``get_component_device_value(h, FULL)`` is None
tokens of a host-only node       decoded from the host pool's KV bytes at its host slots
free host slots                  the host pool (Python): ``free_slots``
backups in flight                ``cache.ongoing_write_through`` (ack id = node handle),
                                 acknowledged by ``writing_check``
loads in flight                  ``cache.ongoing_load_back`` (key: the load's node),
                                 acknowledged by ``loading_check``
host lock refs per node          not exposed: not in ``pretty_print`` (which prints
                                 ``full_lock`` only), no accessor: ``host_protect`` is
                                 read off the reference core (spec/07r DEV-R3)
KV bytes on the host             the host pool's buffers (Python)
==============================  ==========================================================

Mapped as on the Python core: DEV-7 (one lock per backed-up node folded into one per
run), DEV-23 (``last_host_node`` is the best match), DEV-26 (``flush_pending_backups``
after insert), the scheduler's ``ready_to_load_host_cache`` after a queued load.
Unobservable: ``hits``, ``last_tick``, ``insert_tick``, ``priority`` (DEV-R1), read off
a Python reference core with HiCache given the same calls, host tier included
(``sglang_rust_reference.HostReference``; ``Parted`` where the two cores answer a call
differently or hold other pages, device or host slots, locks or totals), as the
device-tier adapter reads them; and ``host_protect`` (DEV-R3), read off the same
reference, each node's host lock count with DEV-22 mapped as the Python-core adapter
maps it (``sglang_unified.load_host_locks``: a load's lock taken off its anchor's
segment, one added to each page of its chain). So a load's host protection is checked
against the model page by page. The Rust core's own host lock counts stay unseen: a
Rust core that locked otherwise than its reference shows only through consequences,
what ``evict_host`` takes (compared call by call) and the host slots left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from hiradix.conformance.abstraction import decode_kv
from hiradix.conformance.scenario import Scenario
from hiradix.engines.protocol import EngineAdapter
from hiradix.engines.sglang.radix import (
    DTYPE,
    HI_OPS,
    KV_LAYOUTS,
    LAYERS,
    SglangAdapter,
    _Run,
    read_host_kv,
)
from hiradix.engines.sglang.rust import (
    UNOBSERVABLE,
    SglangRustAdapter,
    _fingerprint,
    _Node,
)
from hiradix.engines.sglang.rust import probe as probe_rust
from hiradix.engines.sglang.rust_reference import HostReference
from hiradix.engines.sglang.unified import build, load_back_params
from hiradix_model import Config, Key, Page, State, Transfer, ops

HOST_UNOBSERVABLE: Mapping[str, str] = {
    **UNOBSERVABLE,
    "host_protect": "the Rust core keeps host lock refs with no accessor; pretty_print "
                    "prints the device lock only; read off the reference core, mapped "
                    "as DEV-22 (spec/07r DEV-R3)",
}


def probe(engine: str) -> str:
    """The installed SGLang version, if it has the Rust tree core (``sglang_rust``);
    ``init_hicache`` is part of every 0.5.23 ``UnifiedRadixCache``."""
    return probe_rust(engine)


class SglangRustHicacheAdapter(SglangRustAdapter):
    """``UnifiedRadixCache`` with HiCache (write-through) on ``RustUnifiedTreeCore``."""

    name = "sglang-unified-rust-hicache"

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        ps = self.ps
        # A configuration attribute SGLang fixes at 10 tokens (spec/01).
        self.cache.load_back_threshold = scenario.threshold_pages * ps
        self.operations = HI_OPS | {"reset"}
        self.config = Config(page_size=ps, device_slots=scenario.device_pages * ps,
                             host_slots=int(self.host.logical_size),
                             write_policy="write_through", eviction=scenario.eviction,
                             load_back_threshold=scenario.threshold_pages * ps)
        self.unobservable = HOST_UNOBSERVABLE
        self.mapped = {
            **{k: v for k, v in self.mapped.items() if k != "last_host_page"},
            "last_host_page": "DEV-23: SGLang's last_host_node is the best match, host copy "
                              "or not; the spec's is its deepest ancestor with a host copy",
            "lock": "DEV-7: one lock per backed-up node is folded into one lock per run",
            "host_protect": "DEV-22 on the reference core: a load's host lock sits on its "
                            "anchor's segment until the ack; the spec protects every page "
                            "of the chain (DEV-5)",
            "flush backups": "DEV-26: insert queues its backups; flush_pending_backups() "
                             "issues them, as the scheduler does after each batch",
            "start loads": "init_load_back is followed by ready_to_load_host_cache(), which "
                           "starts the queued copy, as the scheduler does before a batch",
        }
        self.guards: Mapping[str, str] = {}  # none verified (spec/07 Reach lines)
        self.avoid: dict[str, str] = {}  # DEV-30: the spec now backs up as SGLang does
        self.runs: list[_Run] = []
        self.loads: dict[int, tuple[int, tuple[Key, ...]]] = {}  # ack -> (seq, pages)
        self.issued = 0

    def _reference(self, scenario: Scenario) -> HostReference:
        """The Python core with HiCache given the same calls (``HostReference``)."""
        return HostReference(self.env, scenario)

    def _build(self, scenario: Scenario) -> None:
        built = build(self.env, scenario, "rust")
        self.cache, self.kv, self.allocator, self.host = (built.cache, built.kv,
                                                          built.allocator, built.host)
        self.kv_layout = scenario.kv_layout

    # -- host-side reads ----------------------------------------------------------------

    def _host_value(self, handle: int) -> tuple[int, ...] | None:
        if not self.core.is_backuped(handle):
            return None
        spec = self.core.build_storage_backup_spec(handle, False)
        assert spec is not None, f"node {handle}: backed up, but no backup spec"
        return tuple(spec.host_value.tolist())

    def _read_host(self, slots: Sequence[int]) -> torch.Tensor:
        return read_host_kv(self.host, list(slots), self.kv_layout)

    def _host_content(self, slot: int) -> Key | None:
        return self.contents.get(_fingerprint(self._read_host([slot])[:, 0]))

    def _free_host(self) -> frozenset[int]:
        self.host._merge_release_slots()
        return frozenset(self.host.free_slots.tolist())

    def _keys_of(self, nodes: dict[int, _Node]) -> dict[int, list[Key]]:
        return {h: self._node_keys(n) for h, n in nodes.items()}

    # -- the operations -------------------------------------------------------------------

    def match_prefix(self, key: Key) -> ops.MatchResult:
        got = self.cache.match_prefix(self.env.modules["base"].MatchPrefixParams(
            key=self._key(key)))
        self._seen(int(got.last_device_node), int(got.last_host_node))
        root = self.core.root_node_handle(key.namespace)
        slots = self.core.collect_full_device_indices(got.last_device_node, root)
        assert len(slots) == got.device_prefix_len, (len(slots), got.device_prefix_len)
        nodes = self._scan()
        # DEV-23: SGLang's last_host_node is the best match; the spec's the deepest
        # matched page with a host copy.
        host = int(got.last_host_node)
        while host in nodes and nodes[host].host is None:
            host = nodes[host].parent
        if self.reference is not None:
            self.reference.agree(f"match_prefix({key}) device prefix, host hit",
                                 (int(got.device_prefix_len), int(got.host_hit_length)),
                                 self.reference.match_prefix(key))
        return ops.MatchResult(self._from_engine(slots), self._page_at(nodes, got.last_device_node),
                               self._page_at(nodes, host), int(got.host_hit_length))

    def _page_at(self, nodes: dict[int, _Node], handle: int) -> Key | None:
        """The deepest page of node ``handle``; None for a root."""
        return self._node_keys(nodes[handle])[-1] if handle in nodes else None

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        pending = dict(self.cache.ongoing_write_through)
        prefix = super().insert(key, slots, priority=priority, chunked=chunked,
                                counted_from=counted_from)
        self.cache.flush_pending_backups()  # DEV-26
        issued = [i for i, entry in self.cache.ongoing_write_through.items()
                  if pending.get(i) is not entry]
        if issued:
            nodes = self._scan()
            ordered = sorted(issued, key=lambda h: nodes[h].end)  # root-most first
            self.issued += 1
            self.runs.append(_Run(self.issued, tuple(ordered),
                                  tuple(k for h in ordered for k in self._node_keys(nodes[h])),
                                  tuple(self._node_keys(nodes[h])[-1] for h in ordered)))
        return prefix

    def evict_host(self, num_tokens: int) -> int:
        freed = int(self.cache.evict_host(num_tokens))
        if self.reference is not None:
            self.reference.agree(f"evict_host({num_tokens})", freed,
                                 self.reference.evict_host(num_tokens))
        return freed

    # Page-level bookkeeping of copies in flight, the HiRadixCache adapter's: it reads the
    # cache's ack dictionaries and the recorded runs and loads, no node.
    _pending_writes = SglangAdapter._pending_writes
    _in_flight = SglangAdapter._in_flight

    def writing_check(self) -> int:
        return self._mirrored("writing_check", SglangAdapter.writing_check(self),
                              self.cache.ongoing_write_through, HostReference.writing_check)

    def loading_check(self) -> int:
        return self._mirrored("loading_check", SglangAdapter.loading_check(self),
                              self.cache.ongoing_load_back, HostReference.loading_check)

    def _mirrored(self, check: str, done: int, ongoing: Mapping[int, Any],
                  on_reference: Callable[[HostReference], int]) -> int:
        """``done`` (what ``check`` acknowledged), once the same check on the reference
        leaves as many copies in flight."""
        if self.reference is not None:
            self.reference.agree(f"{check}: copies in flight after it", len(ongoing),
                                 on_reference(self.reference))
        return done

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        handle = self._handle(page)
        nodes = self._scan()
        chain: list[int] = []
        cursor = handle
        while cursor in nodes and nodes[cursor].device is None:
            chain.insert(0, cursor)
            cursor = nodes[cursor].parent
        host_hit = sum(nodes[h].end - nodes[h].start for h in chain)
        got, last = self.cache.init_load_back(load_back_params(self.env, handle, cursor,
                                                               host_hit, quota))
        loaded: tuple[int, ...] = ()
        if handle in self.cache.ongoing_load_back:
            # SGLang queues a load and starts it when the scheduler says the batch is
            # ready; the spec's load_back issues the copy: both halves.
            self.cache.ready_to_load_host_cache()
            self.issued += 1
            self.loads[handle] = (self.issued,
                                  tuple(k for h in chain for k in self._node_keys(nodes[h])))
            after = self._scan()
            loaded = tuple(s for h in chain for s in self._from_engine(
                torch.tensor(after[h].device)))
            if len(loaded) != got:
                raise AssertionError(f"{self.name}: init_load_back reported {got} tokens "
                                     f"loaded, the chain holds {len(loaded)}")
        end = self._page_at(self._scan(), int(last))
        if self.reference is not None:
            self.reference.agree(f"init_load_back({page}, {quota}): tokens loaded, last page",
                                 (int(got), end), self.reference.init_load_back(page, quota))
        return loaded, end

    def reset(self) -> None:
        super().reset()
        self.runs.clear()
        self.loads.clear()

    # -- the abstraction ------------------------------------------------------------------

    def _stale(self, direction: str, nodes: list[Any]) -> Transfer:
        """A copy in flight that no operation of the suite issued (reset drops SGLang's
        acknowledgements): none can be left."""
        raise AssertionError(f"{self.name}: a {direction} copy in flight that no operation "
                             f"of the suite issued")

    # DEV-7 (one lock per run) and DEV-5 (a load protects each page of its chain): the
    # HiRadixCache adapter's page correction, on the runs and loads recorded here.
    _corrected = SglangAdapter._corrected

    def _host_locks(self) -> Mapping[Key, int]:
        """Each page's host lock count as the reference core keeps it, less its loads'
        (DEV-22); none without a reference. Read after ``_stamps`` has shown the two
        cores to hold the same pages."""
        return {} if self.reference is None else self.reference.host_locks()

    def observe(self, model: State) -> State:
        nodes = self._scan()
        read = self._pages(nodes)
        stamps = self._stamps(read)
        host_locks = self._host_locks()
        pages: dict[Key, Page] = {}
        for key, (device, host, lock) in read.items():
            model_page = model.pages.get(key) or Page(None, None)
            known = stamps.get(key) or model_page
            page = self._corrected(key, Page(
                device=None if device is None else self._from_engine(torch.tensor(device)),
                host=host, lock=lock, host_protect=host_locks.get(key, 0),
                hits=known.hits, last_tick=known.last_tick, insert_tick=known.insert_tick,
                priority=known.priority))
            # DEV-R3: the Rust core shows no host lock; without a reference, the model's.
            pages[key] = page if self.reference is not None else replace(
                page, host_protect=model_page.host_protect)
        pending = self._in_flight(pages)
        arriving = {d: {s for t in pending if t.direction == d for s in t.dst}
                    for d in ("d2h", "h2d")}
        device_free = self._free_device()
        owned = {s for p in pages.values() for s in p.device or ()}
        self._audit(nodes, owned, device_free)
        host_free = self._free_host()
        host_owned = {s for p in pages.values() for s in p.host or ()}
        both = sorted(host_owned & host_free)
        assert not both, f"host slots {both} are in the tree and on the host free list"
        held = frozenset(set(range(self.config.device_slots)) - device_free - owned)
        visible = sorted((owned | held) - arriving["h2d"])
        device_kv = decode_kv(self._read_device([s + self.ps for s in visible]),
                              dict(model.device_kv), visible, LAYERS, self.token_shape,
                              DTYPE)
        visible_host = sorted(host_owned - arriving["d2h"])
        host_kv = decode_kv(self._read_host(visible_host), dict(model.host_kv), visible_host,
                            LAYERS, self.token_shape, DTYPE)
        return State(config=model.config, pages=pages, device_free=device_free,
                     host_free=host_free, held=held, device_kv=device_kv, host_kv=host_kv,
                     pending=pending, clock=model.clock,
                     evictable_tokens=int(self.cache.evictable_size()),
                     protected_tokens=int(self.cache.protected_size()))

    def _totals(self) -> tuple[int, ...]:
        return (*super()._totals(), len(self._free_host()))

    def close(self) -> None:
        super().close()
        self.cache.shutdown()


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    scenario = Scenario(**{**scenario.__dict__, "write_policy": "write_through"})
    return lambda: SglangRustHicacheAdapter(scenario)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values the adapter takes (the suite's CLI uses it)."""
    return {"host_layout": ("layer_first",), "kv_layout": KV_LAYOUTS,
            "write_policy": ("write_through",),
            "eviction": ("lru", "lfu", "fifo", "mru", "filo", "priority")}
