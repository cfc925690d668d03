"""Embed hiradix in a scheduler: the loop an engine runs around its forward passes.

One request at a time: match the longest cached prefix, load back what only the host
holds, allocate slots for the rest, run the model (here: write made-up KV), insert,
unlock, acknowledge copies. Then a storage tier (the file backend, in a temporary
directory) keeps the pages across a restart: a fresh cache prefetches them back.

Run it: ``python examples/embed.py`` (CPU is enough; pass ``--device cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from hiradix import FileBackend, HiRadixCache, KVShape, RadixKey, StorageTier, TierSettings

PAGE = 4
KV = KVShape(layers=2, heads=2, head_dim=8, dtype=torch.float32)
MODEL = "example-model-v1"  # names the KV in storage; another model never reads it
# Prefetch from one page on, and let a request wait until its prefetch has landed.
SETTINGS = TierSettings(prefetch_threshold=PAGE, prefetch_policy="wait_complete")


def make_cache(device: str) -> HiRadixCache:
    return HiRadixCache.create(device_slots=64, page_size=PAGE, host_ratio=2.0, kv=KV,
                               device=device, write_policy="write_through", eviction="lru",
                               load_back_threshold=PAGE)


def forward(cache: HiRadixCache, slots: torch.Tensor, tokens: list[int]) -> None:
    """Stands in for the model: KV derived from the token ids (0 past the end), written
    into ``slots``."""
    ids = torch.zeros(len(slots), dtype=KV.dtype)
    ids[:len(tokens)] = torch.tensor(tokens, dtype=KV.dtype)
    values = ids[None, :, None, None, None].expand(KV.layers, len(slots), 2, KV.heads,
                                                   KV.head_dim)
    cache.device_pool.write(slots, values.contiguous())


def serve(cache: HiRadixCache, tokens: list[int]) -> int:
    """One request through the cache; returns the tokens it did not have to compute."""
    key = RadixKey(tokens)
    match = cache.match_prefix(key)
    cached, node = match.device_slots, match.last_device_node
    if match.host_hit_length:  # pages only the host holds: copy them back to device
        loaded, node = cache.init_load_back(match.last_host_node)
        cached = torch.cat([cached, loaded])
    cache.inc_lock_ref(node)  # what the request reads must not be evicted under it
    need = -(len(tokens) - len(cached)) // PAGE * -PAGE  # whole pages
    fresh = cache.alloc(need)
    if fresh is None:  # no room: evict unlocked pages (they stay on host), then retry
        cache.evict(need)
        fresh = cache.alloc(need)
    assert fresh is not None, "the device pool is too small for this request"
    while cache.pending["h2d"]:  # the load back lands before the forward pass reads it
        cache.loading_check()  # (an engine overlaps it: engine.wait_layer per layer)
    forward(cache, fresh, tokens[len(cached):])
    slots = torch.cat([cached, fresh])
    already = cache.insert(key, slots[:len(tokens)])  # the partial tail page is not cached
    # The caller's own slots for pages that were cached meanwhile, and the tail page.
    cache.free(torch.cat([slots[len(cached):already], slots[len(tokens) // PAGE * PAGE:]]))
    cache.dec_lock_ref(node)
    cache.writing_check()  # host copies done; with storage attached, backs them up
    cache.check_invariants()  # cheap enough for tests; drop it in production
    return len(cached)


def main(device: str = "cpu") -> dict[str, int]:
    prompt = list(range(100, 124))  # 24 tokens: 6 pages
    figures: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root:
        cache = make_cache(device)
        assert cache.attach_storage_backend(FileBackend(root), MODEL, SETTINGS,
                                            threaded=True) == "attached"
        figures["first"] = serve(cache, [*prompt, 1, 2])
        figures["second"] = serve(cache, [*prompt, 3, 4, 5, 6])
        cache.evict(cache.evictable_size())  # everything to host: the next hit loads back
        figures["after_evict"] = serve(cache, prompt)
        drain_writes(cache)
        assert cache.storage is not None
        figures["pages_written"] = cache.storage.metrics.write_pages_issued
        cache.detach_storage_backend()

        # A restart: a new cache, empty on device and host, on the same directory.
        cache = make_cache(device)
        cache.attach_storage_backend(FileBackend(root), MODEL, SETTINGS)
        tier = cache.storage
        assert tier is not None
        key = RadixKey(prompt)
        figures["storage_hit"] = tier.query_storage_hit_length(key)
        tier.prefetch_from_storage("request-1", key)
        await_prefetch(tier, "request-1")
        figures["prefetched"] = tier.pop_prefetch_loaded_tokens("request-1")
        cache.check_invariants()  # counts the host slots the tier holds (spec/09 9.2)
        figures["after_restart"] = serve(cache, [*prompt, 7])
        kv = cache.device_pool.read(cache.match_prefix(key).device_slots)
        assert torch.equal(kv[0, :, 0, 0, 0], torch.tensor(prompt, dtype=KV.dtype)), \
            "the KV prefetched after the restart is not the KV written before it"
        tier.drain_storage_queues()
        cache.detach_storage_backend()
    return figures


def await_prefetch(tier: StorageTier, request: str, patience_s: float = 5.0) -> None:
    """Poll ``request``'s prefetch until the request need not wait, on every outcome
    (spec/09, 9.6): a revoked prefetch (too few hits) ends only when the drain takes it
    from the revoke queue, so the loop drains; under ``wait_complete`` a fetch that
    failed part way never completes, so past ``patience_s`` the loop terminates it and
    the next poll ends it with what landed."""
    deadline = time.monotonic() + patience_s
    while not tier.check_prefetch_progress(request):
        tier.drain_storage_queues()  # a scheduler drains once per loop (SGLang does)
        if time.monotonic() > deadline:
            tier.terminate_prefetch(request)  # any policy may end it now
        time.sleep(0.001)  # a scheduler would run other requests meanwhile


def drain_writes(cache: HiRadixCache, timeout_s: float = 10.0) -> None:
    """Wait until every backup to storage has been acknowledged and released."""
    tier = cache.storage
    assert tier is not None
    deadline = time.monotonic() + timeout_s
    while tier.state.writes:
        tier.drain_storage_queues()
        assert time.monotonic() < deadline, "storage writes did not finish"
        time.sleep(0.001)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    for name, value in main(parser.parse_args().device).items():
        print(f"{name}: {value}")
