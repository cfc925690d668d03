"""Copy-engine semantics on CPU pools: SyncCopyEngine and ControlledCopyEngine."""

from __future__ import annotations

import math

import pytest
import torch

from hiradix._slots import SlotError
from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.transfer import (
    ControlledCopyEngine,
    CudaCopyEngine,
    Direction,
    SyncCopyEngine,
    TransferEngine,
    make_engine,
)

P = 2  # page size


def pools(layout: str = "layer_first") -> tuple[DeviceKVPool, HostKVPool]:
    device = DeviceKVPool(num_slots=16, page_size=P, layers=2, heads=2, head_dim=2,
                          dtype=torch.float32)
    host = HostKVPool(device, num_slots=16, layout=layout)  # type: ignore[arg-type]
    return device, host


def pages(*ids: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in ids])


def pattern(pool: DeviceKVPool | HostKVPool, which: torch.Tensor, salt: int) -> torch.Tensor:
    """Distinct values per (salt, layer, slot, element)."""
    count = which.numel() * pool.layers * math.prod(pool.token_shape)
    return (torch.arange(count, dtype=torch.float32) + 1000 * salt).reshape(
        pool.value_shape(which.numel()))


def settle(engine: TransferEngine, direction: Direction) -> None:
    """Let every queued copy of ``direction`` complete (a no-op for the sync engine)."""
    if isinstance(engine, ControlledCopyEngine):
        engine.complete(direction, engine.queued(direction))


@pytest.fixture(params=["sync", "controlled"])
def engine(request: pytest.FixtureRequest) -> TransferEngine:
    device, host = pools()
    return make_engine(request.param, device, host)


# -- the shared contract ----------------------------------------------------------------


def test_tickets_increase_across_directions(engine: TransferEngine) -> None:
    tickets = [engine.submit("d2h", pages(0), pages(0)), engine.submit("h2d", pages(1), pages(2)),
               engine.submit("d2h", pages(2), pages(1))]
    assert tickets == sorted(tickets) and len(set(tickets)) == 3
    assert engine.pending("d2h") == 2 and engine.pending("h2d") == 1


def test_acknowledge_is_fifo_per_direction(engine: TransferEngine) -> None:
    first = engine.submit("d2h", pages(0), pages(0))
    between = engine.submit("h2d", pages(5), pages(5))
    second = engine.submit("d2h", pages(1), pages(1))
    third = engine.submit("d2h", pages(2), pages(2))
    settle(engine, "d2h")
    assert engine.finished("d2h") == 3
    assert engine.acknowledge("d2h", 2) == [first, second]
    assert engine.pending("d2h") == 1 and engine.finished("d2h") == 1
    assert engine.acknowledge("d2h", 0) == []
    assert engine.acknowledge("d2h", 1) == [third]
    assert engine.pending("d2h") == 0 and engine.finished("d2h") == 0
    settle(engine, "h2d")
    assert engine.acknowledge("h2d", 1) == [between]


def test_over_acknowledge_is_rejected_and_changes_nothing(engine: TransferEngine) -> None:
    engine.submit("d2h", pages(0), pages(0))
    settle(engine, "d2h")
    for count in (2, -1, True, 1.0):
        with pytest.raises(SlotError) as raised:
            engine.acknowledge("d2h", count)  # type: ignore[arg-type]
        assert raised.value.argument == "count"
        assert engine.pending("d2h") == 1 and engine.finished("d2h") == 1
    with pytest.raises(SlotError) as raised:
        engine.acknowledge("h2d", 1)
    assert raised.value.argument == "count"


def test_bad_directions_are_rejected(engine: TransferEngine) -> None:
    for call in (lambda: engine.submit("up", pages(0), pages(0)),  # type: ignore[arg-type]
                 lambda: engine.finished("H2D"),  # type: ignore[arg-type]
                 lambda: engine.pending(None),  # type: ignore[arg-type]
                 lambda: engine.acknowledge("x", 0)):  # type: ignore[arg-type]
        with pytest.raises(SlotError) as raised:
            call()
        assert raised.value.argument == "direction"


def test_bad_submits_are_rejected_and_queue_nothing(engine: TransferEngine) -> None:
    device, host = engine.device_pool, engine.host_pool
    host_before, device_before = host.kv.clone(), device.kv.clone()
    cases: list[tuple[Direction, object, object, str]] = [
        ("d2h", pages(0), pages(0, 1), "host_slots"),
        ("d2h", torch.tensor([0, 16]), pages(0), "device_slots"),
        ("d2h", pages(0), torch.tensor([0, 0]), "host_slots"),  # two writes to one slot
        ("h2d", torch.tensor([3, 3]), pages(0), "device_slots"),
        ("h2d", pages(0).int(), pages(0), "device_slots"),
        ("h2d", pages(0), [0, 1], "host_slots"),
    ]
    for direction, device_slots, host_slots, argument in cases:
        with pytest.raises(SlotError) as raised:
            engine.submit(direction, device_slots, host_slots)  # type: ignore[arg-type]
        assert raised.value.argument == argument
    assert engine.pending("d2h") == engine.pending("h2d") == 0
    assert torch.equal(host.kv, host_before) and torch.equal(device.kv, device_before)
    assert engine.submit("d2h", pages(0), pages(0)) == 0  # no ticket was used up


