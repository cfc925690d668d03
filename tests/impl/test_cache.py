"""The cache's public API on hand-built cases: typed errors leave it unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hiradix.clock import ManualClock
from hiradix.conformance.scenario import Scenario
from hiradix.distributed import TorchDistributedSync
from hiradix.errors import ForeignNode, InvalidArgument, InvariantViolation, NotLocked
from hiradix.keys import RadixKey


def cache_with(tokens: tuple[int, ...], **changes: object):  # type: ignore[no-untyped-def]
    cache = Scenario(**changes).build(ManualClock(1), None)  # type: ignore[arg-type]
    slots = cache.device_pool.alloc(len(tokens))
    assert slots is not None
    cache.insert(RadixKey(tokens), slots)
    return cache


def snapshot(cache) -> str:  # type: ignore[no-untyped-def]
    return cache.dump() + repr(sorted(cache.device_pool.free_slots())) + repr(
        sorted(cache.host_pool.free_slots()))


def test_match_insert_and_prefix_length() -> None:
    cache = cache_with((1, 2, 3, 4))
    match = cache.match_prefix(RadixKey((1, 2, 3, 9)))
    assert len(match.device_slots) == 2 and match.host_hit_length == 0
    more = cache.device_pool.alloc(2)
    assert more is not None
    slots = torch.cat([match.device_slots, more])
    assert cache.insert(RadixKey((1, 2, 3, 9)), slots) == 2
    cache.check_invariants()


def test_namespaces_do_not_share_nodes() -> None:
    cache = cache_with((1, 2))
    assert len(cache.match_prefix(RadixKey((1, 2), "other")).device_slots) == 0


@pytest.mark.parametrize(("call", "error", "argument"), [
    (lambda c: c.insert(RadixKey((1, 2)), torch.tensor([0, 1], dtype=torch.int32)),
     InvalidArgument, "slots"),
    (lambda c: c.insert(RadixKey((5, 6)), torch.tensor([0], dtype=torch.int64)),
     InvalidArgument, "slots"),
    (lambda c: c.insert(RadixKey((5, 6)), torch.tensor([0, 1], dtype=torch.int64)),
     InvalidArgument, "slots[0]"),  # the tree's own slots, at another position
    (lambda c: c.insert((5, 6), torch.tensor([0, 1])), InvalidArgument, "key"),
    *((lambda c, bad=bad: c.insert(RadixKey((1, 2, 3, 4)), own(c, (1, 2, 3, 4)),
                                   counted_from=bad), InvalidArgument, "counted_from")
      for bad in (-2, 1, 6, True, 2.0)),
    (lambda c: c.evict(-1), InvalidArgument, "num_tokens"),
    (lambda c: c.evict_host(1.5), InvalidArgument, "num_tokens"),
    (lambda c: c.dec_lock_ref(c.nodes()[0]), NotLocked, "node"),
    (lambda c: c.load_back(c.nodes()[0]), InvalidArgument, "node"),
    (lambda c: c.inc_lock_ref("node"), ForeignNode, "node"),
])
def test_misuse_raises_a_typed_error_and_changes_nothing(call, error, argument) -> None:  # type: ignore[no-untyped-def]
    cache = cache_with((1, 2, 3, 4), write_policy="write_back")
    before = snapshot(cache)
    with pytest.raises(error) as raised:
        call(cache)
    assert raised.value.argument == argument
    assert snapshot(cache) == before
    cache.check_invariants()


def own(cache, tokens: tuple[int, ...]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The cache's own slots for ``tokens`` plus fresh ones for the rest."""
    match = cache.match_prefix(RadixKey(tokens))
    more = cache.device_pool.alloc(len(tokens) - len(match.device_slots))
    assert more is not None
    return torch.cat([match.device_slots, more])


def page_hits(cache) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """Hits per page, by the page's end position (a node's hits are each page's)."""
    found = {}
    for node in cache.nodes():
        start, parent = 0, node.parent
        while parent is not None:
            start, parent = start + len(parent.tokens), parent.parent
        for end in range(start + cache.page_size, start + len(node.tokens) + 1,
                         cache.page_size):
            found[end] = node.hits
    return found


