"""The Triton copy kernels (issue 33) under Triton's interpreter, on CPU tensors.

``TRITON_INTERPRET=1`` makes ``@triton.jit`` build interpreted kernels, decided when the
decorator runs, so the ``kernels`` fixture imports a private, interpreted copy of
``hiradix.kernels.triton_copy`` with the variable set and puts back whatever was there
(on a GPU machine the engine tests import the compiled one). Every copy is compared byte
for byte with the torch gathers and scatters of the pools (INV-KV-INTEGRITY), over the
*whole* destination buffer, so a stray write fails too. The same kernel is also compiled
ahead of time for sm_90 (the ptxas in Triton's wheel; no GPU), which the interpreter does
not do. Skipped, with the reason, where Triton does not import, unless
``HIRADIX_REQUIRE_ENGINES`` names ``triton``.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from hiradix.device_pool import DeviceKVPool, KVLayout, scatter_slot_major
from hiradix.errors import SlotError
from hiradix.host_pool import HostKVPool, HostLayout
from hiradix.kernels import load_copier, triton_missing
from hiradix.kernels.addressing import RowAddressing, host_addressing
from hiradix.transfer import make_engine

MODULE = "hiradix.kernels.triton_copy"
LAYERS = 3


def fresh_copy(*, interpret: bool) -> Iterator[ModuleType]:
    """A private copy of ``hiradix.kernels.triton_copy`` whose kernels are interpreted or
    compiled; whatever copy was imported before is put back afterwards."""
    missing = triton_missing()
    if missing is not None:
        required = os.environ.get("HIRADIX_REQUIRE_ENGINES", "").split(",")
        if "triton" in required:
            pytest.fail(f"{missing} [HIRADIX_REQUIRE_ENGINES names triton]", pytrace=False)
        pytest.skip(missing)
    before = sys.modules.pop(MODULE, None)
    with pytest.MonkeyPatch.context() as patch:
        if interpret:
            patch.setenv("TRITON_INTERPRET", "1")
        else:
            patch.delenv("TRITON_INTERPRET", raising=False)
        module = importlib.import_module(MODULE)
        yield module
    sys.modules.pop(MODULE, None)
    if before is not None:
        sys.modules[MODULE] = before


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    """An interpreted copy of ``hiradix.kernels.triton_copy``."""
    yield from fresh_copy(interpret=True)


@pytest.fixture
def compiled() -> Iterator[ModuleType]:
    """A copy of ``hiradix.kernels.triton_copy`` with compiled (not interpreted) kernels."""
    yield from fresh_copy(interpret=False)


def make_pools(kv_layout: KVLayout, layout: HostLayout, page: int, *, seed: int = 0
               ) -> tuple[DeviceKVPool, HostKVPool]:
    """Pools with distinct random bytes in every slot of both; head_dim 3: rows of 6 or
    7 half words, so no row is a power of two words long (a masked tail in every row)."""
    device = DeviceKVPool(num_slots=8 * page, page_size=page, layers=LAYERS, layout=kv_layout,
                          heads=2, head_dim=3, latent_dim=7, dtype=torch.float16)
    host = HostKVPool(device, num_slots=12 * page, layout=layout, pin_memory=False)
    generator = torch.Generator().manual_seed(seed)
    for pool in (device, host):
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=generator).to(pool.kv.dtype))
    return device, host


def whole_pages(pages: torch.Tensor, page: int) -> torch.Tensor:
    return (pages[:, None] * page + torch.arange(page)).reshape(-1)


def slot_lists(page: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(device slots, host slots) pairs: whole pages in random page order, and random
    slots whose count ends mid-page (the slot-by-slot path, partial tail)."""
    generator = torch.Generator().manual_seed(seed)
    pages = (whole_pages(torch.randperm(8, generator=generator)[:5], page),
             whole_pages(torch.randperm(12, generator=generator)[:5], page))
    count = 3 * page + 1 if page > 1 else 5
    loose = (torch.randperm(8 * page, generator=generator)[:count],
             torch.randperm(12 * page, generator=generator)[:count])
    return [pages, loose]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_d2h(kernels: ModuleType, kv_layout: KVLayout, layout: HostLayout, page: int) -> None:
    """Every d2h copy through the kernel leaves the host buffer byte for byte as the
    pools' torch path leaves a twin of it."""
    device, host = make_pools(kv_layout, layout, page)
    _, twin = make_pools(kv_layout, layout, page)
    copier = kernels.PageCopier(device, host)
    for device_slots, host_slots in slot_lists(page, seed=1):
        copier.d2h(copier.prepare(device_slots, host_slots))
        twin.write(host_slots, device.read(device_slots))
        assert same_bytes(host.kv, twin.kv), f"d2h of {len(device_slots)} slots"


