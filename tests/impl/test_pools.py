"""The page allocator and the two KV pools: allocation, validation, layouts, bytes."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hiradix._slots import PageAllocator, SlotError
from hiradix.device_pool import DeviceKVPool, KVLayout
from hiradix.host_pool import HostKVPool, HostLayout

PAGE_SIZES = (1, 2, 4, 16)
KV_LAYOUTS: tuple[KVLayout, ...] = ("mha", "mla")
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first")


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def page_slots(*pages: int, size: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])


def pattern(pool: DeviceKVPool | HostKVPool, which: torch.Tensor, salt: int = 0
            ) -> torch.Tensor:
    """Values that are a function of (salt, layer, slot, element): unique per element and
    exact in float32 for the small pools used here."""
    elements = math.prod(pool.token_shape)
    layer = torch.arange(pool.layers).reshape(-1, 1, 1)
    element = torch.arange(elements).reshape(1, 1, -1)
    slot = which.reshape(1, -1, 1)
    flat = ((salt * pool.layers + layer) * 4096 + slot) * elements + element
    return flat.reshape(pool.value_shape(which.numel())).to(pool.dtype)


def device_pool(page_size: int = 4, layout: KVLayout = "mha", num_slots: int | None = None,
                dtype: torch.dtype = torch.float32) -> DeviceKVPool:
    return DeviceKVPool(num_slots=num_slots or 8 * page_size, page_size=page_size, layers=3,
                        layout=layout, heads=2, head_dim=3, latent_dim=5, dtype=dtype)


# -- PageAllocator ---------------------------------------------------------------------


def test_alloc_hands_out_whole_pages_in_order() -> None:
    allocator = PageAllocator(16, 4)
    first = allocator.alloc(8)
    assert first is not None and first.dtype == torch.int64 and first.device.type == "cpu"
    assert first.tolist() == list(range(8))
    second = allocator.alloc(4)
    assert second is not None and second.tolist() == [8, 9, 10, 11]
    assert allocator.num_free_slots == 4
    assert allocator.free_slots() == frozenset(range(12, 16))
    assert allocator.is_allocated(0) and allocator.is_allocated(11)
    assert not allocator.is_allocated(12)


def test_alloc_zero_tokens_is_empty() -> None:
    allocator = PageAllocator(8, 2)
    empty = allocator.alloc(0)
    assert empty is not None and empty.numel() == 0 and empty.dtype == torch.int64
    assert allocator.num_free_slots == 8


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_free_round_trip_and_lifo_reuse(page_size: int) -> None:
    allocator = PageAllocator(4 * page_size, page_size)
    held = allocator.alloc(4 * page_size)
    assert held is not None and allocator.num_free_slots == 0
    allocator.free(page_slots(2, 0, size=page_size))
    assert allocator.free_slots() == frozenset(page_slots(0, 2, size=page_size).tolist())
    again = allocator.alloc(2 * page_size)
    assert again is not None and again.tolist() == page_slots(2, 0, size=page_size).tolist()
    allocator.free(held)
    assert allocator.num_free_slots == 4 * page_size


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    allocator = PageAllocator(8, 2)
    assert allocator.alloc(6) is not None
    before = allocator.free_slots()
    assert allocator.alloc(4) is None
    assert allocator.free_slots() == before and allocator.num_free_slots == 2
    assert allocator.alloc(2) is not None
    assert allocator.alloc(2) is None


def test_reset_frees_everything_and_restarts_from_page_zero() -> None:
    allocator = PageAllocator(8, 2)
    allocator.alloc(6)
    allocator.reset()
    assert allocator.free_slots() == frozenset(range(8))
    fresh = allocator.alloc(2)
    assert fresh is not None and fresh.tolist() == [0, 1]


@pytest.mark.parametrize(("num_slots", "page_size", "argument"), [
    (0, 1, "num_slots"), (-4, 2, "num_slots"), (6, 4, "num_slots"), (8, 0, "page_size"),
    (8.0, 2, "num_slots"), (8, True, "page_size"),
])
def test_allocator_rejects_bad_geometry(num_slots: object, page_size: object,
                                        argument: str) -> None:
    with pytest.raises(SlotError) as raised:
        PageAllocator(num_slots, page_size)  # type: ignore[arg-type]
    assert raised.value.argument == argument


@pytest.mark.parametrize("num_tokens", [-2, 3, 2.0, True, "2"])
def test_alloc_rejects_bad_counts(num_tokens: object) -> None:
    allocator = PageAllocator(8, 2)
    allocator.alloc(2)
    before = allocator.free_slots()
    with pytest.raises(SlotError) as raised:
        allocator.alloc(num_tokens)  # type: ignore[arg-type]
    assert raised.value.argument == "num_tokens"
    assert allocator.free_slots() == before


BAD_FREES: list[tuple[str, object]] = [
    ("list", [0, 1, 2, 3]),
    ("float dtype", torch.tensor([0.0, 1.0, 2.0, 3.0])),
    ("int32", torch.arange(4, dtype=torch.int32)),
    ("2-D", torch.arange(4, dtype=torch.int64).reshape(1, 4)),
    ("partial page", slots(0, 1)),
    ("unaligned group", slots(1, 2, 3, 4)),
    ("page out of order", slots(1, 0, 2, 3)),
    ("slots of two pages", slots(0, 1, 6, 7)),
    ("out of range", slots(16, 17, 18, 19)),
    ("negative", slots(-4, -3, -2, -1)),
    ("never allocated", slots(12, 13, 14, 15)),
    ("same page twice", slots(0, 1, 2, 3, 0, 1, 2, 3)),
    ("good page then bad page", slots(0, 1, 2, 3, 12, 13, 14, 15)),
]


@pytest.mark.parametrize(("case", "argument"), BAD_FREES, ids=[c for c, _ in BAD_FREES])
def test_free_rejects_misuse_and_changes_nothing(case: str, argument: object) -> None:
    allocator = PageAllocator(16, 4)
    held = allocator.alloc(8)
    assert held is not None
    before = allocator.free_slots()
    with pytest.raises(SlotError) as raised:
        allocator.free(argument)  # type: ignore[arg-type]
    assert raised.value.argument == "slots", case
    assert allocator.free_slots() == before and allocator.num_free_slots == 8
    assert all(allocator.is_allocated(s) for s in range(8))


def test_double_free_across_calls_is_rejected() -> None:
    allocator = PageAllocator(8, 2)
    held = allocator.alloc(4)
    assert held is not None
    allocator.free(held[:2])
    before = allocator.free_slots()
    with pytest.raises(SlotError, match="not allocated"):
        allocator.free(held[:2])
    assert allocator.free_slots() == before


def test_wrong_type_message_names_the_argument() -> None:
    with pytest.raises(SlotError, match=r"^slots: must be a 1-D torch.int64 tensor, got"):
        PageAllocator(4, 1).free(torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("slot", [-1, 8, 1.0])
def test_is_allocated_rejects_foreign_slots(slot: object) -> None:
    with pytest.raises(SlotError) as raised:
        PageAllocator(8, 2).is_allocated(slot)  # type: ignore[arg-type]
    assert raised.value.argument == "slot"


@given(
    page_size=st.sampled_from(PAGE_SIZES),
    pages=st.integers(1, 12),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.randoms(use_true_random=False)),
                 max_size=30),
)
def test_random_alloc_free_conserves_slots(page_size: int, pages: int,
                                           ops: list[tuple[bool, int, random.Random]]) -> None:
    allocator = PageAllocator(pages * page_size, page_size)
    held: list[int] = []  # allocated page ids
    every = frozenset(range(pages * page_size))
    for is_alloc, amount, rng in ops:
        if is_alloc:
            got = allocator.alloc(amount * page_size)
            if amount > pages - len(held):
                assert got is None
            else:
                assert got is not None and got.numel() == amount * page_size
                held.extend((got[::page_size] // page_size).tolist())
        elif held:
            chosen = rng.sample(held, min(amount, len(held)))
            allocator.free(page_slots(*chosen, size=page_size) if chosen
                           else torch.empty(0, dtype=torch.int64))
            held = [p for p in held if p not in chosen]
        allocated = [s for p in held for s in range(p * page_size, (p + 1) * page_size)]
        free = allocator.free_slots()
        assert len(allocated) == len(set(allocated)), "a slot allocated twice"
        assert free.isdisjoint(allocated) and free | set(allocated) == every
        assert allocator.num_free_slots == len(free)
        assert all(allocator.is_allocated(s) for s in allocated)


# -- DeviceKVPool ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_device_pool_mha_shapes(dtype: torch.dtype) -> None:
    pool = DeviceKVPool(num_slots=8, page_size=2, layers=3, heads=2, head_dim=4, dtype=dtype)
    assert pool.kv.shape == (3, 2, 8, 2, 4) and pool.kv.dtype == dtype
    assert bool((pool.kv == 0).all()) and pool.device == torch.device("cpu")
    assert pool.token_shape == (2, 2, 4)
    assert pool.bytes_per_token == 3 * 2 * 2 * 4 * pool.kv.element_size()
    assert pool.layer_view(1).shape == (2, 8, 2, 4)
    assert pool.num_slots == 8 and pool.page_size == 2 and pool.num_free_slots == 8


def test_device_pool_mla_shapes() -> None:
    pool = DeviceKVPool(num_slots=8, page_size=4, layers=2, layout="mla", latent_dim=6)
    assert pool.kv.shape == (2, 8, 6) and pool.kv.dtype == torch.float16
    assert pool.token_shape == (6,)
    assert pool.bytes_per_token == 2 * 6 * 2
    assert pool.layer_view(0).shape == (8, 6)


@pytest.mark.parametrize(("overrides", "argument"), [
    ({"num_slots": 6}, "num_slots"), ({"page_size": 0}, "page_size"),
    ({"layers": 0}, "layers"), ({"layout": "gqa"}, "layout"), ({"heads": 0}, "heads"),
    ({"head_dim": -1}, "head_dim"), ({"latent_dim": 0}, "latent_dim"),
    ({"dtype": torch.int64}, "dtype"), ({"dtype": "float16"}, "dtype"),
    ({"device": "nonsense"}, "device"), ({"device": "meta"}, "device"), ({"device": 3}, "device"),
])
def test_device_pool_rejects_bad_arguments(overrides: dict[str, object], argument: str) -> None:
    arguments: dict[str, object] = {"num_slots": 8, "page_size": 4, "layers": 2}
    arguments.update(overrides)
    with pytest.raises(SlotError) as raised:
        DeviceKVPool(**arguments)  # type: ignore[arg-type]
    assert raised.value.argument == argument


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_device_pool_rejects_cuda_without_cuda() -> None:
    with pytest.raises(SlotError, match="CUDA is not available") as raised:
        DeviceKVPool(num_slots=4, page_size=1, layers=1, device="cuda")
    assert raised.value.argument == "device"


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_device_write_read_round_trip(layout: KVLayout, page_size: int) -> None:
    pool = device_pool(page_size, layout)
    held = pool.alloc(3 * page_size)
    assert held is not None
    shuffled = held.flip(0)
    values = pattern(pool, shuffled)
    pool.write(shuffled, values)
    assert torch.equal(pool.read(shuffled), values)
    assert torch.equal(pool.read(held), values.flip(1))
    view = pool.layer_view(2)
    slot = int(held[0])
    expected = values[2, -1]
    stored = view[:, slot] if layout == "mha" else view[slot]
    assert torch.equal(stored, expected)
    untouched = pool.alloc(page_size)
    assert untouched is not None and bool((pool.read(untouched) == 0).all())


def test_device_write_rejects_bad_values_and_slots() -> None:
    pool = device_pool(2)
    held = pool.alloc(4)
    assert held is not None
    before = pool.kv.clone()
    good = pattern(pool, held)
    cases: list[tuple[object, object, str]] = [
        (held, good.to(torch.float16), "values"),
        (held, good[:, :3], "values"),
        (held, good.tolist(), "values"),
        (slots(0, 1, 1, 2), good, "slots"),
        (slots(0, 1, 2, 16), good, "slots"),
        (held.to(torch.int32), good, "slots"),
    ]
    for which, values, argument in cases:
        with pytest.raises(SlotError) as raised:
            pool.write(which, values)  # type: ignore[arg-type]
        assert raised.value.argument == argument
        assert torch.equal(pool.kv, before)
    with pytest.raises(SlotError):
        pool.read(slots(-1))
    with pytest.raises(SlotError) as raised:
        pool.layer_view(3)
    assert raised.value.argument == "layer"


def test_device_pool_delegates_allocation() -> None:
    pool = device_pool(4, num_slots=16)
    held = pool.alloc(8)
    assert held is not None and pool.num_free_slots == 8
    assert pool.allocator.is_allocated(int(held[0]))
    assert pool.alloc(12) is None
    pool.free(held[:4])
    assert pool.free_slots() == frozenset(range(8, 16)) | frozenset(range(4))
    pool.reset()
    assert pool.num_free_slots == 16


# -- HostKVPool sizing and layout ------------------------------------------------------


def test_host_sizing_by_ratio_rounds_down_to_pages() -> None:
    device = device_pool(4, num_slots=64)
    assert HostKVPool.for_device(device, ratio=2).num_slots == 128
    assert HostKVPool.for_device(device, ratio=1.5).num_slots == 96
    assert HostKVPool.for_device(device, ratio=0.3).num_slots == 16  # 19.2 -> 19 -> 16
    assert HostKVPool.for_device(device, ratio=0.0625).num_slots == 4


def test_host_sizing_by_ratio_uses_the_written_decimal() -> None:
    device = device_pool(1, num_slots=100)
    assert HostKVPool.for_device(device, ratio=0.29).num_slots == 29  # not 28.999...


def test_host_sizing_by_bytes_rounds_down_to_pages() -> None:
    device = device_pool(4)  # 3 layers x 2 x 2 x 3 float32 = 144 bytes per token
    assert device.bytes_per_token == 144
    assert HostKVPool.for_device(device, size_bytes=144 * 10 + 143).num_slots == 8
    assert HostKVPool.for_device(device, size_bytes=144 * 4).num_slots == 4


@pytest.mark.parametrize(("ratio", "size_bytes", "argument"), [
    (0.01, None, "ratio"), (0, None, "ratio"), (-1.0, None, "ratio"),
    (float("nan"), None, "ratio"), (float("inf"), None, "ratio"), (True, None, "ratio"),
    ("2", None, "ratio"), (None, 144 * 3, "size_bytes"), (None, 0, "size_bytes"),
    (None, 1000.0, "size_bytes"), (None, None, "ratio/size_bytes"),
    (1.0, 1000, "ratio/size_bytes"),
])
def test_host_sizing_rejects(ratio: object, size_bytes: object, argument: str) -> None:
    with pytest.raises(SlotError) as raised:
        HostKVPool.for_device(device_pool(4), ratio=ratio,  # type: ignore[arg-type]
                              size_bytes=size_bytes)  # type: ignore[arg-type]
    assert raised.value.argument == argument


def test_host_constructor_rejects() -> None:
    device = device_pool(4)
    for arguments, argument in [
        ({"num_slots": 6}, "num_slots"), ({"num_slots": 8, "layout": "row"}, "layout"),
        ({"num_slots": 8, "pin_memory": 1}, "pin_memory"),
    ]:
        with pytest.raises(SlotError) as raised:
            HostKVPool(device, **arguments)  # type: ignore[arg-type]
        assert raised.value.argument == argument
    with pytest.raises(SlotError) as raised:
        HostKVPool("device", num_slots=8)  # type: ignore[arg-type]
    assert raised.value.argument == "device_pool"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA defaults")
def test_host_pinning_follows_cuda() -> None:
    device = device_pool(4)
    pool = HostKVPool(device, num_slots=8)
    assert not pool.pinned and not pool.kv.is_pinned()
    with pytest.raises(SlotError) as raised:
        HostKVPool(device, num_slots=8, pin_memory=True)
    assert raised.value.argument == "pin_memory"


@pytest.mark.parametrize(("kv_layout", "layout", "shape"), [
    ("mha", "layer_first", (3, 2, 16, 2, 3)), ("mla", "layer_first", (3, 16, 5)),
    ("mha", "page_first", (4, 3, 2, 4, 2, 3)), ("mla", "page_first", (4, 3, 4, 5)),
])
def test_host_layout_shapes(kv_layout: KVLayout, layout: HostLayout,
                            shape: tuple[int, ...]) -> None:
    device = device_pool(4, kv_layout)
    pool = HostKVPool(device, num_slots=16, layout=layout, pin_memory=False)
    assert pool.kv.shape == shape and pool.kv.dtype == device.dtype
    assert pool.kv.device.type == "cpu" and bool((pool.kv == 0).all())
    assert pool.token_shape == device.token_shape and pool.kv_layout == kv_layout
    assert pool.page_size == 4 and pool.bytes_per_token == device.bytes_per_token


def test_page_first_keeps_a_page_contiguous_over_layers() -> None:
    device = device_pool(4)
    pool = HostKVPool(device, num_slots=16, layout="page_first", pin_memory=False)
    page = page_slots(2, size=4)
    pool.write(page, pattern(pool, page))
    block = pool.kv[2]  # page 2, all layers, one contiguous block
    assert block.is_contiguous()
    assert torch.equal(block.movedim(2, 0).reshape(4, 3, 2, 2, 3).movedim(0, 1),
                       pattern(pool, page))


# -- HostKVPool bytes and copies -------------------------------------------------------


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_host_write_read_round_trip(layout: HostLayout, kv_layout: KVLayout,
                                    page_size: int) -> None:
    pool = HostKVPool(device_pool(page_size, kv_layout), num_slots=4 * page_size,
                      layout=layout)
    held = pool.alloc(3 * page_size)
    assert held is not None
    order = torch.cat([held[page_size:], held[:page_size]])
    values = pattern(pool, order, salt=1)
    pool.write(order, values)
    assert torch.equal(pool.read(order), values)
    rest = pool.alloc(page_size)
    assert rest is not None and bool((pool.read(rest) == 0).all())


def test_host_write_rejects_and_changes_nothing() -> None:
    pool = HostKVPool(device_pool(2), num_slots=8)
    before = pool.kv.clone()
    for which, values in [(slots(0, 0), pattern(pool, slots(0, 1))),
                          (slots(0, 1), pattern(pool, slots(0, 1)).half()),
                          (slots(0, 8), pattern(pool, slots(0, 1)))]:
        with pytest.raises(SlotError):
            pool.write(which, values)
        assert torch.equal(pool.kv, before)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_copies_all_layers_are_byte_exact(layout: HostLayout, kv_layout: KVLayout,
                                          page_size: int) -> None:
    device = device_pool(page_size, kv_layout)
    host = HostKVPool(device, num_slots=6 * page_size, layout=layout)
    source = page_slots(3, 1, 6, size=page_size)
    values = pattern(device, source)
    device.write(source, values)
    target = page_slots(5, 0, 2, size=page_size)
    host.copy_from_device(device, source, target)
    assert torch.equal(host.read(target), values)
    others = page_slots(1, 3, 4, size=page_size)
    assert bool((host.read(others) == 0).all())
    back = page_slots(7, 0, 2, size=page_size)
    host.copy_to_device(device, target, back)
    assert torch.equal(device.read(back), values)
    assert torch.equal(device.read(source), values)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_copies_one_layer_touch_only_that_layer(layout: HostLayout, kv_layout: KVLayout,
                                                page_size: int) -> None:
    device = device_pool(page_size, kv_layout)
    host = HostKVPool(device, num_slots=4 * page_size, layout=layout)
    source = page_slots(2, 5, size=page_size)
    values = pattern(device, source)
    device.write(source, values)
    target = page_slots(3, 1, size=page_size)
    host.copy_from_device(device, source, target, layer=1)
    got = host.read(target)
    assert torch.equal(got[1], values[1])
    assert bool((got[0] == 0).all()) and bool((got[2] == 0).all())
    host.write(target, pattern(host, target, salt=7))
    host.copy_to_device(device, target, source, layer=2)
    now = device.read(source)
    assert torch.equal(now[2], pattern(host, target, salt=7)[2])
    assert torch.equal(now[:2], values[:2])


def test_copies_in_float16_are_bit_exact() -> None:
    device = device_pool(2, dtype=torch.float16)
    host = HostKVPool(device, num_slots=8, layout="page_first")
    generator = torch.Generator().manual_seed(0)
    source = page_slots(0, 3, size=2)
    values = torch.randn(device.value_shape(4), generator=generator).half()
    device.write(source, values)
    host.copy_from_device(device, source, page_slots(1, 2, size=2))
    assert torch.equal(host.read(page_slots(1, 2, size=2)).view(torch.int16),
                       values.view(torch.int16))


def test_staged_copy_lands_once_and_only_on_its_pool() -> None:
    device = device_pool(2)
    host = HostKVPool(device, num_slots=8)
    other = HostKVPool(device, num_slots=8)
    source = page_slots(1, size=2)
    device.write(source, pattern(device, source))
    staged = host.begin_from_device(device, source, page_slots(0, size=2))
    assert bool((host.kv == 0).all())  # nothing lands before land()
    with pytest.raises(SlotError, match="another host pool"):
        other.land(staged)
    host.land(staged)
    assert torch.equal(host.read(page_slots(0, size=2)), pattern(device, source))
    with pytest.raises(SlotError, match="already landed"):
        host.land(staged)


def test_copy_to_device_layer_by_layer_reports_each_layer() -> None:
    device = device_pool(2)
    host = HostKVPool(device, num_slots=8)
    target = page_slots(1, 2, size=2)
    host.write(target, pattern(host, target))
    seen: list[int] = []
    host.copy_to_device(device, target, page_slots(0, 3, size=2), on_layer=seen.append)
    assert seen == [0, 1, 2]
    assert torch.equal(device.read(page_slots(0, 3, size=2)), pattern(host, target))


def test_copies_reject_misuse_and_change_nothing() -> None:
    device = device_pool(2)
    # Unpinned whatever the machine (the default pins where CUDA is): non_blocking is
    # then misuse. The GPU run of this test failed on it with the default.
    host = HostKVPool(device, num_slots=8, pin_memory=False)
    device.write(page_slots(0, 1, size=2), pattern(device, page_slots(0, 1, size=2)))
    host_before, device_before = host.kv.clone(), device.kv.clone()
    other_geometry = device_pool(4)
    other_dtype = device_pool(2, dtype=torch.float16)
    good_d, good_h = page_slots(0, 1, size=2), page_slots(2, 3, size=2)
    cases: list[tuple[dict[str, object], str]] = [
        ({"device_pool": other_geometry}, "device_pool"),
        ({"device_pool": other_dtype}, "device_pool"),
        ({"device_pool": host}, "device_pool"),
        ({"device_slots": good_d[:2]}, "host_slots"),
        ({"device_slots": slots(0, 1, 2, 99)}, "device_slots"),
        ({"host_slots": slots(0, 1, 2, 8)}, "host_slots"),
        ({"host_slots": good_h.float()}, "host_slots"),
        ({"layer": 3}, "layer"),
        ({"layer": -1}, "layer"),
        ({"non_blocking": True}, "non_blocking"),
        ({"non_blocking": 1}, "non_blocking"),
    ]
    for override, argument in cases:
        arguments: dict[str, object] = {"device_pool": device, "device_slots": good_d,
                                        "host_slots": good_h, "layer": None,
                                        "non_blocking": False}
        arguments.update(override)
        for method in (host.copy_from_device, host.copy_to_device):
            with pytest.raises(SlotError) as raised:
                method(**arguments)  # type: ignore[operator]
            assert raised.value.argument == argument, (override, method)
            assert torch.equal(host.kv, host_before) and torch.equal(device.kv, device_before)
    with pytest.raises(SlotError) as raised:  # two writes to one host slot
        host.copy_from_device(device, good_d, slots(2, 3, 3, 4))
    assert raised.value.argument == "host_slots"
    with pytest.raises(SlotError) as raised:  # two writes to one device slot
        host.copy_to_device(device, good_h, slots(0, 1, 1, 2))
    assert raised.value.argument == "device_slots"
    assert torch.equal(host.kv, host_before) and torch.equal(device.kv, device_before)
    host.copy_from_device(device, slots(0, 0), slots(4, 5))  # reading one slot twice is fine
    assert torch.equal(host.read(slots(4, 5)), pattern(device, slots(0, 0)))


def test_meta_slots_are_typed_errors_on_every_pool_path() -> None:
    # A meta tensor has no values: checking it with .cpu() raised NotImplementedError.
    meta = torch.zeros(4, dtype=torch.int64, device="meta")
    dev = device_pool(page_size=4)
    host = HostKVPool(dev, num_slots=32)
    taken = dev.alloc(4)
    assert taken is not None
    free_before = (dev.num_free_slots, host.num_free_slots)
    calls = [lambda: dev.free(meta), lambda: dev.read(meta), lambda: host.read(meta),
             lambda: host.free(meta)]
    for call in calls:
        with pytest.raises(SlotError) as caught:
            call()
        assert caught.value.argument == "slots" and "meta" in str(caught.value)
    assert (dev.num_free_slots, host.num_free_slots) == free_before
