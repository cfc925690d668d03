"""Keys and tree nodes: prefix matching by pages, and splitting that keeps counters."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from hiradix.keys import RadixKey, common_pages, pack
from hiradix.tree import TreeNode, split


def slow_common_pages(a: tuple[int, ...], b: tuple[int, ...], page_size: int) -> int:
    n = 0
    while n + page_size <= min(len(a), len(b)) and a[n:n + page_size] == b[n:n + page_size]:
        n += page_size
    return n


@given(st.lists(st.integers(0, 2), max_size=40).map(tuple),
       st.lists(st.integers(0, 2), max_size=40).map(tuple),
       st.integers(0, 10), st.sampled_from([1, 2, 4, 16]))
def test_common_pages_agrees_with_the_page_by_page_definition(
        segment: tuple[int, ...], key: tuple[int, ...], start: int, page_size: int) -> None:
    start = min(start, len(key))
    assert common_pages(pack(segment), pack(key), start, page_size) == slow_common_pages(
        segment, key[start:], page_size)
    stop = len(key) - 1
    if start <= stop:  # a bound short of the key's end
        assert common_pages(pack(segment), pack(key), start, page_size, stop) == \
            slow_common_pages(segment, key[start:stop], page_size)


def test_common_pages_on_a_long_shared_prefix() -> None:
    prompt = tuple(range(100_000))
    assert common_pages(pack(prompt), pack((*prompt, 1)), 0, 16) == 100_000 - 100_000 % 16
    assert common_pages(pack(prompt), pack((*prompt[:50_000], -1)), 0, 1) == 50_000
    # From an offset, the segment running past the key's end: only whole pages count.
    assert common_pages(pack(prompt[7:]), pack(prompt), 7, 4) == 99_992


def test_aligned_length_drops_the_partial_tail_page() -> None:
    assert RadixKey((1, 2, 3, 4, 5)).aligned_length(2) == 4
    assert RadixKey(()).aligned_length(4) == 0


def test_split_keeps_counters_and_the_lower_part_keeps_the_object() -> None:
    root = TreeNode(None, None, (), None)
    node = TreeNode(None, "ns", (1, 2, 3, 4), root, tick=5, priority=2)
    root.children[("ns", (1, 2))] = node
    node.device = torch.tensor([10, 11, 12, 13])
    node.host = torch.tensor([0, 1, 2, 3])
    node.lock_ref, node.host_ref, node.hits = 2, 1, 3
    upper = split(node, 2, page_size=2)
    assert root.children[("ns", (1, 2))] is upper and upper.children[("ns", (3, 4))] is node
    assert node.tokens == (3, 4) and upper.tokens == (1, 2)
    assert node.packed == pack((3, 4)) and upper.packed == pack((1, 2))
    assert upper.device.tolist() == [10, 11] and node.device.tolist() == [12, 13]
    assert upper.host.tolist() == [0, 1] and node.host.tolist() == [2, 3]
    for attribute in ("lock_ref", "host_ref", "hits", "last_tick", "insert_tick", "priority",
                      "namespace"):
        assert getattr(upper, attribute) == getattr(node, attribute)
    assert node.prefix() == (1, 2, 3, 4)