def check_h2d_by_layer(kernels: ModuleType, kv_layout: KVLayout, layout: HostLayout,
                       page: int) -> None:
    """Layer by layer, an h2d copy through the kernel writes that layer's rows and no
    others: after each layer the device buffer equals a twin scattered by torch."""
    device, host = make_pools(kv_layout, layout, page)
    twin, _ = make_pools(kv_layout, layout, page)
    copier = kernels.PageCopier(device, host)
    for device_slots, host_slots in slot_lists(page, seed=2):
        prepared = copier.prepare(device_slots, host_slots)
        values = host.read(host_slots)
        for layer in range(LAYERS):
            copier.h2d_layer(prepared, layer)
            scatter_slot_major(twin.kv[layer], device_slots, values[layer], all_layers=False,
                               mha=kv_layout == "mha")
            assert same_bytes(device.kv, twin.kv), f"h2d layer {layer}"


@pytest.mark.parametrize("page", [1, 2, 16])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv_layout", ["mha", "mla"])
def test_d2h_matches_the_torch_gather(kernels: ModuleType, kv_layout: KVLayout,
                                      layout: HostLayout, page: int) -> None:
    check_d2h(kernels, kv_layout, layout, page)


@pytest.mark.parametrize("page", [1, 2, 16])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv_layout", ["mha", "mla"])
def test_h2d_layer_by_layer_matches_the_torch_scatter(kernels: ModuleType,
                                                      kv_layout: KVLayout,
                                                      layout: HostLayout, page: int) -> None:
    check_h2d_by_layer(kernels, kv_layout, layout, page)


def test_whole_pages_go_by_page_and_loose_slots_by_slot(kernels: ModuleType) -> None:
    device, host = make_pools("mha", "page_first", 4)
    copier = kernels.PageCopier(device, host)
    (pages, host_pages), (loose, host_loose) = slot_lists(4, seed=3)
    assert copier.prepare(pages, host_pages).by_pages
    assert not copier.prepare(loose, host_loose).by_pages
    assert not copier.prepare(pages, host_loose[:len(pages)]).by_pages  # one side whole
    shifted = pages + 1  # whole-page length, but not page-aligned
    assert not copier.prepare(shifted[shifted < device.num_slots],
                              host_pages[:int((shifted < device.num_slots).sum())]).by_pages


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_words", [8, 1024])
def test_copy_rows_index_dtypes_and_multi_block_rows(kernels: ModuleType,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     index_dtype: torch.dtype,
                                                     block_words: int) -> None:
    """The launcher with int32 and int64 indexes, one layer's planes. With blocks of at
    most 8 words a page row (8 slots of 12 bytes: 12 int64 words) takes a full block and
    a partial one; a slot row (3 int32 words) is one partial block."""
    monkeypatch.setattr(kernels, "MAX_BLOCK_WORDS", block_words)
    device, host = make_pools("mha", "page_first", 8)
    _, twin = make_pools("mha", "page_first", 8)
    copier = kernels.PageCopier(device, host)
    for by_pages in (True, False):
        device_at, host_at = copier.addressing(by_pages=by_pages)
        word = min(device_at.word_bytes(), host_at.word_bytes())
        assert device_at.row_bytes // word == (12 if by_pages else 3)  # as the docstring says
        generator = torch.Generator().manual_seed(int(by_pages))
        units = min(device_at.units, host_at.units)
        src = torch.randperm(device_at.units, generator=generator)[:units - 1]
        dst = torch.randperm(host_at.units, generator=generator)[:units - 1]
        kernels.copy_rows(device.kv, device_at, src.to(index_dtype), host.kv, host_at,
                          dst.to(index_dtype), range(2, 4))  # layer 1: its K and V planes
        page = 8 if by_pages else 1
        device_slots, host_slots = whole_pages(src, page), whole_pages(dst, page)
        values = twin.read(host_slots)
        values[1] = device.read(device_slots)[1]
        twin.write(host_slots, values)
        assert same_bytes(host.kv, twin.kv), f"by_pages={by_pages}"


