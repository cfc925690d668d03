"""The C loops of ``hiradix._pagebits`` against the torch ops they stand in for (issue 13).

Every test builds the same object twice, once per core (``HIRADIX_CORE``), drives both
with the same calls and compares their whole state after each: results, counts, free
stack, flags, bytes. The failure paths are checked to leave both unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from hiradix import _slots
from hiradix._slots import PageAllocator, SlotMarks
from hiradix.device_pool import DeviceKVPool, KVLayout
from hiradix.errors import ConfigError
from hiradix.host_pool import HostKVPool

T = TypeVar("T")
BUILT = _slots._pagebits is not None
needs_native = pytest.mark.skipif(not BUILT, reason="hiradix._pagebits is not built here "
                                                    "(no C compiler at install)")


def on_core(monkeypatch: pytest.MonkeyPatch, core: str, build: Callable[[], T]) -> T:
    monkeypatch.setenv(_slots.CORE_VARIABLE, core)
    try:
        return build()
    finally:
        monkeypatch.delenv(_slots.CORE_VARIABLE)


def state(allocator: PageAllocator) -> tuple[list[int], list[int], int]:
    return (allocator._held.tolist(), allocator._stack[allocator._top:].tolist(),
            allocator._top)


def test_the_core_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_slots.CORE_VARIABLE, "fast")
    with pytest.raises(ConfigError, match="HIRADIX_CORE: must be 'native' or 'python'"):
        PageAllocator(8, 1)
    monkeypatch.setenv(_slots.CORE_VARIABLE, "python")
    assert PageAllocator(8, 1).core == "python"
    monkeypatch.setenv(_slots.CORE_VARIABLE, "native")
    if BUILT:
        assert PageAllocator(8, 1).core == "native"
    else:
        with pytest.raises(ConfigError, match="not built"):
            PageAllocator(8, 1)
    monkeypatch.delenv(_slots.CORE_VARIABLE)
    assert PageAllocator(8, 1).core == ("native" if BUILT else "python")


def marked(marks: SlotMarks) -> list[int]:
    return marks.tensor.nonzero().view(-1).tolist()


@needs_native
@pytest.mark.parametrize("page_size", [1, 4])
def test_allocators_agree_over_random_calls(monkeypatch: pytest.MonkeyPatch,
                                            page_size: int) -> None:
    slots_count = 64 * page_size

    def build() -> tuple[PageAllocator, SlotMarks]:
        return PageAllocator(slots_count, page_size), SlotMarks(slots_count)

    native, native_marks = on_core(monkeypatch, "native", build)
    python, python_marks = on_core(monkeypatch, "python", build)
    assert (native.core, python.core) == ("native", "python")
    rng = random.Random(0)
    held: list[torch.Tensor] = []  # runs both hold, in the same order

    def both() -> tuple[object, ...]:
        return state(native), state(python), marked(native_marks), marked(python_marks)

    for _ in range(600):
        action = rng.randrange(5)
        if action == 0 or not held:
            tokens = rng.randrange(0, 12) * page_size
            got = [native.alloc(tokens), python.alloc(tokens)]
            assert (got[0] is None) == (got[1] is None)
            if got[0] is not None and got[1] is not None:
                assert torch.equal(got[0], got[1])
                if got[0].numel():
                    held.append(got[0])
                    native_marks.set(got[0], True)
                    python_marks.set(got[1], True)
        elif action == 1:  # release a mix of runs, some as strided views
            rng.shuffle(held)
            taken = [held.pop() for _ in range(rng.randrange(1, len(held) + 1))]
            run = torch.cat(taken)
            native.release(run)
            python.release(run.clone())
            native_marks.set(run, False)
            python_marks.set(run, False)
        elif action == 2:  # held_once on held heads, on a repeat, on a free page
            heads = torch.cat(held)[::page_size]
            for probe in (heads, torch.cat([heads, heads[:1]]), heads[::2]):
                assert native.held_once(probe) == python.held_once(probe)
        elif action == 3:  # several runs as parts, their flags cleared in the same call
            rng.shuffle(held)
            taken = [held.pop() for _ in range(rng.randrange(1, len(held) + 1))]
            unmark = rng.randrange(2)
            native.release_parts(taken, native_marks if unmark else None)
            python.release_parts([t.clone() for t in taken], python_marks if unmark else None)
            if not unmark:
                for part in taken:
                    native_marks.set(part, False)
                    python_marks.set(part, False)
        else:  # a release that must fail changes neither
            run = torch.cat(held)
            bad = [[torch.cat([run, run[:page_size]])],  # a page twice in one part
                   [run[page_size // 2:page_size // 2 + page_size]]]  # not a page's start
            if run.numel() >= 2 * page_size:
                # A page twice across two parts, or a free page after held ones, with no
                # more pages than are held (more fail on the count before any page is
                # looked at); the first part's pages must be put back.
                bad.append([run[:-page_size], run[:page_size]])
                if native.num_free_slots:
                    bad.append([run[:-page_size], native._stack[native._top:native._top + 1]])
            for wrong in bad:
                if page_size == 1 and len(wrong) == 1 and wrong[0].numel() == 1 and \
                        native.held_once(wrong[0]):
                    continue  # at page size 1 every slot starts a page
                before = both()
                with pytest.raises(AssertionError):
                    native.release_parts(wrong, native_marks)
                with pytest.raises(AssertionError):
                    python.release_parts(wrong, python_marks)
                assert both() == before
        assert state(native) == state(python)
        assert marked(native_marks) == marked(python_marks)


@needs_native
@pytest.mark.parametrize("core", ["native", "python"])
def test_a_release_out_of_range_fails_and_changes_nothing(monkeypatch: pytest.MonkeyPatch,
                                                           core: str) -> None:
    allocator = on_core(monkeypatch, core, lambda: PageAllocator(16, 4))
    run = allocator.alloc(8)
    assert run is not None
    before = state(allocator)
    with pytest.raises((AssertionError, IndexError)):
        allocator.release(torch.cat([run, torch.arange(16, 20)]))
    assert state(allocator) == before
    # A page's head in range and its last slot not: only the flags read it.
    marks = on_core(monkeypatch, core, lambda: SlotMarks(16))
    marks.set(run, True)
    tail = torch.tensor([4, 5, 6, 99], dtype=torch.int64)
    with pytest.raises(AssertionError, match="out of range"):
        allocator.release_parts([run[:4], tail], marks)
    assert state(allocator) == before and marked(marks) == list(range(8))


@needs_native
def test_slot_marks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    native = on_core(monkeypatch, "native", lambda: SlotMarks(40))
    python = on_core(monkeypatch, "python", lambda: SlotMarks(40))
    rng = random.Random(1)
    for _ in range(300):
        chosen = torch.tensor(rng.sample(range(40), rng.randrange(0, 10)), dtype=torch.int64)
        view = torch.stack([chosen, chosen]).t().reshape(-1)[::2]  # strided, same ids
        if rng.randrange(2):
            value = bool(rng.randrange(2))
            native.set(view, value)
            python.set(chosen, value)
        assert native.any(view) == python.any(chosen)
        assert torch.equal(native.tensor, python.tensor)
    outside = torch.tensor([3, 40], dtype=torch.int64)
    assert native.any(outside) is None and python.any(outside) is None
    before = native.tensor.clone()
    with pytest.raises(AssertionError, match="out of range"):
        native.set(outside, True)
    assert torch.equal(native.tensor, before)


@needs_native
@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_row_copies_agree(monkeypatch: pytest.MonkeyPatch, layout: KVLayout) -> None:
    def pools() -> tuple[DeviceKVPool, HostKVPool]:
        device = DeviceKVPool(num_slots=32, page_size=2, layers=3, layout=layout, heads=2,
                              head_dim=3, latent_dim=5, dtype=torch.float16)
        device.kv.copy_(torch.randn(device.kv.shape, generator=torch.Generator().manual_seed(2)))
        return device, HostKVPool(device, num_slots=48)

    native, python = on_core(monkeypatch, "native", pools), on_core(monkeypatch, "python", pools)
    assert native[1]._row_plan(native[0]).bits is not None  # type: ignore[union-attr]
    assert python[1]._row_plan(python[0]).bits is None  # type: ignore[union-attr]
    source = torch.tensor([7, 3, 30, 31, 0, 12], dtype=torch.int64)
    spread = torch.arange(0, 48, 1, dtype=torch.int64)[[40, 2, 5, 46, 9, 11]]
    strided = torch.stack([spread, spread]).t().reshape(-1)[::2]  # stride 2, same ids
    for (device, host), host_slots in ((native, strided), (python, spread)):
        host.copy_from_device_unchecked(device, source, host_slots)
    assert torch.equal(native[1].kv, python[1].kv)
    assert bool(native[1].kv.any())
    back = torch.tensor([1, 2, 20, 21, 25, 26], dtype=torch.int64)
    for (device, host), host_slots in ((native, strided), (python, spread)):
        host.copy_to_device_unchecked(device, host_slots, back)
    assert torch.equal(native[0].kv, python[0].kv)
    kept = native[1].kv.clone()
    with pytest.raises(AssertionError, match="out of range"):
        native[1].copy_from_device_unchecked(native[0], source, torch.tensor(
            [0, 1, 2, 3, 4, 48], dtype=torch.int64))
    assert torch.equal(native[1].kv, kept)  # nothing copied
