"""Keys and tree nodes: prefix matching by pages, and splitting that keeps counters."""

from __future__ import annotations

import copy
import pickle
from array import array

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hiradix.errors import InvalidArgument
from hiradix.keys import RadixKey, common_pages, pack
from hiradix.tree import TreeNode, split


class IntSubclass(int):
    """An int subclass (an enum's value, say): a token id, though not an exact int."""


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
    root = TreeNode(None, None, b"", None)
    node = TreeNode(None, "ns", pack((1, 2, 3, 4)), root, tick=5, priority=2)
    root.children[("ns", pack((1, 2)))] = node
    node.device = torch.tensor([10, 11, 12, 13])
    node.host = torch.tensor([0, 1, 2, 3])
    node.lock_ref, node.host_ref, node.hits = 2, 1, 3
    upper = split(node, 2, page_size=2)
    assert root.children[("ns", pack((1, 2)))] is upper
    assert upper.children[("ns", pack((3, 4)))] is node
    assert node.tokens == (3, 4) and upper.tokens == (1, 2)
    assert (node.length, upper.length) == (2, 2)
    assert node.packed == pack((3, 4)) and upper.packed == pack((1, 2))
    assert upper.device.tolist() == [10, 11] and node.device.tolist() == [12, 13]
    assert upper.host.tolist() == [0, 1] and node.host.tolist() == [2, 3]
    for attribute in ("lock_ref", "host_ref", "hits", "last_tick", "insert_tick", "priority",
                      "namespace"):
        assert getattr(upper, attribute) == getattr(node, attribute)
    assert node.prefix() == (1, 2, 3, 4)


# -- building a key (issue 29): one packing pass, every input form the same key ------------

TOKEN_IDS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=64)


@given(TOKEN_IDS)
def test_the_c_packing_agrees_with_the_python_packing(tokens: list[int]) -> None:
    """``hiradix._tokens.pack`` is the fast path of the Python definition (``pack``)."""
    c_pack = pytest.importorskip("hiradix._tokens").pack
    assert c_pack(tokens) == c_pack(tuple(tokens)) == pack(tokens)


@pytest.mark.parametrize("tokens", [
    [True], [2**63], [-(2**63) - 1], [1.0], [numpy.int64(3)], ["1"], [IntSubclass(4)]])
def test_the_c_packing_refuses_what_is_not_an_exact_int64(tokens: list[object]) -> None:
    """None sends the key to its slow path, which names the item or accepts a subclass."""
    c_pack = pytest.importorskip("hiradix._tokens").pack
    assert c_pack(tokens) is None and c_pack(tuple(tokens)) is None


@given(TOKEN_IDS, st.none() | st.text(max_size=3))
def test_every_input_form_makes_the_same_key(tokens: list[int], namespace: str | None
                                             ) -> None:
    key = RadixKey(tuple(tokens), namespace)
    forms: list[object] = [tokens, array("q", tokens), numpy.array(tokens, dtype=numpy.int64),
                           torch.tensor(tokens, dtype=torch.int64), memoryview(array("q", tokens))]
    for form in forms:
        other = RadixKey(form, namespace)  # type: ignore[arg-type]
        assert other == key and hash(other) == hash(key) and len(other) == len(tokens)
        assert other.packed == key.packed == pack(tokens)
        assert other.tokens == tuple(tokens)
        assert all(type(t) is int for t in other.tokens)
        for start, end in ((0, 3), (2, 5), (len(tokens) - 1, len(tokens) + 4)):
            assert other.span(start, end) == tuple(tokens)[start:end]


def test_narrow_and_unsigned_buffers_widen_to_the_same_key() -> None:
    key = RadixKey((1, 2, 250))
    for form in (array("h", [1, 2, 250]), array("B", [1, 2, 250]), array("Q", [1, 2, 250]),
                 numpy.array([1, 2, 250], dtype=numpy.uint8), torch.tensor([1, 2, 250],
                                                                            dtype=torch.uint8)):
        assert RadixKey(form) == key  # type: ignore[arg-type]


