"""vLLM 0.33.0/0.34.0's KVCacheManager against the model (spec/10; skipped without vLLM).

Run from the vLLM environment: ``make vllm-env``, then
``HIRADIX_PROFILE=ci .venv-vllm/bin/python -m pytest -q -x tests/engines/test_vllm_adapters.py``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.engines import probe, scenario_space
from hiradix.engines.vllm.cache import VllmDevice
from hiradix.engines.vllm.machine import make_machine
from hiradix.engines.vllm.offload import VllmOffload
from hiradix_model import Key, initial, trace
from hiradix_model.keys import content_at


@pytest.fixture(autouse=True)
def vllm_0_33_0() -> None:
    """Skip where vLLM is not installed; where it is, it must be the one the adapter
    drives (EngineUnavailable fails the test)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (make vllm-env)")
    probe("vllm")


SCENARIOS = [Scenario(page_size=2, eviction="lru"), Scenario(page_size=4, eviction="lru"),
             Scenario(page_size=2, eviction="lru", device_pages=3)]


def bounded() -> settings:
    """A fixed set of examples (derandomized; as test_sglang_rust's): the campaigns below
    assert what they reached, which must not depend on the draw. Random examples are
    the CI campaign's (hiradix check --engine vllm / vllm-offload)."""
    current = settings()
    return settings(current, max_examples=max(1, current.max_examples // 10), deadline=None,
                    derandomize=True)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"p{s.page_size}d{s.device_pages}")
def test_vllm_refines_the_model(scenario: Scenario) -> None:
    tally = Tally()
    run_state_machine_as_test(make_machine("vllm", scenario, tally), settings=bounded())
    assert tally.ops["insert"] and tally.ops["free"], dict(tally.ops)


def test_the_scenario_space_is_what_the_machine_takes() -> None:
    space = scenario_space("vllm")
    assert space["eviction"] == ("lru",) and 1 not in space["page_size"]
    assert all("DEV-V" in why for why in VllmDevice.adopted.values())
    assert set(VllmDevice.adopted) <= set(trace.ADOPTABLE)


# -- a fixed run, and what breaks when a mapping is wrong ----------------------------------

Machine = object


def fixed_run(page_size: int = 2) -> Machine:
    """Five blocks: two requests finished (two cached pages free to evict), a third kept
    running that takes every uncached block."""
    machine = make_machine("vllm", Scenario(page_size=page_size, device_pages=5))()
    for tokens, keep in [((1, 2, 3), False), ((2, 2, 2), False), ((1, 1, 1, 1, 2), True)]:
        machine.request(tokens=tokens, namespace=None, dt=1, keep=keep)
        machine.engine_refines_the_model()
    return machine


def test_a_fixed_run_evicts_and_agrees() -> None:
    machine = fixed_run()
    machine.request(tokens=(3,), namespace="b", dt=1, keep=False)  # one block: evicts
    machine.engine_refines_the_model()
    assert machine.counts.ops["evict"] == 1
    assert Key((1, 2)) not in machine.model.pages, "the least recently released page"
    assert trace.replay([trace.header(machine.engine.config, "vllm"),
                         *(s.to_json() for s in machine.trace)])[1] is None


def _fails(machine: Machine, spoil: Callable[[VllmDevice], None], expected: str) -> None:
    spoil(machine.engine)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match=expected):
        machine.engine_refines_the_model()  # type: ignore[attr-defined]


def test_the_lock_mapping_can_fail() -> None:
    """ref_cnt <-> lock: a reference nobody released shows as a lock the model lacks."""
    def extra_ref(engine: VllmDevice) -> None:
        engine.pool.touch([engine.pool.blocks[1]])
    _fails(fixed_run(), extra_ref, "disagree")


def test_the_hash_mapping_can_fail() -> None:
    """block hash <-> page: a block registered under another page's hash holds the wrong
    KV (INV-KV-INTEGRITY), or names a page no request hashed."""
    def swap(engine: VllmDevice) -> None:
        table = engine.pool.cached_block_hash_to_block
        a, b = (table.get_one_block(k) for k in list(table._cache)[:2])
        ha, hb = a.block_hash, b.block_hash
        for block, new in ((a, hb), (b, ha)):
            table.pop(block.block_hash, block.block_id)
            block.reset_hash()
            block.set_block_hash(new)
            table.insert(new, block)
    _fails(fixed_run(), swap, "disagree|INV-KV-INTEGRITY")


