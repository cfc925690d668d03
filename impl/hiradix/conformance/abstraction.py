"""The refinement mapping: a concrete cache as the model's abstract state (spec/06).

Node segments become pages keyed by their full prefix; a node's slot tensors are cut
into per-page tuples; every page of a node carries the node's counters. Slots allocated
but owned by no node are the callers' (``held``).

KV bytes cannot be decoded without a codebook, so the KV maps are abstracted *relative
to the model*: a slot whose bytes equal the pattern of the content the model expects
keeps that content; any other bytes become ``CORRUPT`` and the states differ. Slots
whose bytes are unobservable -- free slots and destinations of copies in flight -- take
the model's value.
"""

from __future__ import annotations

import torch

from hiradix.cache import HiRadixCache, PendingCopy
from hiradix.conformance.kv import patterns
from hiradix.tree import TreeNode
from hiradix_model import Key, Page, State, Transfer

CORRUPT = Key((-1,), "<corrupt>")


def page_keys(node: TreeNode, page_size: int) -> list[Key]:
    """The node's pages, root-most first."""
    prefix = node.prefix()
    start = len(prefix) - len(node.tokens)
    return [Key(prefix[:end], node.namespace)
            for end in range(start + page_size, len(prefix) + 1, page_size)]


def _pages(cache: HiRadixCache) -> dict[Key, Page]:
    ps = cache.page_size
    pages = {}
    for node in cache.nodes():
        device = None if node.device is None else node.device.tolist()
        host = None if node.host is None else node.host.tolist()
        for index, key in enumerate(page_keys(node, ps)):
            cut = slice(index * ps, (index + 1) * ps)
            pages[key] = Page(
                device=None if device is None else tuple(device[cut]),
                host=None if host is None else tuple(host[cut]),
                lock=node.lock_ref, host_protect=node.host_ref, hits=node.hits,
                last_tick=node.last_tick, insert_tick=node.insert_tick, priority=node.priority,
            )
    return pages


def _transfer(cache: HiRadixCache, copy: PendingCopy, direction: str) -> Transfer:
    covered = copy.nodes()
    assert covered is not None, "the checker reports a copy that lost its nodes"
    pages = [k for node in covered for k in page_keys(node, cache.page_size)]
    lock = page_keys(copy.lock_node, cache.page_size)[-1]
    return Transfer(direction, tuple(pages), tuple(copy.src.tolist()),  # type: ignore[arg-type]
                    tuple(copy.dst.tolist()), lock)


def decode_kv(read: torch.Tensor, expected: dict[int, Key], slots: list[int], layers: int,
              token_shape: tuple[int, ...], dtype: torch.dtype) -> dict[int, Key]:
    """``expected`` with every slot in ``slots`` checked against the bytes ``read``
    (``[layers, len(slots), *token_shape]``); a mismatch becomes ``CORRUPT``."""
    result = dict(expected)
    known = [s for s in slots if s in expected]
    if not known:
        return result
    want = patterns([expected[s] for s in known], layers, token_shape, dtype)
    index = torch.tensor([slots.index(s) for s in known], dtype=torch.int64)
    same = (read.cpu().index_select(1, index) == want).flatten(2).all(dim=2).all(dim=0)
    for slot, ok in zip(known, same.tolist(), strict=True):
        if not ok:
            result[slot] = CORRUPT
    return result


def abstract(cache: HiRadixCache, model: State) -> State:
    """The abstract state of ``cache``; ``model`` supplies the KV codebook only."""
    pages = _pages(cache)
    copies = sorted(((c.seq, c, d) for d, q in cache.pending.items() for c in q),
                    key=lambda item: item[0])
    pending = tuple(_transfer(cache, c, d) for _, c, d in copies)
    arriving = {"d2h": set(), "h2d": set()}  # type: dict[str, set[int]]
    for t in pending:
        arriving[t.direction].update(t.dst)
    device_pool, host_pool = cache.device_pool, cache.host_pool
    device_free = device_pool.free_slots()
    owned = {s for p in pages.values() for s in p.device or ()}
    held = frozenset(set(range(device_pool.num_slots)) - device_free - owned)
    visible_device = sorted((owned | held) - arriving["h2d"])
    visible_host = sorted({s for p in pages.values() for s in p.host or ()} - arriving["d2h"])
    layers, shape, dtype = device_pool.layers, device_pool.token_shape, device_pool.dtype
    device_read = device_pool.read(torch.tensor(visible_device, dtype=torch.int64))
    host_read = host_pool.read(torch.tensor(visible_host, dtype=torch.int64))
    return State(
        config=model.config,
        pages=pages,
        device_free=device_free,
        host_free=host_pool.free_slots(),
        held=held,
        device_kv=decode_kv(device_read, dict(model.device_kv), visible_device, layers, shape,
                            dtype),
        host_kv=decode_kv(host_read, dict(model.host_kv), visible_host, layers, shape, dtype),
        pending=pending,
        clock=cache.last_tick,
        evictable_tokens=cache.evictable_tokens,
        protected_tokens=cache.protected_tokens,
    )
