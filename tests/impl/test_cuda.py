"""CudaCopyEngine on a CUDA device pool with a pinned host pool (skipped without CUDA).

Each engine test runs on both copy paths (issue 33): ``triton`` (the kernels read and write
the pinned host pool in place; skipped where Triton does not import) and ``staging``.

The ordering checks put a long run of matmuls on the current (compute) stream before the
KV is written and the copy submitted: a copy stream that failed to wait for that work would
read the KV before the compute stream wrote it, which the byte comparison shows. (No
assertion depends on how long anything takes.)
"""

from __future__ import annotations

import pytest
import torch

from hiradix._slots import SlotError
from hiradix.device_pool import DeviceKVPool, KVLayout
from hiradix.host_pool import HostKVPool, HostLayout
from hiradix.kernels import load_copier, triton_missing
from hiradix.transfer import CudaCopyEngine, SyncCopyEngine, make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

P = 4  # page size
LAYERS = 3


def pools(layout: HostLayout = "layer_first", kv_layout: KVLayout = "mha",
          pin_memory: bool | None = None) -> tuple[DeviceKVPool, HostKVPool]:
    device = DeviceKVPool(num_slots=64, page_size=P, layers=LAYERS, layout=kv_layout,
                          heads=2, head_dim=8, latent_dim=16, dtype=torch.float16,
                          device="cuda")
    host = HostKVPool.for_device(device, ratio=2, layout=layout, pin_memory=pin_memory)
    return device, host


@pytest.fixture(params=["staging", "triton"])
def copy_path(request: pytest.FixtureRequest) -> str:
    missing = triton_missing() if request.param == "triton" else None
    if missing is not None:
        pytest.skip(missing)
    return str(request.param)


def cuda_engine(device: DeviceKVPool, host: HostKVPool, path: str) -> CudaCopyEngine:
    engine = make_engine("cuda", device, host,
                         copy_path="triton" if path == "triton" else "staging")
    assert isinstance(engine, CudaCopyEngine) and engine.path == path
    return engine


def pages(*ids: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in ids])