def valid_call(kernels: ModuleType) -> tuple[HostKVPool, dict[str, object]]:
    device, host = make_pools("mla", "layer_first", 2)
    device_at, host_at = kernels.PageCopier(device, host).addressing(by_pages=False)
    call: dict[str, object] = dict(src=device.kv, src_at=device_at, src_index=torch.arange(4),
                                   dst=host.kv, dst_at=host_at, dst_index=torch.arange(4),
                                   planes=range(LAYERS))
    return host, call


@pytest.mark.parametrize(("argument", "bad"), [
    ("src_index", torch.tensor([0, 1, 2, 16])),  # the device pool has 16 slots
    ("src_index", torch.tensor([0, -1, 2, 3])),
    ("dst_index", torch.tensor([0, 1, 2, 24], dtype=torch.int32)),  # the host pool has 24
    ("dst_index", torch.arange(3)),
    ("dst_index", torch.arange(4, dtype=torch.int16)),
    ("src_index", torch.arange(4.0)),
    ("src_index", torch.arange(4).view(2, 2)),
    ("src_index", [0, 1, 2, 3]),
    ("planes", range(0, LAYERS + 1)),
    ("planes", range(0, LAYERS, 2)),
    ("dst", torch.zeros(4, 4).t()),
    ("dst", "buffer"),
    ("src_at", RowAddressing(units=64, planes=LAYERS, row_bytes=14, per_page=1,
                             page_stride=14, unit_stride=14, plane_stride=64 * 14)),
])
def test_copy_rows_rejects_bad_arguments_and_writes_nothing(kernels: ModuleType,
                                                             argument: str,
                                                             bad: object) -> None:
    host, call = valid_call(kernels)
    before = host.kv.clone()
    call[argument] = bad
    with pytest.raises(SlotError) as raised:
        kernels.copy_rows(**call)
    assert raised.value.argument == argument
    assert same_bytes(host.kv, before)


def test_copy_rows_rejects_mismatched_rows(kernels: ModuleType) -> None:
    _, call = valid_call(kernels)
    other, other_host = make_pools("mha", "layer_first", 2)  # MHA rows: 6 half words, not 7
    before = other.kv.clone()
    call["dst"], call["dst_at"] = other.kv, kernels.PageCopier(other, other_host).addressing(
        by_pages=False)[0]
    with pytest.raises(SlotError) as raised:
        kernels.copy_rows(**call)
    assert raised.value.argument == "dst_at"
    assert same_bytes(other.kv, before)


def test_page_copier_rejects_pools_of_other_geometry(kernels: ModuleType) -> None:
    device, _ = make_pools("mha", "layer_first", 2)
    _, host = make_pools("mla", "layer_first", 2)
    with pytest.raises(SlotError) as raised:
        kernels.PageCopier(device, host)
    assert raised.value.argument == "host_pool"


# -- the tests can fail: bugs planted in private copies of the index math ------------------


