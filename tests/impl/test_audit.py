"""The audit of issue 12 as a table: every bad input raises a typed error naming the
argument and leaves the state as it was (tree, locks, both free lists, the storage
attachment), or is handled correctly.

Rows for the storage tier's own methods (``backup_pages``, ``accept``, ``TierSettings``,
re-attach, the file backend, storage config files) live with the tier's tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from hiradix import (
    CacheConfig,
    ConfigError,
    HiRadixCache,
    InvalidArgument,
    KVShape,
    MemoryBackend,
    RadixKey,
    SlotError,
    StorageArgumentError,
    TreeNode,
)

PAGE = 2


@dataclass
class World:
    cache: HiRadixCache
    host_only: TreeNode  # a node whose KV only the host holds
    on_device: TreeNode
    held: torch.Tensor  # one page of device slots the caller holds


def world() -> World:
    cache = HiRadixCache.create(device_slots=16, page_size=PAGE, write_policy="write_back",
                                load_back_threshold=0)
    for tokens in ((1, 2, 3, 4), (1, 2, 5, 6)):  # the second shares the first page
        match = cache.match_prefix(RadixKey(tokens))
        fresh = cache.alloc(len(tokens) - len(match.device_slots))
        assert fresh is not None
        cache.insert(RadixKey(tokens), torch.cat([match.device_slots, fresh]))
    assert cache.evict(PAGE) == PAGE  # write_back: the oldest leaf page moves to host
    host_only = next(n for n in cache.nodes() if n.device is None)
    on_device = next(n for n in cache.nodes() if n.device is not None and not n.children)
    held = cache.alloc(PAGE)
    assert held is not None
    cache.check_invariants()
    return World(cache, host_only, on_device, held)


def state(w: World) -> tuple[object, ...]:
    """Everything a failed call must leave alone."""
    cache = w.cache
    return (cache.dump(), sorted(cache.device_pool.free_slots()),
            sorted(cache.host_pool.free_slots()), [(n.lock_ref, n.host_ref)
                                                   for n in cache.nodes()],
            cache.evictable_size(), cache.protected_size(), cache.storage, cache.on_reset,
            cache.on_write_back)


META = torch.zeros(PAGE, dtype=torch.int64, device="meta")
Row = tuple[str, Callable[[World], object], type[Exception], str]

CACHE_ROWS: list[Row] = [
    # bool is an int to isinstance; never a count, priority or flag here
    ("evict(True)", lambda w: w.cache.evict(True), InvalidArgument, "num_tokens"),
    ("evict_host(True)", lambda w: w.cache.evict_host(True), InvalidArgument, "num_tokens"),
    ("evict(1.5)", lambda w: w.cache.evict(1.5), InvalidArgument, "num_tokens"),
    ("insert priority=True", lambda w: w.cache.insert(RadixKey((7, 8)), w.held,
                                                      priority=True),
     InvalidArgument, "priority"),
    ("insert chunked='no'", lambda w: w.cache.insert(RadixKey((7, 8)), w.held, chunked="no"),
     InvalidArgument, "chunked"),
    ("load_back mem_quota=True", lambda w: w.cache.load_back(w.host_only, mem_quota=True),
     InvalidArgument, "mem_quota"),
    ("init_load_back mem_quota=True",
     lambda w: w.cache.init_load_back(w.on_device, mem_quota=True), InvalidArgument,
     "mem_quota"),
    ("load_back mem_quota=-1", lambda w: w.cache.load_back(w.host_only, mem_quota=-1),
     InvalidArgument, "mem_quota"),
    ("alloc(True)", lambda w: w.cache.alloc(True), SlotError, "num_tokens"),
    # slots on a device that holds no values
    ("insert meta slots", lambda w: w.cache.insert(RadixKey((7, 8)), META), InvalidArgument,
     "slots"),
    ("free meta slots", lambda w: w.cache.free(META), InvalidArgument, "slots"),
    # free: only caller-held whole pages
    ("free the tree's slots", lambda w: w.cache.free(w.on_device.device), InvalidArgument,
     "slots"),
    ("free held + tree slots", lambda w: w.cache.free(torch.cat([w.held, w.on_device.device])),
     InvalidArgument, "slots"),
    ("free out of range", lambda w: w.cache.free(torch.tensor([16, 17])), InvalidArgument,
     "slots"),
    ("free negative", lambda w: w.cache.free(torch.tensor([-2, -1])), InvalidArgument, "slots"),
    ("free int32", lambda w: w.cache.free(w.held.int()), InvalidArgument, "slots"),
    ("free a list", lambda w: w.cache.free([0, 1]), InvalidArgument, "slots"),
    ("free half a page", lambda w: w.cache.free(w.held[:1]), SlotError, "slots"),
    ("free twice in one call", lambda w: w.cache.free(torch.cat([w.held, w.held])), SlotError,
     "slots"),
    ("free a free page", lambda w: w.cache.free(torch.tensor([14, 15])), SlotError, "slots"),
    # keys
    ("match a tuple", lambda w: w.cache.match_prefix((1, 2)), InvalidArgument, "key"),
    # storage through the cache: a failed attach leaves no tier and no hooks behind
    ("attach a non-backend", lambda w: w.cache.attach_storage_backend("disk", "m"),
     StorageArgumentError, "backend"),
    ("attach without identity",
     lambda w: w.cache.attach_storage_backend(MemoryBackend(), ""), StorageArgumentError,
     "model_identity"),
    ("attach threaded='yes'",
     lambda w: w.cache.attach_storage_backend(MemoryBackend(), "m", threaded="yes"),
     StorageArgumentError, "threaded"),
]


@pytest.mark.parametrize(("name", "call", "error", "argument"), CACHE_ROWS,
                         ids=[row[0] for row in CACHE_ROWS])
def test_bad_input_is_typed_and_changes_nothing(name: str, call: Callable[[World], object],
                                                error: type[Exception], argument: str) -> None:
    w = world()
    before = state(w)
    with pytest.raises(error) as raised:
        call(w)
    assert isinstance(raised.value, InvalidArgument)
    assert raised.value.argument == argument, name
    assert state(w) == before, name
    w.cache.check_invariants()


KEY_ROWS: list[tuple[object, object, str]] = [
    (None, None, "tokens"),
    ("abc", None, "tokens"),
    (b"ab", None, "tokens"),
    (12, None, "tokens"),
    ({1, 2}, None, "tokens"),
    ((1, 2.0), None, "tokens[1]"),
    ((float("nan"),), None, "tokens[0]"),
    ((True, 2), None, "tokens[0]"),
    ([1, None], None, "tokens[1]"),
    (("1",), None, "tokens[0]"),
    ((2**63,), None, "tokens[0]"),
    ([-(2**63) - 1], None, "tokens[0]"),
    (range(2**63, 2**63 + 2), None, "tokens"),
    (torch.tensor([1.0, 2.0]), None, "tokens"),
    (torch.tensor([True]), None, "tokens"),
    (torch.zeros(2, 2, dtype=torch.int64), None, "tokens"),
    (torch.zeros(2, dtype=torch.int64, device="meta"), None, "tokens"),
    ([torch.tensor(1.5)], None, "tokens[0]"),
    ((1, torch.tensor([2, 3])), None, "tokens[1]"),
    ((1, 2), 3, "namespace"),
    ((1, 2), b"ns", "namespace"),
    ((1, 2), ("ns",), "namespace"),
]


@pytest.mark.parametrize(("tokens", "namespace", "argument"), KEY_ROWS,
                         ids=[f"{row[2]}-{i}" for i, row in enumerate(KEY_ROWS)])
def test_radix_key_rejects_what_is_not_token_ids(tokens: object, namespace: object,
                                                 argument: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        RadixKey(tokens, namespace)  # type: ignore[arg-type]
    assert raised.value.argument == argument


@pytest.mark.parametrize("tokens", [
    (5, 6, 7, 8), [5, 6, 7, 8], range(5, 9), torch.tensor([5, 6, 7, 8]),
    torch.tensor([5, 6, 7, 8], dtype=torch.int32), [torch.tensor(5), 6, 7, 8],
])
def test_radix_key_accepts_token_sequences_as_one_tuple_of_ints(tokens: object) -> None:
    """A list or tensor key used to crash (unhashable) or break check_invariants."""
    key = RadixKey(tokens, "ns")  # type: ignore[arg-type]
    assert key == RadixKey((5, 6, 7, 8), "ns")
    assert type(key.tokens) is tuple and all(type(t) is int for t in key.tokens)
    w = world()
    slots = w.cache.alloc(4)
    assert slots is not None
    w.cache.insert(key, slots)
    assert len(w.cache.match_prefix(RadixKey((5, 6, 7, 8), "ns")).device_slots) == 4
    w.cache.check_invariants()


def test_free_gives_back_caller_slots_only() -> None:
    """issue 12: freeing a matched node's slots was accepted, and the next alloc handed
    out the tree's own slots."""
    w = world()
    free_before = w.cache.device_pool.num_free_slots
    w.cache.free(w.held)
    assert w.cache.device_pool.num_free_slots == free_before + PAGE
    again = w.cache.alloc(PAGE)
    assert again is not None and torch.equal(again, w.held)
    w.cache.check_invariants()