@pytest.mark.parametrize(("tokens", "argument"), [
    (array("Q", [1, 2**63]), "tokens[1]"),
    (array("d", [1.0]), "tokens"),
    (numpy.zeros((2, 2), dtype=numpy.int64), "tokens"),
    (b"\x01\x02", "tokens"), (bytearray(b"\x01"), "tokens"), ("12", "tokens"),
    ([1, True], "tokens[1]"), ((1, 2**64), "tokens[1]"), ([1, "2"], "tokens[1]"),
])
def test_a_buffer_or_sequence_that_is_no_token_ids_is_refused_by_name(
        tokens: object, argument: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        RadixKey(tokens)  # type: ignore[arg-type]
    assert raised.value.argument == argument


def test_a_key_is_immutable_and_survives_pickle_and_copy() -> None:
    tokens = [5, 6, 7]
    key = RadixKey(tokens, "ns")
    tokens.append(8)  # the caller's list is not the key's
    assert key.tokens == (5, 6, 7)
    for name in ("tokens", "packed", "namespace", "length"):
        with pytest.raises(AttributeError):
            setattr(key, name, None)
    with pytest.raises(AttributeError):
        del key.namespace
    for other in (pickle.loads(pickle.dumps(key)), copy.deepcopy(key), copy.copy(key)):
        assert other == key and other.tokens == (5, 6, 7) and other.namespace == "ns"
    assert key != RadixKey((5, 6, 7)) and key != (5, 6, 7)


def test_a_key_shares_the_callers_ints_and_owns_no_list() -> None:
    """A tuple of exact ints is the key's ``tokens`` as given (immutable already); a
    list's ints are shared, not copied, so the tree's segments add no int objects; a
    subclass's items become plain ints."""
    as_tuple = (1000, 2000, 3000)
    assert RadixKey(as_tuple).tokens is as_tuple
    as_list = [1000, 2000, 3000]
    key = RadixKey(as_list)
    assert all(a is b for a, b in zip(key.tokens, as_list, strict=True))
    as_list[0] = 7
    assert key.tokens == (1000, 2000, 3000)
    assert all(type(t) is int for t in RadixKey((IntSubclass(1), 2, 3)).tokens)


def test_an_int64_buffer_or_cpu_tensor_is_borrowed_and_others_are_copied() -> None:
    """Issue 29: a contiguous int64 buffer is read in place (the key's bytes change with
    it, which is the caller's contract not to do), anything else is the key's own copy."""
    borrowed = [array("q", [1, 2, 3]), numpy.array([1, 2, 3], dtype=numpy.int64),
                torch.tensor([1, 2, 3], dtype=torch.int64)]
    for source in borrowed:
        key = RadixKey(source)  # type: ignore[arg-type]
        source[0] = 9
        assert key.span(0, 3) == (9, 2, 3), type(source)
    copied = [torch.tensor([1, 2, 3], dtype=torch.int32),
              torch.tensor([1, 0, 2, 0, 3, 0], dtype=torch.int64)[::2],
              numpy.array([1, 0, 2, 0, 3, 0], dtype=numpy.int64)[::2], [1, 2, 3]]
    for source in copied:
        key = RadixKey(source)  # type: ignore[arg-type]
        source[0] = 9
        assert key.tokens == (1, 2, 3), type(source)


def test_python_refuses_to_resize_an_array_a_key_borrows() -> None:
    tokens = array("q", [1, 2, 3])
    key = RadixKey(tokens)
    with pytest.raises(BufferError):
        tokens.append(4)
    assert key.packed_span(0, 3) == pack((1, 2, 3)) and type(key.packed_span(0, 3)) is bytes
    del key
    tokens.append(4)  # the view went with the key


def test_the_tree_keeps_its_own_copy_of_a_borrowed_keys_tokens() -> None:
    """A match and an insert through borrowed keys; the caller's array changes after
    (the key dropped): the cached tokens are still the inserted ones."""
    from hiradix.clock import ManualClock
    from hiradix.conformance.scenario import Scenario
    cache = Scenario(page_size=1).build(ManualClock(1), None)  # type: ignore[arg-type]
    tokens = array("q", [5, 6, 7, 8])
    slots = cache.device_pool.alloc(4)
    assert slots is not None
    assert cache.insert(RadixKey(tokens), slots) == 0
    tokens[1] = 0
    tokens.append(9)
    assert len(cache.match_prefix(RadixKey((5, 6, 7, 8))).device_slots) == 4
    assert len(cache.match_prefix(RadixKey(tokens)).device_slots) == 1
    assert len(cache.match_prefix(RadixKey(numpy.array([5, 6, 7, 1], dtype=numpy.int64))
                                  ).device_slots) == 3
    cache.check_invariants()