def test_bytes_arrive_in_both_directions(engine: TransferEngine) -> None:
    device, host = engine.device_pool, engine.host_pool
    device.write(pages(3, 4), pattern(device, pages(3, 4), 1))
    host.write(pages(7), pattern(host, pages(7), 2))
    engine.submit("d2h", pages(3, 4), pages(0, 6))
    engine.submit("h2d", pages(1), pages(7))
    settle(engine, "d2h")
    settle(engine, "h2d")
    engine.acknowledge("d2h", 1)
    engine.acknowledge("h2d", 1)
    assert torch.equal(host.read(pages(0, 6)), pattern(device, pages(3, 4), 1))
    assert torch.equal(device.read(pages(1)), pattern(host, pages(7), 2))


def test_reset_drops_everything_and_keeps_ticketing(engine: TransferEngine) -> None:
    engine.submit("d2h", pages(0), pages(0))
    engine.submit("h2d", pages(1), pages(1))
    engine.reset()
    assert engine.pending("d2h") == engine.pending("h2d") == 0
    assert engine.finished("d2h") == engine.finished("h2d") == 0
    assert engine.submit("d2h", pages(0), pages(0)) == 2


def test_wait_layer_arguments(engine: TransferEngine) -> None:
    d2h = engine.submit("d2h", pages(0), pages(0))
    h2d = engine.submit("h2d", pages(1), pages(1))
    settle(engine, "h2d")
    engine.wait_layer(h2d, 0)
    engine.wait_layer(h2d, 1)
    for ticket, layer, argument in [(d2h, 0, "ticket"), (99, 0, "ticket"), (-1, 0, "ticket"),
                                    (h2d, 2, "layer"), (h2d, -1, "layer"), ("0", 0, "ticket")]:
        with pytest.raises(SlotError) as raised:
            engine.wait_layer(ticket, layer)  # type: ignore[arg-type]
        assert raised.value.argument == argument
    engine.acknowledge("h2d", 1)
    engine.wait_layer(h2d, 1)  # acknowledged: nothing left to wait for


def test_engines_reject_mismatched_pools() -> None:
    device, _ = pools()
    other = DeviceKVPool(num_slots=16, page_size=4, layers=2, dtype=torch.float32)
    with pytest.raises(SlotError) as raised:
        SyncCopyEngine(device, HostKVPool(other, num_slots=16))
    assert raised.value.argument == "host_pool"
    with pytest.raises(SlotError) as raised:
        ControlledCopyEngine(device, device)  # type: ignore[arg-type]
    assert raised.value.argument == "host_pool"


def test_make_engine_kinds() -> None:
    device, host = pools()
    assert type(make_engine("auto", device, host)) is SyncCopyEngine
    assert type(make_engine("sync", device, host)) is SyncCopyEngine
    assert type(make_engine("controlled", device, host)) is ControlledCopyEngine
    with pytest.raises(SlotError) as raised:
        make_engine("cuda", device, host)
    assert raised.value.argument == "device_pool"
    with pytest.raises(SlotError) as raised:
        CudaCopyEngine(device, host)
    assert raised.value.argument == "device_pool"
    with pytest.raises(SlotError) as raised:
        make_engine("fast", device, host)  # type: ignore[arg-type]
    assert raised.value.argument == "kind"


# -- SyncCopyEngine ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sync_copies_at_submit(layout: str) -> None:
    device, host = pools(layout)
    engine = SyncCopyEngine(device, host)
    device.write(pages(2), pattern(device, pages(2), 3))
    engine.submit("d2h", pages(2), pages(5))
    assert engine.finished("d2h") == engine.pending("d2h") == 1
    assert torch.equal(host.read(pages(5)), pattern(device, pages(2), 3))
    engine.submit("h2d", pages(6), pages(5))
    assert engine.finished("h2d") == 1
    assert torch.equal(device.read(pages(6)), pattern(device, pages(2), 3))