CONFIG_ROWS: list[tuple[dict[str, object], str]] = [
    ({"device_slots": True}, "device_slots"),
    ({"device_slots": 0}, "device_slots"),
    ({"device_slots": 15, "page_size": 2}, "device_slots"),
    ({"device_slots": 16.0}, "device_slots"),
    ({"page_size": True}, "page_size"),
    ({"page_size": 0}, "page_size"),
    ({"host_ratio": True}, "host_ratio"),
    ({"host_ratio": float("nan")}, "host_ratio"),
    ({"host_ratio": 0.01}, "host_ratio"),
    ({"host_ratio": None}, "host_ratio/host_bytes"),
    ({"host_bytes": 4096}, "host_ratio/host_bytes"),
    ({"kv": "mha"}, "kv"),
    ({"kv": {"layers": 2}}, "kv"),
    ({"device": "meta"}, "device"),
    ({"device": "tpu"}, "device"),
    ({"write_policy": "write_around"}, "write_policy"),
    ({"eviction": "random"}, "eviction"),
    ({"load_back_threshold": True}, "load_back_threshold"),
    ({"host_layout": "row_major"}, "host_layout"),
    ({"transfer": "dma"}, "transfer"),
]


@pytest.mark.parametrize(("changes", "argument"), CONFIG_ROWS,
                         ids=[f"{row[1]}-{i}" for i, row in enumerate(CONFIG_ROWS)])
def test_create_names_the_bad_argument(changes: dict[str, object], argument: str) -> None:
    arguments: dict[str, object] = {"device_slots": 16, "page_size": 2, **changes}
    with pytest.raises(ConfigError) as raised:
        HiRadixCache.create(**arguments)  # type: ignore[arg-type]
    assert raised.value.argument == argument


@pytest.mark.parametrize(("make", "argument"), [
    (lambda: KVShape(layers=True), "kv.layers"),
    (lambda: KVShape(heads=0), "kv.heads"),
    (lambda: KVShape(layout="gqa"), "kv.layout"),
    (lambda: KVShape(dtype=torch.int8), "kv.dtype"),
    (lambda: CacheConfig(page_size=True), "page_size"),
    (lambda: CacheConfig(load_back_threshold=False), "load_back_threshold"),
])
def test_configuration_objects_reject_bools_and_bad_values(make: Callable[[], object],
                                                           argument: str) -> None:
    with pytest.raises(ConfigError) as raised:
        make()
    assert raised.value.argument == argument