def test_the_free_queue_mapping_can_fail() -> None:
    """free queue <-> device_free + evictable: a block taken off the queue by hand is
    owned by nobody (vLLM's counter disagrees, or the pool loses a slot)."""
    def leak(engine: VllmDevice) -> None:
        queue = engine.pool.free_block_queue
        queue.remove(queue.get_all_free_blocks()[0])
    _fails(fixed_run(), leak, "disagree|INV-DEVICE-POOL-CONSERVATION|INV-ACCOUNTING")


def test_the_lru_mapping_can_fail() -> None:
    """free-queue order <-> LRU rank (DEV-V2): a queue that evicts the most recently
    released page first is an illegal victim for the model (spec/03 R1)."""
    from hiradix_model.errors import IllegalChoice

    machine = fixed_run()
    queue = machine.engine.pool.free_block_queue  # type: ignore[attr-defined]
    cached = [b for b in queue.get_all_free_blocks() if b.block_hash is not None]
    assert len(cached) >= 2
    queue.remove(cached[0])
    queue.append(cached[0])  # the oldest release now goes last
    queue.remove(cached[-1])
    queue.prepend_n([cached[-1]])  # the newest goes first
    with pytest.raises(IllegalChoice, match="but a leaf ranks"):
        machine.request(tokens=(3,), namespace="b", dt=1, keep=False)  # type: ignore[attr-defined]


def test_dev_v1_a_whole_cached_key_gets_a_duplicate_block() -> None:
    """spec/10 DEV-V1, reproduced: a request whose page-aligned key is wholly cached
    recomputes its last page (the hit stops one token short) into a new block, which vLLM
    registers under the same hash. Two blocks then hold one page; the model has one copy
    per page, so the machine steers clear of page-aligned keys. If this fails, vLLM now
    de-duplicates: update DEV-V1 and drop the steering."""
    engine = VllmDevice(Scenario(page_size=2, device_pages=4))
    model = initial(engine.config)
    for _ in range(2):
        request = engine.new_request(Key((1, 2, 3, 4)))
        hit, hit_tokens = engine.lookup(request)
        assert engine.schedule(request, Key((1, 2, 3, 4)), hit, hit_tokens) is not None
    assert hit_tokens == 2, "the second request hit all but its last page"
    table = engine.pool.cached_block_hash_to_block
    assert len(table._cache) == 2, "two pages"
    shared = [b for b in engine.pool.blocks if b.block_hash is not None]
    assert len(shared) == 3, "three blocks: the last page twice"
    seen = engine.observe(model)
    assert len(seen.pages) == 2 and len(seen.held) == 2, "the duplicate shows as held"


# -- vllm-offload: the CPU OffloadingManager as the host tier ------------------------------