# -- ControlledCopyEngine ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_controlled_moves_nothing_until_complete(layout: str) -> None:
    device, host = pools(layout)
    engine = ControlledCopyEngine(device, host)
    device.write(pages(1), pattern(device, pages(1), 1))
    host.write(pages(3), pattern(host, pages(3), 2))
    engine.submit("d2h", pages(1), pages(4))
    engine.submit("h2d", pages(5), pages(3))
    assert engine.finished("d2h") == engine.finished("h2d") == 0
    assert engine.queued("d2h") == engine.queued("h2d") == 1
    assert bool((host.read(pages(4)) == 0).all())
    assert bool((device.read(pages(5)) == 0).all())
    engine.complete("d2h")
    assert torch.equal(host.read(pages(4)), pattern(device, pages(1), 1))
    assert bool((device.read(pages(5)) == 0).all())
    assert engine.finished("d2h") == 1 and engine.queued("d2h") == 0
    engine.complete("h2d")
    assert torch.equal(device.read(pages(5)), pattern(host, pages(3), 2))


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_controlled_reads_the_source_at_completion(direction: Direction) -> None:
    device, host = pools()
    engine = ControlledCopyEngine(device, host)
    source_pool: DeviceKVPool | HostKVPool = device if direction == "d2h" else host
    source_pool.write(pages(2), pattern(source_pool, pages(2), 1))
    engine.submit(direction, pages(2), pages(2))
    source_pool.write(pages(2), pattern(source_pool, pages(2), 9))  # overwritten in flight
    engine.complete(direction)
    engine.acknowledge(direction, 1)
    destination = host if direction == "d2h" else device
    assert torch.equal(destination.read(pages(2)), pattern(source_pool, pages(2), 9))


def test_controlled_shows_a_source_reused_in_flight() -> None:
    device, host = pools()
    engine = ControlledCopyEngine(device, host)
    source = device.alloc(2 * P)
    target = host.alloc(2 * P)
    assert source is not None and target is not None
    device.write(source, pattern(device, source, 1))
    engine.submit("d2h", source, target)
    device.free(source)  # the bug under test: freed while its copy is in flight
    reused = device.alloc(2 * P)
    assert reused is not None and set(reused.tolist()) == set(source.tolist())
    device.write(reused, pattern(device, reused, 5))
    engine.complete("d2h")
    assert not torch.equal(host.read(target), pattern(device, source, 1))


def test_controlled_fifo_and_interleaving() -> None:
    device, host = pools()
    engine = ControlledCopyEngine(device, host)
    for page in range(3):
        device.write(pages(page), pattern(device, pages(page), page))
        host.write(pages(page), pattern(host, pages(page), 10 + page))
    d0 = engine.submit("d2h", pages(0), pages(4))
    h0 = engine.submit("h2d", pages(4), pages(0))
    d1 = engine.submit("d2h", pages(1), pages(5))
    h1 = engine.submit("h2d", pages(5), pages(1))
    d2 = engine.submit("d2h", pages(2), pages(6))
    engine.complete("h2d", 2)
    assert engine.finished("h2d") == 2 and engine.finished("d2h") == 0
    engine.complete("d2h", 2)
    assert engine.finished("d2h") == 2 and engine.queued("d2h") == 1
    assert bool((host.read(pages(6)) == 0).all())  # d2 still queued
    assert engine.acknowledge("d2h", 1) == [d0]
    assert engine.acknowledge("h2d", 2) == [h0, h1]
    engine.complete("d2h")
    assert engine.acknowledge("d2h", 2) == [d1, d2]
    for page in range(3):
        assert torch.equal(host.read(pages(4 + page)), pattern(device, pages(page), page))
    assert torch.equal(device.read(pages(4, 5)), host.read(pages(0, 1)))


def test_controlled_complete_beyond_the_queue_moves_nothing() -> None:
    device, host = pools()
    engine = ControlledCopyEngine(device, host)
    device.write(pages(0, 1), pattern(device, pages(0, 1), 1))
    engine.submit("d2h", pages(0), pages(0))
    engine.submit("d2h", pages(1), pages(1))
    for count in (3, -1, 1.5):
        with pytest.raises(SlotError) as raised:
            engine.complete("d2h", count)  # type: ignore[arg-type]
        assert raised.value.argument == "count"
    assert engine.queued("d2h") == 2 and bool((host.kv == 0).all())
    engine.complete("d2h", 0)
    assert engine.queued("d2h") == 2
    with pytest.raises(SlotError) as raised:
        engine.complete("h2d")
    assert raised.value.argument == "count"


def test_controlled_wait_layer_needs_completion() -> None:
    device, host = pools()
    engine = ControlledCopyEngine(device, host)
    ticket = engine.submit("h2d", pages(0), pages(0))
    with pytest.raises(SlotError, match="not completed") as raised:
        engine.wait_layer(ticket, 0)
    assert raised.value.argument == "ticket"
    engine.complete("h2d")
    engine.wait_layer(ticket, 0)


def test_controlled_reset_discards_queued_copies() -> None:
    device, host = pools()
    engine = ControlledCopyEngine(device, host)
    device.write(pages(0), pattern(device, pages(0), 1))
    engine.submit("d2h", pages(0), pages(0))
    engine.reset()
    assert engine.queued("d2h") == 0
    with pytest.raises(SlotError):
        engine.complete("d2h")
    assert bool((host.kv == 0).all())