def test_a_planted_in_page_off_by_one_in_the_kernel_is_caught(
        kernels: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's offset with a slot's place in its page off by one."""
    sys.modules.pop("triton_mutants", None)  # built now, interpreted like ``kernels``
    import triton_mutants

    check_d2h(kernels, "mha", "page_first", 2)  # passes before the plant
    monkeypatch.setattr(kernels, "_row_offset", triton_mutants.row_offset_in_page_off_by_one)
    with pytest.raises(AssertionError, match="d2h of"):
        check_d2h(kernels, "mha", "page_first", 2)


def test_a_planted_short_page_stride_is_caught(kernels: ModuleType,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``page_first`` addressing whose page stride is one slot row short: pages overlap
    (inside the buffer), which the whole-buffer comparison shows."""
    def short_stride(pool: HostKVPool, *, by_pages: bool) -> RowAddressing:
        at = host_addressing(pool, by_pages=by_pages)
        slot_row = at.row_bytes // (1 if at.per_page > 1 else pool.page_size)
        stride = at.page_stride - slot_row
        unit_stride = at.unit_stride if at.per_page > 1 else stride  # by pages: a unit is one
        return RowAddressing(at.units, at.planes, at.row_bytes, at.per_page, stride,
                             unit_stride, at.plane_stride)

    check_h2d_by_layer(kernels, "mla", "page_first", 2)
    monkeypatch.setattr(kernels, "host_addressing", short_stride)
    with pytest.raises(AssertionError, match="h2d layer"):
        check_h2d_by_layer(kernels, "mla", "page_first", 2)


# -- the kernel as a GPU gets it (compiled here, ahead of time: no GPU needed) --------------


def vector_accesses(kernels: ModuleType, *, index: str, block: int, warps: int,
                    aligned: bool) -> set[tuple[str, str]]:
    """The 16-byte global loads and stores in the PTX of the kernel compiled for sm_90
    (H100/H200) with ``index`` pointers; ``aligned``: buffers, indexes, strides and the
    row length marked divisible by 16, as Triton marks such arguments at a launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = ["src", "dst", "src_index", "dst_index", "src_per_page", "src_page_stride",
             "src_unit_stride", "src_plane_stride", "dst_per_page", "dst_page_stride",
             "dst_unit_stride", "dst_plane_stride", "first_plane", "row_words"]
    types = ["*i64", "*i64", index, index] + ["i32", "i64", "i64", "i64"] * 2 + ["i32", "i32"]
    marked = [i for i, name in enumerate(names)
              if aligned and name not in ("src_per_page", "dst_per_page", "first_plane")]
    source = ASTSource(fn=kernels._copy_rows_kernel,
                       signature={**dict(zip(names, types, strict=True)), "BLOCK": "constexpr"},
                       constexprs={"BLOCK": block},
                       attrs={(i,): [["tt.divisibility", 16]] for i in marked})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    return set(re.findall(r"(ld|st)\.global\.(v2\.b64|v4\.b32)", kernel.asm["ptx"]))


@pytest.fixture
def ptx_cache(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # not the user's ~/.triton
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # no float math here; no warning


@pytest.mark.usefixtures("ptx_cache")
@pytest.mark.parametrize(("index", "block", "warps"), [("*i64", 256, 4), ("*i32", 1024, 8)])
def test_the_kernel_compiles_for_sm90_and_moves_16_byte_vectors(
        compiled: ModuleType, index: str, block: int, warps: int) -> None:
    """Triton compiles the kernel for sm_90 with the ptxas its wheel ships (no GPU needed),
    so CI catches what the interpreter accepts but the compiler does not; and with the
    pools' aligned rows every row moves as 16-byte loads and stores, the widest a thread
    issues, which reading pinned host memory over PCIe in place needs to near ``copy_``."""
    assert vector_accesses(compiled, index=index, block=block, warps=warps,
                           aligned=True) in ({("ld", "v2.b64"), ("st", "v2.b64")},
                                             {("ld", "v4.b32"), ("st", "v4.b32")})


@pytest.mark.usefixtures("ptx_cache")
def test_the_vector_check_fails_on_unaligned_rows(compiled: ModuleType) -> None:
    """The same kernel without the alignment (a buffer or stride off by one word) gets
    no 16-byte access, which the test above would reject."""
    assert vector_accesses(compiled, index="*i64", block=256, warps=4,
                           aligned=False) == set()


# -- choosing the path (no Triton needed) ---------------------------------------------------


def test_addressing_rejects_impossible_geometry() -> None:
    with pytest.raises(SlotError) as raised:
        RowAddressing(units=6, planes=1, row_bytes=4, per_page=4, page_stride=64,
                      unit_stride=4, plane_stride=16)
    assert raised.value.argument == "units"
    with pytest.raises(SlotError) as raised:
        RowAddressing(units=8, planes=1, row_bytes=4, per_page=4, page_stride=12,
                      unit_stride=4, plane_stride=16)
    assert raised.value.argument == "page_stride"


def test_make_engine_copy_path_is_checked_and_cpu_has_no_triton_path() -> None:
    device, host = make_pools("mha", "layer_first", 2)
    with pytest.raises(SlotError) as raised:
        make_engine("cuda", device, host, copy_path="fast")  # type: ignore[arg-type]
    assert raised.value.argument == "copy_path"
    with pytest.raises(SlotError) as raised:
        make_engine("sync", device, host, copy_path="triton")
    assert raised.value.argument == "copy_path"
    with pytest.raises(SlotError) as raised:
        make_engine("cuda", device, host, copy_path="triton")  # a CPU device pool
    assert raised.value.argument == "copy_path" and "cannot run here" in raised.value.reason
    reason = load_copier(device, host)
    assert isinstance(reason, str) and ("triton" in reason or "cpu" in reason)