def values(pool: DeviceKVPool | HostKVPool, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(pool.value_shape(count), generator=generator).to(pool.dtype)


def keep_compute_busy() -> None:
    """Enqueue about 100 TFLOP of matmuls (0.1 s or more on an H200) on the current stream;
    the host does not wait for them."""
    a = torch.ones(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(100):
        a = a @ a


def layer_rows(device: DeviceKVPool, layer: int, which: torch.Tensor) -> torch.Tensor:
    """Layer ``layer`` of ``which``, read the way a forward pass would (current stream)."""
    view = device.layer_view(layer)
    index = which.to(device.device)
    rows = view[:, index].movedim(0, 1) if device.layout == "mha" else view[index]
    return rows.cpu()


def test_defaults_pin_and_auto_picks_cuda() -> None:
    device, host = pools()
    assert host.pinned and host.kv.is_pinned()
    assert device.kv.is_cuda and device.device.index is not None
    engine = make_engine("auto", device, host)
    assert type(engine) is CudaCopyEngine
    assert engine.path == ("staging" if triton_missing() else "triton")
    copier = load_copier(device, host)
    if not isinstance(copier, str):
        with pytest.raises(SlotError) as raised:
            CudaCopyEngine(device, pools(pin_memory=False)[1], copier=copier)
        assert raised.value.argument == "copier"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv_layout", ["mha", "mla"])
def test_d2h_fifo_and_bytes(layout: HostLayout, kv_layout: KVLayout, copy_path: str) -> None:
    device, host = pools(layout, kv_layout)
    engine = cuda_engine(device, host, copy_path)
    first, second = values(device, 2 * P, 1), values(device, P, 2)
    device.write(pages(3, 1), first)
    device.write(pages(7), second)
    t0 = engine.submit("d2h", pages(3, 1), pages(10, 2))
    t1 = engine.submit("d2h", pages(7), pages(0))
    assert t1 > t0 and engine.pending("d2h") == 2
    torch.cuda.synchronize()
    assert engine.finished("d2h") == 2
    with pytest.raises(SlotError) as raised:
        engine.acknowledge("d2h", 3)
    assert raised.value.argument == "count"
    assert engine.acknowledge("d2h", 1) == [t0]
    assert torch.equal(host.read(pages(10, 2)), first)
    assert engine.acknowledge("d2h", 1) == [t1]
    assert torch.equal(host.read(pages(0)), second)
    assert engine.pending("d2h") == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv_layout", ["mha", "mla"])
def test_h2d_wait_layer_then_acknowledge(layout: HostLayout, kv_layout: KVLayout,
                                         copy_path: str) -> None:
    device, host = pools(layout, kv_layout)
    engine = cuda_engine(device, host, copy_path)
    expected = values(host, 2 * P, 3)
    host.write(pages(5, 9), expected)
    target = pages(2, 6)
    ticket = engine.submit("h2d", target, pages(5, 9))
    for layer in range(LAYERS):
        engine.wait_layer(ticket, layer)  # the current stream now waits for this layer
        assert torch.equal(layer_rows(device, layer, target), expected[layer])
    torch.cuda.synchronize()
    assert engine.finished("h2d") == 1
    assert engine.acknowledge("h2d", 1) == [ticket]
    assert torch.equal(device.read(target).cpu(), expected)
    engine.wait_layer(ticket, 0)  # acknowledged: nothing to wait for
    with pytest.raises(SlotError) as raised:
        engine.wait_layer(ticket, LAYERS)
    assert raised.value.argument == "layer"


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_loose_slots_go_both_ways(layout: HostLayout, copy_path: str) -> None:
    """Slots that are no whole pages (the kernels' slot-by-slot addressing), a partial
    page at the end, in random order."""
    device, host = pools(layout)
    engine = cuda_engine(device, host, copy_path)
    generator = torch.Generator().manual_seed(11)
    source = torch.randperm(device.num_slots, generator=generator)[:2 * P + 1]
    middle = torch.randperm(host.num_slots, generator=generator)[:2 * P + 1]
    target = torch.randperm(device.num_slots, generator=generator)[:2 * P + 1]
    expected = values(device, 2 * P + 1, 12)
    device.write(source, expected)
    engine.submit("d2h", source, middle)
    torch.cuda.synchronize()
    engine.acknowledge("d2h", 1)
    assert torch.equal(host.read(middle), expected)
    ticket = engine.submit("h2d", target, middle)
    for layer in range(LAYERS):
        engine.wait_layer(ticket, layer)
    torch.cuda.synchronize()
    engine.acknowledge("h2d", 1)
    assert torch.equal(device.read(target).cpu(), expected)


def test_wait_layer_rejects_d2h_tickets(copy_path: str) -> None:
    device, host = pools()
    engine = cuda_engine(device, host, copy_path)
    ticket = engine.submit("d2h", pages(0), pages(0))
    with pytest.raises(SlotError) as raised:
        engine.wait_layer(ticket, 0)
    assert raised.value.argument == "ticket"
    torch.cuda.synchronize()
    engine.acknowledge("d2h", 1)


def test_d2h_waits_for_prior_compute_stream_writes(copy_path: str) -> None:
    device, host = pools()
    engine = cuda_engine(device, host, copy_path)
    source, target = device.alloc(8 * P), host.alloc(8 * P)
    assert source is not None and target is not None
    for busy, seed in ((False, 4), (True, 5)):  # the first round warms the allocators
        expected = values(device, 8 * P, seed)
        on_device = expected.to("cuda")
        torch.cuda.synchronize()
        if busy:
            keep_compute_busy()
        device.write(source, on_device)  # enqueued behind the matmuls; the host goes on
        engine.submit("d2h", source, target)
        torch.cuda.synchronize()
        assert len(engine.acknowledge("d2h", 1)) == 1
        assert torch.equal(host.read(target), expected)


def test_h2d_waits_for_prior_compute_stream_work(copy_path: str) -> None:
    device, host = pools()
    engine = cuda_engine(device, host, copy_path)
    for busy, seed in ((False, 6), (True, 7)):  # the first round warms the allocators
        expected = values(host, P, seed)
        host.write(pages(1), expected)
        torch.cuda.synchronize()
        if busy:
            keep_compute_busy()  # earlier readers of the destination slots, say
        engine.submit("h2d", pages(4), pages(1))
        torch.cuda.synchronize()
        assert engine.finished("h2d") == 1
        engine.acknowledge("h2d", 1)
        assert torch.equal(device.read(pages(4)).cpu(), expected)


def test_interleaved_directions_are_independent(copy_path: str) -> None:
    device, host = pools()
    engine = cuda_engine(device, host, copy_path)
    device.write(pages(0), values(device, P, 6))
    host.write(pages(3), values(host, P, 7))
    d = engine.submit("d2h", pages(0), pages(8))
    h = engine.submit("h2d", pages(9), pages(3))
    torch.cuda.synchronize()
    assert engine.acknowledge("h2d", 1) == [h]
    assert engine.pending("d2h") == 1
    assert engine.acknowledge("d2h", 1) == [d]
    assert torch.equal(host.read(pages(8)), values(device, P, 6))
    assert torch.equal(device.read(pages(9)).cpu(), values(host, P, 7))


def test_reset_drains_copies_in_flight(copy_path: str) -> None:
    device, host = pools()
    engine = cuda_engine(device, host, copy_path)
    expected = values(host, P, 8)
    host.write(pages(2), expected)
    torch.cuda.synchronize()
    keep_compute_busy()
    engine.submit("d2h", pages(0), pages(0))
    engine.submit("h2d", pages(5), pages(2))
    engine.reset()  # waits for both copies before dropping them
    assert engine.pending("d2h") == engine.pending("h2d") == 0
    assert torch.equal(device.read(pages(5)).cpu(), expected)
    assert engine.submit("d2h", pages(1), pages(1)) == 2
    torch.cuda.synchronize()
    engine.acknowledge("d2h", 1)


def test_unpinned_host_pool_still_copies_correctly() -> None:
    device, host = pools(pin_memory=False)
    engine = CudaCopyEngine(device, host)
    device.write(pages(1), values(device, P, 9))
    engine.submit("d2h", pages(1), pages(1))
    engine.submit("h2d", pages(2), pages(1))  # reads host bytes not yet landed: garbage ok
    torch.cuda.synchronize()
    engine.acknowledge("d2h", 1)
    engine.acknowledge("h2d", 1)
    assert torch.equal(host.read(pages(1)), values(device, P, 9))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sync_engine_and_pool_copies_on_cuda(layout: HostLayout) -> None:
    device, host = pools(layout)
    engine = SyncCopyEngine(device, host)
    device.write(pages(4), values(device, P, 10))
    engine.submit("d2h", pages(4), pages(6))
    assert engine.finished("d2h") == 1
    assert torch.equal(host.read(pages(6)), values(device, P, 10))
    host.copy_from_device(device, pages(4), pages(7), non_blocking=True)
    assert torch.equal(host.read(pages(7)), values(device, P, 10))
    host.copy_to_device(device, pages(7), pages(8), layer=1, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(device.read(pages(8)).cpu()[1], values(device, P, 10)[1])