def test_counted_from_splits_so_that_only_pages_past_it_count() -> None:
    """spec/03 3.5: a node across counted_from is split there, so hits stay per page."""
    cache = cache_with((1, 2, 3, 4), write_policy="write_back")
    key = RadixKey((1, 2, 3, 4, 5, 6))
    assert cache.insert(key, own(cache, key.tokens), counted_from=2) == 4
    assert page_hits(cache) == {2: 1, 4: 2, 6: 1}
    fresh = Scenario(write_policy="write_back").build(ManualClock(1), None)
    assert fresh.insert(key, own(fresh, key.tokens), counted_from=4) == 0
    assert page_hits(fresh) == {2: 0, 4: 0, 6: 1}
    cache.check_invariants()
    fresh.check_invariants()


def test_a_due_node_is_backed_up_with_its_uncounted_ancestors() -> None:
    cache = Scenario(write_policy="write_through").build(ManualClock(1), None)
    key = RadixKey((1, 2, 3, 4))
    cache.insert(key, own(cache, key.tokens), counted_from=2)
    # Only (1, 2, 3, 4) counts a hit and is due; its uncounted parent page goes with it,
    # in one copy (R5, DEV-30).
    assert page_hits(cache) == {2: 0, 4: 1}
    assert all(node.host is not None for node in cache.nodes())
    assert len(cache.pending["d2h"]) == 1
    cache.check_invariants()


def test_nodes_of_another_cache_or_after_reset_are_foreign() -> None:
    cache, other = cache_with((1, 2)), cache_with((1, 2))
    with pytest.raises(ForeignNode):
        cache.inc_lock_ref(other.nodes()[0])
    node = cache.nodes()[0]
    cache.reset()
    with pytest.raises(ForeignNode):
        cache.inc_lock_ref(node)


def test_a_copys_lock_is_not_the_callers() -> None:
    cache = cache_with((1, 2))  # write_through: the backup locks the node
    with pytest.raises(NotLocked):
        cache.dec_lock_ref(cache.nodes()[0])
    cache.engine.complete("d2h")  # type: ignore[attr-defined]
    assert cache.writing_check() == 1
    assert cache.nodes()[0].lock_ref == 0


def test_check_invariants_names_the_spec_id_and_shows_the_tree() -> None:
    cache = cache_with((1, 2))
    cache.protected_tokens += 2
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-ACCOUNTING"
    assert "cache state" in str(raised.value) and "Node#" in str(raised.value)


def test_rank_sync_over_torch_distributed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        assert TorchDistributedSync().min(7) == 7
    finally:
        dist.destroy_process_group()


def test_hiradix_replay_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from hiradix.cli import main
    from hiradix_model import Config, trace

    path = tmp_path / "t.jsonl"
    config = Config(page_size=1, device_slots=4, host_slots=4)
    step = trace.Step("match_prefix", {"key": {"tokens": [1], "namespace": None}, "now": 1},
                      {"device_slots": [3], "last_device_page": None,
                       "last_host_page": None, "host_hit_tokens": 0})
    trace.write(str(path), config, "test", [step])
    assert main(["replay", str(path)]) == 1  # the empty cache matches nothing
    assert "line 2 (match_prefix)" in capsys.readouterr().out


# -- the public constructor and the storage tier wired into the cache (issue 12) --------

def storage_cache():  # type: ignore[no-untyped-def]
    from hiradix import HiRadixCache, MemoryBackend, TierSettings

    cache = HiRadixCache.create(device_slots=16, page_size=2, host_ratio=2.0,
                                write_policy="write_through", load_back_threshold=0)
    backend = MemoryBackend()
    settings = TierSettings(prefetch_threshold=2, prefetch_policy="wait_complete")
    assert cache.attach_storage_backend(backend, "model", settings, threaded=False) == "attached"
    return cache, backend


def test_the_caches_writing_check_backs_up_to_storage() -> None:
    """Before issue 12 only StorageTier.writing_check wrote to storage; an engine calling
    the cache's writing_check (SGLang's one call) silently stored nothing."""
    cache, backend = storage_cache()
    key = RadixKey((1, 2, 3, 4))
    slots = cache.alloc(4)
    cache.insert(key, slots)
    assert cache.writing_check() == 1  # the copy to host, acknowledged once
    tier = cache.storage
    assert tier.metrics.writes_issued == 1 and tier.metrics.write_pages_issued == 2
    tier.io.run_pending()
    tier.drain_storage_queues()
    assert len(backend) == 2
    assert cache.writing_check() == 0 and tier.metrics.writes_issued == 1
    cache.check_invariants()
    tier.check()