BIG_HOST = [Scenario(page_size=2, device_pages=6), Scenario(page_size=4, device_pages=4)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("scenario", BIG_HOST, ids=lambda s: f"p{s.page_size}d{s.device_pages}")
def test_vllm_offload_refines_the_model(scenario: Scenario, policy: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores, their acknowledgement, device eviction to host and loads back, under both
    host policies, and reuses of blocks whose store is in flight (the flush, DEV-V9).
    The machine's host never fills: host eviction is DEV-V7, DEV-V8."""
    flushes: list[int] = []
    take = VllmOffload.take_flushes

    def counted(engine: VllmOffload) -> int:
        flushes.append(take(engine))
        return flushes[-1]
    monkeypatch.setattr(VllmOffload, "take_flushes", counted)
    tally = Tally()
    run_state_machine_as_test(make_machine("vllm-offload", scenario, tally, policy),
                              settings=bounded())
    assert tally.ops["writing_check"] > sum(map(bool, flushes)) > 0, (dict(tally.ops),
                                                                       flushes)


def offload_run() -> Machine:
    """A request stored to host and acknowledged, its device copy evicted, and the same
    request again: a host hit loaded back."""
    machine = make_machine("vllm-offload", Scenario(page_size=2, device_pages=3,
                                                    host_pages=8))()
    machine.request(tokens=(1, 2, 1, 1, 3), namespace=None, dt=1, keep=False)
    machine.writing_check()
    machine.request(tokens=(2, 2, 2, 2, 3), namespace=None, dt=1, keep=False)  # evicts
    machine.writing_check()
    machine.engine_refines_the_model()
    return machine


def test_a_host_hit_is_loaded_back() -> None:
    machine = offload_run()
    assert machine.model.pages[Key((1, 2, 1, 1))].device is None, "evicted to host"
    machine.request(tokens=(1, 2, 1, 1, 3), namespace=None, dt=1, keep=False)
    machine.engine_refines_the_model()
    assert machine.counts.ops["init_load_back"] == 1 and machine.counts.ops["loading_check"]
    assert machine.model.pages[Key((1, 2, 1, 1))].device is not None


def reuse_run() -> Machine:
    """One request stored to host and freed at once with its store still in flight
    (three blocks: two pinned pages and a tail); the store is not acknowledged."""
    machine = make_machine("vllm-offload", Scenario(page_size=2, device_pages=3,
                                                    host_pages=8))()
    machine.request(tokens=(1, 2, 1, 1, 3), namespace=None, dt=1, keep=False)
    machine.engine_refines_the_model()
    engine = machine.engine
    assert machine.model.pending and engine.stores, "the store is in flight"  # type: ignore[attr-defined]
    assert not engine.running, "and the request's blocks are freed (DEV-V9)"  # type: ignore[attr-defined]
    assert machine.model.pages[Key((1, 2, 1, 1))].lock == 1, "the copy's pin alone"
    return machine


REUSER = (2, 2, 2, 2, 3)  # three blocks: every block of reuse_run's request


def test_a_reused_block_flushes_its_store_first() -> None:
    """spec/10 DEV-V9: an allocation that takes back the blocks of a store in flight
    flushes it (writing_check before the eviction); the host keeps the old bytes."""
    machine = reuse_run()
    machine.request(tokens=REUSER, namespace=None, dt=1, keep=False)
    machine.engine_refines_the_model()
    assert machine.counts.ops["writing_check"] == 1 and machine.counts.ops["evict"] == 1
    for page in (Key((1, 2)), Key((1, 2, 1, 1))):
        record = machine.model.pages[page]
        assert record.device is None and record.host is not None, "evicted to host"
        assert [machine.model.host_kv[s] for s in record.host] == [
            content_at(Key((1, 2, 1, 1, 3)), i) for i in range(len(page.tokens) - 2,
                                                                len(page.tokens))]
    engine = machine.engine
    assert engine.host._num_write_pending_chunks == 2, "REUSER's own store"  # type: ignore[attr-defined]
    assert trace.replay([trace.header(machine.engine.config, "vllm-offload"),
                         *(s.to_json() for s in machine.trace)])[1] is None


def test_a_store_copied_after_the_reuse_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug in a private copy of the flush: the worker copies the flushed store
    only after the forward pass wrote the reused blocks, so the host copy holds the new
    request's KV."""
    machine = reuse_run()
    engine = machine.engine
    flush, store = engine.before_forward, engine.store  # type: ignore[attr-defined]
    late: list[list[int]] = []

    def store_late(request: object, key: Key) -> object:
        for block_ids in late:  # after schedule's forward pass
            flush(block_ids)
        late.clear()
        return store(request, key)
    monkeypatch.setattr(engine, "before_forward", late.append)
    monkeypatch.setattr(engine, "store", store_late)
    machine.request(tokens=REUSER, namespace=None, dt=1, keep=False)
    with pytest.raises(AssertionError, match=r"disagree|INV-KV-INTEGRITY"):
        machine.engine_refines_the_model()


def test_a_reuse_without_the_flush_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug: the connector misses the reuse (no fence on a finished request's
    blocks), so vLLM evicts pages whose copy is still in flight; the model's pin (R3)
    makes those victims illegal."""
    from hiradix_model.errors import IllegalChoice

    machine = reuse_run()
    monkeypatch.setattr(machine.engine, "before_forward", lambda block_ids: None)
    with pytest.raises(IllegalChoice, match="not an evictable leaf"):
        machine.request(tokens=REUSER, namespace=None, dt=1, keep=False)


def test_a_delayed_free_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's pin is counted on top of ref_cnt (DEV-V9): a connector that delays the
    free while the store is in flight (the order this adapter used to drive) keeps a
    reference and the tail, which the model does not have."""
    machine = make_machine("vllm-offload", Scenario(page_size=2, host_pages=8))()
    monkeypatch.setattr(machine.engine.manager, "free", lambda request: None)
    machine.request(tokens=(1, 2, 3), namespace=None, dt=1, keep=False)
    assert machine.model.pending, "the store is in flight"
    with pytest.raises(AssertionError, match="disagree"):
        machine.engine_refines_the_model()


def test_the_write_pending_count_can_fail() -> None:
    """Stores in flight <-> vLLM's write-pending chunks: a store the manager completes
    behind the worker's back (no copy) shows in INV-ACCOUNTING."""
    machine = reuse_run()

    def complete_early(engine: VllmDevice) -> None:
        store = engine.stores[0]  # type: ignore[attr-defined]
        engine.host.complete_store(list(store.keys), engine.contexts[store.request_id])  # type: ignore[attr-defined]
    _fails(machine, complete_early, "INV-ACCOUNTING")


def test_the_host_pool_mapping_can_fail() -> None:
    """chunk <-> host slots: a chunk freed while a page still names it is owned twice."""
    machine = offload_run()

    def double_free(engine: VllmDevice) -> None:
        chunk = next(iter(engine.host._policy.chunks.values()))  # type: ignore[attr-defined]
        engine.host._free_list.append(chunk.chunk_id)  # type: ignore[attr-defined]
    _fails(machine, double_free, "INV-HOST-POOL-CONSERVATION|INV-ACCOUNTING|disagree")


def test_dev_v7_host_eviction_takes_the_copy_of_a_page_on_device() -> None:
    """spec/10 DEV-V7, reproduced: vLLM's host tier is an LRU cache of blocks of its own.
    With no room it evicts the least recent ready chunk, here the host copy of a page that
    is still on device, where the spec evicts only host-only leaves (R2). The model
    rejects the backup report. If this fails, vLLM's host eviction now follows the tree:
    update DEV-V7 and run the offload campaigns with a small host."""
    from hiradix_model.errors import IllegalChoice

    machine = make_machine("vllm-offload", Scenario(page_size=2, device_pages=6,
                                                    host_pages=3), host_eviction=True)()
    machine.request(tokens=(1, 2, 1, 1, 3), namespace=None, dt=1, keep=False)
    machine.writing_check()
    machine.engine_refines_the_model()
    with pytest.raises(IllegalChoice, match="host_slots"):
        machine.request(tokens=(1, 1, 1, 1, 3), namespace=None, dt=1, keep=False)
    assert machine.model.pages[Key((1, 2, 1, 1))].device is not None


LONG = (1, 2, 1, 1, 1, 1, 1, 1, 1, 1)  # five pages and a tail: six blocks


def test_dev_v8_a_store_without_room_for_all_of_it_evicts_nothing() -> None:
    """spec/10 DEV-V8 on the host, reproduced: when its evictable chunks cannot cover the
    whole offer, ``prepare_store`` stores nothing and evicts nothing; the spec makes host
    room from every host-only leaf first (R2), so the model rejects the empty report.
    If this fails, vLLM now evicts what it can: update DEV-V8."""
    from hiradix_model.errors import IllegalChoice

    machine = make_machine("vllm-offload", Scenario(page_size=2, device_pages=6,
                                                    host_pages=4), host_eviction=True)()
    machine.request(tokens=(1, 1), namespace=None, dt=0, keep=False)
    machine.writing_check()  # (1, 1) stored and acknowledged
    machine.engine_refines_the_model()
    # The long request takes every block: it evicts (1, 1) to host, then offers five
    # pages to a host with three free chunks and one evictable (the host copy of (1, 1),
    # host-only by then).
    with pytest.raises(IllegalChoice, match="stopped at 0 of 4 tokens"):
        machine.request(tokens=LONG, namespace=None, dt=0, keep=False)
    engine = machine.engine
    chunk = engine.host._policy.get(engine.offload_key(Key((1, 1))))  # type: ignore[attr-defined]
    assert chunk is not None and chunk.is_ready, "vLLM evicted nothing"
    assert not engine.stores, "and stored nothing"  # type: ignore[attr-defined]


def test_dev_v9_a_flushed_chunk_makes_no_host_room_in_its_step() -> None:
    """spec/10 DEV-V9, reproduced: a store flushed by a reuse is completed only at the
    step's end (update_connector_output), so the same step's prepare_store cannot evict
    its chunk (write-pending, not ready). The model acknowledges the copy before the
    eviction it allows, so the page is a host-only leaf there, and host room must come
    from it (R2): the model rejects vLLM's empty report. If this fails, vLLM now
    completes a flushed store before the step's stores: update DEV-V9."""
    from hiradix_model.errors import IllegalChoice

    machine = make_machine("vllm-offload", Scenario(page_size=2, device_pages=6,
                                                    host_pages=4), host_eviction=True)()
    machine.request(tokens=(1, 1), namespace=None, dt=0, keep=False)
    machine.engine_refines_the_model()
    assert machine.model.pending, "(1, 1)'s store is in flight, its block free"
    with pytest.raises(IllegalChoice, match="stopped at 0 of 4 tokens"):
        machine.request(tokens=LONG, namespace=None, dt=0, keep=False)
    assert machine.counts.ops["writing_check"] == 1, "the flush was taken"
    engine = machine.engine
    chunk = engine.host._policy.get(engine.offload_key(Key((1, 1))))  # type: ignore[attr-defined]
    assert chunk is not None and chunk.is_ready, "completed at the step's end"
    assert not engine.stores and not engine.flushed, "nothing stored"  # type: ignore[attr-defined]
