"""``vllm-offload``: vLLM 0.33.0/0.34.0's device cache with its CPU ``OffloadingManager`` as the
host tier (spec/10), driven as vLLM's offloading connector drives them.

- A request's full blocks are offered to ``prepare_store`` after ``allocate_slots``, as
  the connector does; the keys it takes are the model's backup run (R5), their chunks the
  host slots (spec host slot = P x chunk id + offset), the keys it evicts the host
  victims (R2). ``complete_store`` is ``writing_check``; the test's worker copies the
  bytes then.
- A finished request's blocks are freed at once (the connector's ``request_finished``
  returns False), stores in flight or not. A store takes no reference on its blocks; the
  abstraction counts the copy's pin of R3 on top of ``ref_cnt``, one lock per store in
  flight on its path (DEV-V9).
- An allocation that takes back a block a finished request's store still reads makes the
  connector flush that store: the worker copies it before the forward pass (or load)
  writes the block, and the manager hears ``complete_store`` at the end of the step. The
  model acknowledges copies oldest first, so the flush completes every older store with
  it; the machine takes that ``writing_check`` before the eviction (DEV-V9).
- A host hit (the blocks after the device hit that ``lookup`` finds ready) is loaded as
  the connector does: ``allocate_slots`` with external tokens and delayed caching, then
  ``prepare_load``, the copy, ``complete_load`` and ``cache_blocks``, all before the next
  observation: ``init_load_back`` followed by ``loading_check``.
- ``host_free`` is the manager's free list plus its never-allocated chunks, read from the
  manager, so a chunk freed twice or lost shows in INV-HOST-POOL-CONSERVATION.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hiradix.conformance.scenario import Scenario
from hiradix.engines.vllm.cache import DEVICE_OPS, VllmDevice, _modules
from hiradix_model import Key, Page, State, Transfer

OFFLOAD_OPS = DEVICE_OPS | {"writing_check", "load_back", "loading_check"}


@dataclass(frozen=True)
class Store:
    """One ``prepare_store`` whose ``complete_store`` has not come: one spec backup run."""

    request_id: str
    keys: tuple[Any, ...]  # OffloadKeys, root-most first
    pages: tuple[Key, ...]
    host: tuple[int, ...]  # the chunks' host slots
    device: tuple[int, ...]  # the request's blocks for those pages, read at issue


def _on_path(page: Key, deeper: Key) -> bool:
    return page.namespace == deeper.namespace and deeper.tokens[:len(page.tokens)] == page.tokens


class VllmOffload(VllmDevice):
    """``KVCacheManager`` plus ``CPUOffloadingManager`` (``lru`` or ``arc``)."""

    name = "vllm-offload"
    operations = OFFLOAD_OPS

    def __init__(self, scenario: Scenario, policy: str = "lru") -> None:
        super().__init__(scenario)
        m = _modules()
        self.host_pages = scenario.host_pages
        self.host = m["offload"].CPUOffloadingManager(num_chunks=scenario.host_pages,
                                                      cache_policy=policy)
        self.config = replace(self.config, host_slots=scenario.host_pages * self.ps)
        self.host_kv: dict[int, Key] = {}
        self.page_ticks: dict[Key, tuple[int, int]] = {}  # DEV-V2, kept for host-only pages
        self.stores: list[Store] = []  # in flight, oldest first
        self.flushed: list[Store] = []  # copied by a flush; complete_store at the step's end
        self.flushes = 0  # stores completed by flushes since the machine last asked
        self.contexts: dict[str, Any] = {}
        self.mapped = {**self.mapped,
                       "prepare_store": "the request's full blocks offered after "
                                        "allocate_slots; the keys taken are the backup run",
                       "complete_store": "writing_check; or, when an allocation takes back "
                                         "a block a finished request's store reads, the "
                                         "connector's flush: writing_check of it and every "
                                         "older store, before the eviction (DEV-V9)",
                       "lock": "ref_cnt, plus one pin per store in flight on the page's "
                               "path, the request finished or not (DEV-V9)",
                       "load": "allocate_slots(external tokens, delay_cache_blocks), "
                               "prepare_load, complete_load, cache_blocks = init_load_back "
                               "then loading_check"}
        self.avoid = {**self.avoid,
                      "host_eviction": "DEV-V7, DEV-V8: the host tier evicts by its own "
                                       "policy, not the tree's leaves, and all or nothing; "
                                       "vllm_machine gives the host room enough"}

    # -- keys -----------------------------------------------------------------------------

    def offload_key(self, page: Key) -> Any:
        return _modules()["offload_base"].make_offload_key(self.hash_of[page], 0)

    def context(self, request: Any, key: Key) -> Any:
        found = self.contexts.get(request.request_id)
        if found is None:
            found = _modules()["offload_base"].ReqContext(req_id=request.request_id)
            for index in range(len(key.tokens) // self.ps):
                page = Key(key.tokens[:(index + 1) * self.ps], key.namespace)
                found.set_offload_key_position(self.offload_key(page), (index + 1) * self.ps)
            self.host.on_new_request(found)
            self.contexts[request.request_id] = found
        return found

    def host_slots(self, chunk_id: int) -> tuple[int, ...]:
        return tuple(range(chunk_id * self.ps, (chunk_id + 1) * self.ps))

    # -- the connector's side of a request -------------------------------------------------

    def host_hit(self, request: Any, key: Key, device_pages: int) -> int:
        """Pages after the device hit that ``lookup`` finds ready, up to all but the
        request's last token (DEV-V4)."""
        hit = 0
        limit = (len(key.tokens) - 1) // self.ps
        lookup = _modules()["offload_base"].LookupResult.HIT
        for index in range(device_pages, limit):
            page = Key(key.tokens[:(index + 1) * self.ps], key.namespace)
            if self.host.lookup(self.offload_key(page), self.context(request, key)) != lookup:
                break
            hit += 1
        return hit

    def last_on_host(self, key: Key, pages: int) -> Key | None:
        """The deepest of the first ``pages`` pages of ``key`` with a host chunk."""
        found = None
        for index in range(pages):
            page = Key(key.tokens[:(index + 1) * self.ps], key.namespace)
            if self.host._policy.get(self.offload_key(page)) is not None:
                found = page
        return found

    def load(self, request: Any, key: Key, hit: Any, hit_tokens: int,
             pages: int) -> tuple[int, ...] | None:
        """Load ``pages`` host pages after the device hit, as the connector does."""
        external = pages * self.ps
        new = self.manager.allocate_slots(request, 0, hit_tokens, hit,
                                          num_external_computed_tokens=external,
                                          delay_cache_blocks=True)
        if new is None:
            return None
        context = self.context(request, key)
        keys = [self.offload_key(Key(key.tokens[:hit_tokens + (i + 1) * self.ps],
                                     key.namespace)) for i in range(pages)]
        spec = self.host.prepare_load(keys, context)
        # The external tokens' blocks join the block table (allocate_new_computed_blocks),
        # not the returned new blocks.
        table = self.manager.get_blocks(request.request_id).blocks[0]
        first = hit_tokens // self.ps
        self.before_forward([b.block_id for b in table])  # then the worker's load
        slots = tuple(s for b in table[first:first + pages] for s in self.slots(b.block_id))
        chunk_slots = [s for c in spec.block_ids.tolist() for s in self.host_slots(c)]
        for device, host in zip(slots, chunk_slots, strict=True):  # the worker's copy
            if host in self.host_kv:
                self.kv[device] = self.host_kv[host]
            else:
                self.kv.pop(device, None)
        self.host.complete_load(keys, context)
        request.num_computed_tokens = hit_tokens + external
        self.manager.cache_blocks(request, request.num_computed_tokens)
        self._stamp(request)
        return slots

    def store(self, request: Any, key: Key) -> tuple[Key, ...]:
        """Offer the request's full pages to ``prepare_store``; the pages it took. The
        step ends here: the stores a flush copied are completed (``end_step``)."""
        taken = self._offer(request, key)
        self.end_step()
        return taken

    def _offer(self, request: Any, key: Key) -> tuple[Key, ...]:
        context = self.context(request, key)
        pages = [Key(key.tokens[:(i + 1) * self.ps], key.namespace)
                 for i in range(len(key.tokens) // self.ps)]
        if not pages:
            return ()
        output = self.host.prepare_store([self.offload_key(p) for p in pages], context)
        if output is None or not output.keys_to_store:
            return ()
        by_key = {self.offload_key(p): p for p in pages}
        taken = tuple(by_key[k] for k in output.keys_to_store)
        blocks = self.manager.get_blocks(request.request_id).blocks[0]
        device = tuple(s for p in taken
                       for s in self.slots(blocks[len(p.tokens) // self.ps - 1].block_id))
        host = tuple(s for c in output.store_spec.block_ids.tolist()
                     for s in self.host_slots(c))
        self.stores.append(Store(request.request_id, tuple(output.keys_to_store), taken,
                                 host, device))
        return taken

    def before_forward(self, block_ids: Sequence[int]) -> None:
        """The connector's flush (DEV-V9). ``update_state_after_alloc`` records the
        request's whole block table, hit blocks included; a store of a finished request
        that reads one of those blocks is flushed: the worker copies it before the load
        or the forward pass writes anything. vLLM fences only finished requests' stores
        (a running request's blocks keep their ``ref_cnt``); the model acknowledges
        oldest first, so every older store is copied with it."""
        reused = {s for b in block_ids for s in self.slots(b)}
        fenced = [i for i, store in enumerate(self.stores)
                  if store.request_id not in self.running and reused & set(store.device)]
        if not fenced:
            return
        done, self.stores = self.stores[:fenced[-1] + 1], self.stores[fenced[-1] + 1:]
        for store in done:
            self.copy(store)
        self.flushed += done
        self.flushes += len(done)

    def take_flushes(self) -> int:
        """Stores completed by flushes since the last call: the machine's writing_check."""
        count, self.flushes = self.flushes, 0
        return count

    def end_step(self) -> None:
        """``update_connector_output`` at the step's end: ``complete_store`` of the stores
        the step's flushes copied."""
        for store in self.flushed:
            self.host.complete_store(list(store.keys), self.contexts[store.request_id])
        self.flushed.clear()

    def copy(self, store: Store) -> None:
        """The worker's copy of one store: the device blocks' bytes into its chunks."""
        for device, host in zip(store.device, store.host, strict=True):
            if device in self.kv:
                self.host_kv[host] = self.kv[device]
            else:
                self.host_kv.pop(host, None)

    def writing_check(self) -> int:
        """``complete_store`` for every store in flight (the worker's copies are done):
        the number completed."""
        done = len(self.stores)
        for store in self.stores:
            self.copy(store)
            self.host.complete_store(list(store.keys), self.contexts[store.request_id])
        self.stores.clear()
        return done

    def abandon(self, request: Any) -> None:
        """The loaded request found no room: its blocks go back, and the step ends."""
        super().abandon(request)
        self.end_step()

    def finish(self, request_id: str) -> Any:
        """``free`` at once, stores in flight or not (``request_finished`` returns False)."""
        context = self.contexts.get(request_id)
        if context is not None:
            self.host.on_request_finished(context)
        return super().finish(request_id)

    def reset(self) -> bool:
        """``reset_prefix_cache``, then the connector's ``reset_cache``: the stores in
        flight are forgotten (their late copies land in chunks the reset freed)."""
        if self.running:
            return bool(self.manager.reset_prefix_cache())  # refused: blocks are held
        self.host.reset_cache()
        self.stores.clear()
        self.host_kv.clear()
        self.contexts.clear()
        self.page_ticks.clear()
        return super().reset()

    # -- the abstraction ------------------------------------------------------------------------

    def observe(self, model: State) -> State:
        seen = super().observe(model)
        pages = dict(seen.pages)
        self.page_ticks.update({k: (p.last_tick, p.insert_tick) for k, p in pages.items()})
        # Every key the run offered, through the policy's own lookup (LRU and ARC alike).
        for page in list(self.hash_of):
            chunk = self.host._policy.get(self.offload_key(page))
            if chunk is None:
                continue
            host = self.host_slots(chunk.chunk_id)
            protect = chunk.ref_cnt if chunk.is_ready else 0
            old = pages.get(page)
            if old is None:  # host-only: the ticks its device copy last had
                last, inserted = self.page_ticks.get(page, (0, 0))
                pages[page] = Page(device=None, host=host, lock=0, host_protect=protect,
                                   hits=0, last_tick=last, insert_tick=inserted, priority=0)
            else:
                pages[page] = replace(old, host=host, host_protect=protect)
        pending = []
        for store in self.stores:
            pending.append(Transfer("d2h", store.pages, store.device, store.host,
                                    store.pages[-1]))
            for page, record in pages.items():  # DEV-V9: the copy's pin on top of ref_cnt
                if _on_path(page, store.pages[-1]):
                    pages[page] = replace(record, lock=record.lock + 1)
        free_chunks = set(self.host._free_list) | set(
            range(self.host._num_allocated_chunks, self.host_pages))
        host_free = frozenset(s for c in free_chunks for s in self.host_slots(c))
        evictable = self.ps * sum(p.device is not None and p.lock == 0
                                  for p in pages.values())
        protected = self.ps * sum(p.device is not None and p.lock > 0 for p in pages.values())
        return replace(seen, pages=pages, host_free=host_free, host_kv=dict(self.host_kv),
                       pending=tuple(pending), evictable_tokens=evictable,
                       protected_tokens=protected)

    def counter_problems(self, seen: State) -> list[str]:
        problems = super().counter_problems(seen)
        if len(self.host._free_list) != len(set(self.host._free_list)):
            problems.append(f"a chunk is twice on the free list {self.host._free_list}")
        free = self.host._get_num_free_chunks()
        if free * self.ps != len(seen.host_free):
            problems.append(f"free chunks {free}, free host slots {len(seen.host_free)}")
        # vLLM's own count of chunks awaiting complete_store against the stores the
        # adapter holds in flight (and flushed, awaiting the step's end).
        writing = sum(len(s.keys) for s in (*self.stores, *self.flushed))
        if self.host._num_write_pending_chunks != writing:
            problems.append(f"write-pending chunks {self.host._num_write_pending_chunks}, "
                            f"stores in flight {writing}")
        return problems