def test_check_invariants_counts_the_host_slots_a_prefetch_holds() -> None:
    """INV-HOST-POOL-CONSERVATION used to false-alarm during any valid prefetch: the
    host slots it reserved are the tier's, not leaked (spec/09, 9.2)."""
    cache, _ = storage_cache()
    key = RadixKey((1, 2, 3, 4))
    cache.insert(key, cache.alloc(4))
    cache.writing_check()
    tier = cache.storage
    tier.io.run_pending()
    tier.drain_storage_queues()
    cache.reset()  # a restart: the tree is gone, storage keeps the pages
    assert tier.query_storage_hit_length(key) == 4
    assert tier.prefetch_from_storage("r", key) == 4
    assert sorted(tier.host_slots_owned()) != []
    cache.check_invariants()  # slots reserved, I/O not run yet
    tier.io.run_pending()
    cache.check_invariants()  # landed, not yet inserted
    assert tier.check_prefetch_progress("r")
    assert tier.pop_prefetch_loaded_tokens("r") == 4
    cache.check_invariants()
    assert cache.match_prefix(key).host_hit_length == 4
    stray = cache.host_pool.alloc(2)  # a real leak is still found with a tier attached
    assert stray is not None
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-HOST-POOL-CONSERVATION"
    assert "leaked" in str(raised.value)


def test_detach_through_the_cache_stops_storage_backups() -> None:
    cache, backend = storage_cache()
    assert cache.detach_storage_backend() is True
    assert cache.detach_storage_backend() is False
    cache.insert(RadixKey((1, 2)), cache.alloc(2))
    assert cache.writing_check() == 1
    assert cache.storage is not None and not cache.storage.attached
    assert len(backend) == 0
    cache.check_invariants()


def test_create_builds_pools_matching_its_arguments() -> None:
    from hiradix import HiRadixCache, KVShape

    cache = HiRadixCache.create(device_slots=32, page_size=4, host_ratio=1.5,
                                kv=KVShape(layers=3, layout="mla", latent_dim=6,
                                           dtype=torch.float32), eviction="lfu")
    assert cache.device_pool.num_slots == 32 and cache.host_pool.num_slots == 48
    assert cache.device_pool.token_shape == (6,) and cache.device_pool.layers == 3
    assert cache.page_size == 4 and cache.config.eviction == "lfu"
    by_bytes = HiRadixCache.create(device_slots=8, host_ratio=None,
                                   host_bytes=16 * cache_bytes_per_token())
    assert by_bytes.host_pool.num_slots == 16


def cache_bytes_per_token() -> int:
    from hiradix import KVShape

    shape = KVShape()  # defaults: 2 layers x K,V x 1 head x 8 dims x fp16
    return shape.layers * 2 * shape.heads * shape.head_dim * 2


def test_the_tiers_own_writing_check_writes_each_page_once_on_a_wired_cache() -> None:
    cache, _ = storage_cache()
    cache.insert(RadixKey((1, 2, 3, 4)), cache.alloc(4))
    assert cache.storage.writing_check() == 1
    assert cache.storage.metrics.write_pages_issued == 2


def test_a_release_must_release_a_lock_taken_at_that_node() -> None:
    """A lock taken at (1, 1) cannot be released at (1,) (spec/03 3.7; found by
    `hiradix explore`): NotLocked, and nothing changes."""
    cache = cache_with((1, 1), page_size=1, write_policy="write_back")
    cache.insert(RadixKey((1, 2)), cache.device_pool.alloc(2))
    upper = cache.match_prefix(RadixKey((1,))).last_device_node
    lower = cache.match_prefix(RadixKey((1, 1))).last_device_node
    assert upper is not lower and lower.parent is upper
    cache.inc_lock_ref(lower)
    before = snapshot(cache)
    with pytest.raises(NotLocked, match="no lock taken there"):
        cache.dec_lock_ref(upper)
    assert snapshot(cache) == before
    cache.dec_lock_ref(lower)
    cache.check_invariants()
