"""Storage tier, page level: chained page hashes, the memory and file backends through a
real HostKVPool, file integrity and atomicity, a restart, and the controlled backend's
faults."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hiradix.device_pool import DeviceKVPool, KVLayout
from hiradix.errors import InvalidArgument
from hiradix.host_pool import HostKVPool, HostLayout
from hiradix.storage import (
    ControlledBackend,
    Fault,
    FileBackend,
    InjectedInterrupt,
    MemoryBackend,
    PageIdentity,
    StorageArgumentError,
    StorageBackend,
    StorageError,
    StorageMetrics,
    checksum,
    page_hashes,
)
from hiradix.storage.file import HEADER

P = 2  # page size
PAGES = 4
ROOT = Path(__file__).resolve().parents[2]


def host_pool(layout: HostLayout = "layer_first", kv: KVLayout = "mha",
              dtype: torch.dtype = torch.float32) -> HostKVPool:
    device = DeviceKVPool(num_slots=4 * P, page_size=P, layers=2, layout=kv, heads=2,
                          head_dim=3, latent_dim=5, dtype=dtype)
    return HostKVPool(device, num_slots=4 * PAGES * P, layout=layout)


def fill(pool: HostKVPool, slots: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Random (seeded, NaN-free) values into ``slots``; returns them."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(pool.value_shape(slots.numel()), generator=generator).to(pool.dtype)
    pool.write(slots, values)
    return values


def source_slots() -> torch.Tensor:
    return torch.arange(PAGES * P)


def target_slots() -> torch.Tensor:
    """Different slots, in another page order, than ``source_slots``."""
    pages = [7, 5, 6, 4][:PAGES]
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def hashes(count: int = PAGES, model: str = "m") -> list[str]:
    identity = PageIdentity(model=model, dtype="float32", layout="mha")
    return page_hashes(list(range(100, 100 + count * P)), P, identity, None)


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StorageBackend:
    if request.param == "memory":
        return MemoryBackend()
    return FileBackend(tmp_path / "store")


# -- page hashes ---------------------------------------------------------------------------

IDENTITY = PageIdentity(model="llama-3-8b@rev1", dtype="float16", layout="mha/layers=2")
tokens_st = st.lists(st.integers(0, 50_000), max_size=40)


def test_hashes_are_hex_digests_of_full_pages_only() -> None:
    result = page_hashes(list(range(9)), 4, IDENTITY, None)
    assert len(result) == 2
    assert all(len(h) == 64 and set(h) <= set("0123456789abcdef") for h in result)
    assert page_hashes(list(range(9)), 4, IDENTITY, None) == result  # deterministic
    assert page_hashes([1, 2, 3], 4, IDENTITY, None) == []


@given(tokens_st, st.integers(0, 40), st.sampled_from([1, 2, 4]))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens: list[int], cut: int,
                                                       page_size: int) -> None:
    whole = page_hashes(tokens, page_size, IDENTITY, "ns")
    prefix = page_hashes(tokens[:cut], page_size, IDENTITY, "ns")
    assert prefix == whole[:len(prefix)]
    assert len(prefix) == min(cut, len(tokens)) // page_size


@given(tokens_st, st.integers(0, 10), st.sampled_from([1, 2, 4]))
def test_hashing_in_two_pieces_through_parent_equals_hashing_whole(
        tokens: list[int], pages: int, page_size: int) -> None:
    cut = min(pages * page_size, len(tokens) - len(tokens) % page_size)
    head = page_hashes(tokens[:cut], page_size, IDENTITY, None)
    tail = page_hashes(tokens[cut:], page_size, IDENTITY, None,
                       parent=head[-1] if head else None)
    assert head + tail == page_hashes(tokens, page_size, IDENTITY, None)


def test_the_chain_covers_the_prefix() -> None:
    # The same second page after a different first page is a different page.
    one = page_hashes([1, 2, 9, 9], 2, IDENTITY, None)
    two = page_hashes([3, 4, 9, 9], 2, IDENTITY, None)
    assert one[1] != two[1]


@pytest.mark.parametrize("change", [
    {"identity": PageIdentity(model="other-model", dtype="float16", layout="mha/layers=2")},
    {"identity": PageIdentity(model="llama-3-8b@rev1", dtype="bfloat16",
                              layout="mha/layers=2")},
    {"identity": PageIdentity(model="llama-3-8b@rev1", dtype="float16",
                              layout="mla/layers=2")},
    {"namespace": ""},
    {"namespace": "tenant-a"},
])
def test_namespace_dtype_layout_and_model_each_change_every_hash(
        change: dict[str, object]) -> None:
    tokens = list(range(12))
    base = page_hashes(tokens, 2, IDENTITY, None)
    arguments: dict[str, object] = {"identity": IDENTITY, "namespace": None, **change}
    changed = page_hashes(tokens, 2, **arguments)  # type: ignore[arg-type]
    assert not set(base) & set(changed)


def test_identity_for_pool_covers_dtype_and_geometry_not_host_layout() -> None:
    identity = PageIdentity.for_pool(host_pool(), "m")
    assert identity == PageIdentity.for_pool(host_pool("page_first"), "m")
    assert identity != PageIdentity.for_pool(host_pool(dtype=torch.float16), "m")
    assert identity != PageIdentity.for_pool(host_pool(kv="mla"), "m")
    assert identity != PageIdentity.for_pool(host_pool(), "n")


@pytest.mark.parametrize(("arguments", "argument"), [
    ({"tokens": "abcd"}, "tokens"),
    ({"tokens": [1, True]}, "tokens"),
    ({"tokens": [1, 2.0]}, "tokens"),
    ({"tokens": [2 ** 63]}, "tokens"),
    ({"page_size": 0}, "page_size"),
    ({"page_size": True}, "page_size"),
    ({"identity": ("m", "f16", "mha")}, "identity"),
    ({"namespace": 3}, "namespace"),
    ({"parent": "xyz"}, "parent"),
    ({"parent": "A" * 64}, "parent"),
])
def test_bad_hash_arguments_are_typed_errors(arguments: dict[str, object],
                                             argument: str) -> None:
    call: dict[str, object] = {"tokens": [1, 2], "page_size": 2, "identity": IDENTITY,
                               "namespace": None, **arguments}
    with pytest.raises(StorageArgumentError) as raised:
        page_hashes(**call)  # type: ignore[arg-type]
    assert raised.value.argument == argument


@pytest.mark.parametrize("field", ["model", "dtype", "layout"])
def test_page_identity_fields_must_be_non_empty_strings(field: str) -> None:
    values: dict[str, object] = {"model": "m", "dtype": "f", "layout": "l", field: ""}
    with pytest.raises(StorageArgumentError, match=field):
        PageIdentity(**values)  # type: ignore[arg-type]


# -- round trips through a real host pool --------------------------------------------------


@pytest.mark.parametrize("layouts", [("layer_first", "page_first"),
                                     ("page_first", "layer_first")])
@pytest.mark.parametrize("kv", ["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_byte_equal(backend: StorageBackend, layouts: tuple[HostLayout, ...],
                                  kv: KVLayout, dtype: torch.dtype) -> None:
    writer, reader = host_pool(layouts[0], kv, dtype), host_pool(layouts[1], kv, dtype)
    written = fill(writer, source_slots())
    names = hashes()
    assert backend.set(names, writer, source_slots()) == PAGES
    assert backend.exists(names) == PAGES
    assert backend.get(names, reader, target_slots()) == PAGES
    assert torch.equal(reader.read(target_slots()).view(torch.uint8),
                       written.view(torch.uint8))
    assert backend.metrics == StorageMetrics(
        pages_prefetched=PAGES, tokens_prefetched=PAGES * P, pages_backed_up=PAGES,
        tokens_backed_up=PAGES * P, hits=PAGES)


def test_counts_are_leading_runs(backend: StorageBackend) -> None:
    pool = host_pool()
    fill(pool, source_slots())
    names = hashes()
    for page in (0, 1, 3):  # page 2 missing
        assert backend.set(names[page:page + 1], pool, source_slots()[page * P:(page + 1) * P])
    assert backend.exists(names) == 2
    assert backend.exists(names[3:]) == 1
    assert backend.get(names, pool, target_slots()) == 2
    assert backend.metrics.misses == 2 and backend.metrics.hits == 3


def test_set_counts_present_pages_as_done_without_rewriting(backend: StorageBackend) -> None:
    pool = host_pool()
    fill(pool, source_slots())
    names = hashes()
    assert backend.set(names[:2], pool, source_slots()[:2 * P]) == 2
    assert backend.set(names, pool, source_slots()) == PAGES
    assert backend.metrics.pages_backed_up == PAGES


def test_clear_forgets_every_page(backend: StorageBackend) -> None:
    pool = host_pool()
    fill(pool, source_slots())
    backend.set(hashes(), pool, source_slots())
    backend.clear()
    assert backend.exists(hashes()) == 0
    assert backend.get(hashes(), pool, target_slots()) == 0


def test_empty_batches_do_nothing(backend: StorageBackend) -> None:
    pool = host_pool()
    empty = torch.empty(0, dtype=torch.int64)
    assert backend.exists([]) == 0
    assert backend.set([], pool, empty) == 0
    assert backend.get([], pool, empty) == 0


@pytest.mark.parametrize(("call", "argument"), [
    (lambda b, pool: b.set(hashes(), pool, source_slots()[:-1]), "host_slots"),
    (lambda b, pool: b.set(hashes(), pool, source_slots().to(torch.int32)), "host_slots"),
    (lambda b, pool: b.set(hashes(), pool, source_slots() + 1000), "host_slots"),
    (lambda b, pool: b.get(hashes(), pool, torch.zeros(PAGES * P, dtype=torch.int64)),
     "host_slots"),
    (lambda b, pool: b.set(hashes(), "pool", source_slots()), "host_pool"),
    (lambda b, pool: b.set(["zz" * 32], pool, source_slots()[:P]), "hashes[0]"),
    (lambda b, pool: b.exists("ab" * 32), "hashes"),
])
def test_bad_batch_arguments_are_typed_errors_with_no_effect(
        backend: StorageBackend, call: object, argument: str) -> None:
    pool = host_pool()
    fill(pool, source_slots())
    with pytest.raises(InvalidArgument) as raised:
        call(backend, pool)  # type: ignore[operator]
    assert raised.value.argument == argument
    assert backend.exists(hashes()) == 0
    assert backend.metrics == StorageMetrics(misses=1)  # from the exists just above


# -- the file backend: integrity, atomicity, restart ---------------------------------------


def stored(tmp_path: Path, count: int = 1) -> tuple[FileBackend, HostKVPool, list[str]]:
    backend = FileBackend(tmp_path / "store")
    pool = host_pool()
    fill(pool, source_slots())
    names = hashes(count)
    assert backend.set(names, pool, source_slots()[:count * P]) == count
    return backend, pool, names


def assert_corrupt_miss(backend: FileBackend, pool: HostKVPool, name: str) -> None:
    before = pool.read(target_slots()[:P])
    corrupt = backend.metrics.corrupt
    assert backend.get([name], pool, target_slots()[:P]) == 0
    assert backend.metrics.corrupt == corrupt + 1
    assert torch.equal(pool.read(target_slots()[:P]), before)  # nothing written
    assert not backend.path_of(name).exists()  # discarded, so a backup can store it again


@pytest.mark.parametrize("region", ["magic", "version", "length", "hash", "checksum",
                                    "payload", "last"])
def test_a_flipped_byte_anywhere_is_a_corrupt_miss(tmp_path: Path, region: str) -> None:
    backend, pool, names = stored(tmp_path)
    offset = {"magic": 0, "version": 8, "length": 12, "hash": 20, "checksum": 52,
              "payload": HEADER.size, "last": -1}[region]
    path = backend.path_of(names[0])
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert_corrupt_miss(backend, pool, names[0])


def test_truncated_or_extended_files_are_corrupt(tmp_path: Path) -> None:
    backend, pool, names = stored(tmp_path)
    path = backend.path_of(names[0])
    data = path.read_bytes()
    for damaged in (data[:-1], data[:HEADER.size], data[:10], b"", data + b"\x00"):
        path.write_bytes(damaged)
        assert not backend.has_page(names[0])
        assert_corrupt_miss(backend, pool, names[0])


def test_a_page_file_under_another_hash_is_corrupt(tmp_path: Path) -> None:
    backend, pool, names = stored(tmp_path, count=2)
    backend.path_of(names[1]).write_bytes(backend.path_of(names[0]).read_bytes())
    assert not backend.has_page(names[1])
    assert_corrupt_miss(backend, pool, names[1])


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_misdirected_write_is_a_miss_never_wrong_data(tmp_path: Path, kind: str) -> None:
    """#12: page 2's bytes and checksum stored under page 1's name (a backend bug that
    mixes up names). Before, the checksum covered the bytes only and the get returned
    page 2's KV as page 1's; now it covers the hash, so the entry is a corrupt miss."""
    backend: StorageBackend = (MemoryBackend() if kind == "memory"
                               else FileBackend(tmp_path / "store"))
    pool = host_pool()
    fill(pool, source_slots())
    names = hashes(2)
    assert backend.set(names[1:], pool, source_slots()[P:2 * P]) == 1
    second = backend.read_page(names[1])
    assert second.status == "hit"
    backend.write_page(names[0], second.payload, second.checksum)  # under the wrong name
    before = pool.read(target_slots()[:P])
    assert backend.get(names[:1], pool, target_slots()[:P]) == 0
    assert backend.metrics.corrupt == 1
    assert torch.equal(pool.read(target_slots()[:P]), before)  # no byte was taken
    assert not backend.has_page(names[0])  # discarded
    assert backend.get(names[1:], pool, target_slots()[:P]) == 1  # page 2 is intact


def test_the_checksum_covers_the_page_hash() -> None:
    payload = b"kv bytes"
    first, second = hashes(2)
    assert checksum(payload, first) != checksum(payload, second)
    assert len(checksum(payload, first)) == 32
    with pytest.raises(StorageArgumentError) as caught:
        checksum(payload, "../x")
    assert caught.value.argument == "page_hash"


def test_a_version_1_page_file_is_a_corrupt_miss_then_rewritten(tmp_path: Path) -> None:
    """Files written before the checksum covered the hash (format version 1) are never
    read as data: a miss, and the next backup writes the page again."""
    backend, pool, names = stored(tmp_path)
    path = backend.path_of(names[0])
    data = bytearray(path.read_bytes())
    data[8:12] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert_corrupt_miss(backend, pool, names[0])
    assert backend.set(names, pool, source_slots()[:P]) == 1
    assert backend.get(names, pool, target_slots()[:P]) == 1


BAD_HASHES = ["../x", "../../etc/passwd", "/tmp/x", "ab/../../x", "0" * 63, "A" * 64, "",
              "0" * 62 + "/x", 7, None, b"0" * 64]


@pytest.mark.parametrize("bad", BAD_HASHES, ids=repr)
@pytest.mark.parametrize("primitive", ["has_page", "read_page", "discard_page",
                                       "write_page", "path_of"])
def test_every_file_primitive_rejects_a_bad_page_hash_and_touches_nothing(
        tmp_path: Path, bad: object, primitive: str) -> None:
    """#12: before, ``discard_page("../x")`` unlinked ``<root>/../x.page`` (outside the
    root) and ``write_page`` could create files there; now every primitive checks the
    hash first (StorageArgumentError naming ``page_hash``)."""
    root = tmp_path / "store"
    backend = FileBackend(root)
    victim = tmp_path / "x.page"  # what "../x" named before
    victim.write_bytes(b"keep me")
    before = sorted(tmp_path.rglob("*"))
    arguments: tuple[object, ...] = (bad,)
    if primitive == "write_page":
        arguments = (bad, b"payload", b"\x00" * 32)
    with pytest.raises(StorageArgumentError) as caught:
        getattr(backend, primitive)(*arguments)
    assert caught.value.argument == "page_hash"
    assert sorted(tmp_path.rglob("*")) == before and victim.read_bytes() == b"keep me"


@pytest.mark.parametrize("primitive", ["has_page", "read_page", "discard_page", "write_page"])
def test_every_memory_primitive_rejects_a_bad_page_hash(primitive: str) -> None:
    backend = MemoryBackend()
    arguments: tuple[object, ...] = ("../x",)
    if primitive == "write_page":
        arguments = ("../x", b"payload", b"\x00" * 32)
    with pytest.raises(StorageArgumentError) as caught:
        getattr(backend, primitive)(*arguments)
    assert caught.value.argument == "page_hash" and len(backend) == 0


@pytest.mark.parametrize(("payload", "page_checksum", "argument"), [
    ("text", b"\x00" * 32, "payload"), (None, b"\x00" * 32, "payload"),
    (b"payload", b"\x00" * 31, "page_checksum"), (b"payload", "0" * 32, "page_checksum"),
])
def test_write_page_checks_its_payload_and_checksum(backend: StorageBackend, payload: object,
                                                    page_checksum: object,
                                                    argument: str) -> None:
    with pytest.raises(StorageArgumentError) as caught:
        backend.write_page(hashes(1)[0], payload, page_checksum)  # type: ignore[arg-type]
    assert caught.value.argument == argument
    assert not backend.has_page(hashes(1)[0])


def test_a_corrupt_page_is_stored_again_by_the_next_backup(tmp_path: Path) -> None:
    backend, pool, names = stored(tmp_path)
    path = backend.path_of(names[0])
    path.write_bytes(path.read_bytes()[:-3])
    assert backend.get(names, pool, target_slots()[:P]) == 0
    assert backend.set(names, pool, source_slots()[:P]) == 1
    assert backend.get(names, pool, target_slots()[:P]) == 1
    assert torch.equal(pool.read(target_slots()[:P]), pool.read(source_slots()[:P]))


@given(st.data())
def test_any_damage_to_a_page_file_is_a_miss(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as directory:
        backend, pool, names = stored(Path(directory))
        path = backend.path_of(names[0])
        original = path.read_bytes()
        offset = data.draw(st.integers(0, len(original) - 1), label="offset")
        mask = data.draw(st.integers(1, 255), label="xor mask")
        damaged = bytearray(original)
        damaged[offset] ^= mask
        path.write_bytes(bytes(damaged))
        assert_corrupt_miss(backend, pool, names[0])


def test_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    backend, _, _ = stored(tmp_path, count=PAGES)
    assert len(backend.page_files()) == PAGES
    assert backend.temp_files() == []
    assert not [p for p in backend.root.rglob("*") if p.is_file() and p.suffix != ".page"]


def test_a_failed_write_leaves_neither_page_nor_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FileBackend(tmp_path / "store")
    pool = host_pool()
    fill(pool, source_slots())

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageError) as raised:
        backend.set(hashes(), pool, source_slots())
    assert raised.value.pages_done == 0 and "No space left" in str(raised.value)
    assert backend.page_files() == [] and backend.temp_files() == []
    assert backend.metrics.errors == 1


def test_clear_removes_pages_and_leaves_other_files(tmp_path: Path) -> None:
    backend, _, _ = stored(tmp_path, count=2)
    (backend.root / "README").write_text("not a page")
    (backend.root / backend.path_of(hashes()[0]).parent.name / "x.tmp").write_text("")
    backend.clear()
    assert backend.page_files() == [] and backend.temp_files() == []
    assert (backend.root / "README").exists()


def test_root_must_be_a_directory_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for root, argument in ((tmp_path / "file", "root"), ("", "root"), (3, "root")):
        with pytest.raises(StorageArgumentError) as raised:
            FileBackend(root)  # type: ignore[arg-type]
        assert raised.value.argument == argument


WRITER = textwrap.dedent("""
    import sys, torch
    from hiradix.device_pool import DeviceKVPool
    from hiradix.host_pool import HostKVPool
    from hiradix.storage import FileBackend, PageIdentity, page_hashes
    device = DeviceKVPool(num_slots=8, page_size=2, layers=2, heads=2, head_dim=3,
                          dtype=torch.float32)
    host = HostKVPool(device, num_slots=8, layout="page_first")
    slots = torch.arange(8)
    values = torch.randn(host.value_shape(8), generator=torch.Generator().manual_seed(7))
    host.write(slots, values)
    names = page_hashes(list(range(8)), 2, PageIdentity.for_pool(host, "m"), "ns")
    assert FileBackend(sys.argv[1]).set(names, host, slots) == 4
""")


def test_pages_survive_a_process_restart(tmp_path: Path) -> None:
    root = tmp_path / "store"
    subprocess.run([sys.executable, "-c", WRITER, str(root)], check=True, cwd=ROOT,
                   timeout=120)
    pool = host_pool()  # a new process's pool: same geometry, other host layout
    names = page_hashes(list(range(8)), 2, PageIdentity.for_pool(pool, "m"), "ns")
    backend = FileBackend(root)
    assert backend.exists(names) == 4
    assert backend.get(names, pool, target_slots()) == 4
    expected = torch.randn(pool.value_shape(8), generator=torch.Generator().manual_seed(7))
    assert torch.equal(pool.read(target_slots()), expected)


# -- the controlled backend ----------------------------------------------------------------


def controlled() -> tuple[ControlledBackend, HostKVPool, list[str]]:
    backend = ControlledBackend(MemoryBackend())
    pool = host_pool()
    fill(pool, source_slots())
    names = hashes()
    assert backend.set(names, pool, source_slots()) == PAGES
    return backend, pool, names


def leading_pages_equal(pool: HostKVPool, count: int) -> bool:
    got = pool.read(target_slots()[:count * P])
    return torch.equal(got, pool.read(source_slots()[:count * P]))


def rest_is_nan(pool: HostKVPool, count: int) -> bool:
    return bool(pool.read(target_slots()[count * P:]).isnan().all())


def test_controlled_without_faults_passes_through() -> None:
    backend, pool, names = controlled()
    assert backend.exists(names) == PAGES
    assert backend.get(names, pool, target_slots()) == PAGES
    assert leading_pages_equal(pool, PAGES)


def test_raise_fails_before_any_page() -> None:
    backend, pool, names = controlled()
    backend.inject("get", "raise")
    with pytest.raises(StorageError) as raised:
        backend.get(names, pool, target_slots())
    assert raised.value.pages_done == 0 and raised.value.backend == "controlled"
    assert rest_is_nan(pool, 0)
    assert backend.metrics.errors == 1
    assert backend.get(names, pool, target_slots()) == PAGES  # one fault, one call


def test_die_fails_after_some_pages() -> None:
    backend, pool, names = controlled()
    backend.inject("get", Fault("die", at_page=2))
    with pytest.raises(StorageError) as raised:
        backend.get(names, pool, target_slots())
    assert raised.value.pages_done == 2
    assert leading_pages_equal(pool, 2) and rest_is_nan(pool, 2)


def test_die_on_set_stores_the_pages_before_it() -> None:
    backend = ControlledBackend(MemoryBackend())
    pool = host_pool()
    fill(pool, source_slots())
    backend.inject("set", Fault("die", at_page=3))
    with pytest.raises(StorageError) as raised:
        backend.set(hashes(), pool, source_slots())
    assert raised.value.pages_done == 3
    assert backend.exists(hashes()) == 3


def test_short_returns_fewer_pages_without_error() -> None:
    backend, pool, names = controlled()
    backend.inject("get", Fault("short", at_page=1))
    backend.inject("exists", Fault("short", at_page=3))
    assert backend.exists(names) == 3
    assert backend.get(names, pool, target_slots()) == 1
    assert leading_pages_equal(pool, 1) and rest_is_nan(pool, 1)
    assert backend.metrics.misses == 0 and backend.metrics.errors == 0


def test_corrupt_bytes_on_get_are_never_data() -> None:
    backend, pool, names = controlled()
    backend.inject("get", Fault("corrupt", at_page=1))
    assert backend.get(names, pool, target_slots()) == 1
    assert leading_pages_equal(pool, 1) and rest_is_nan(pool, 1)
    assert backend.metrics.corrupt == 1
    assert backend.exists(names) == 1  # the damaged page was discarded


def test_corrupt_bytes_stored_by_set_are_caught_on_get() -> None:
    backend = ControlledBackend(MemoryBackend())
    pool = host_pool()
    fill(pool, source_slots())
    backend.inject("set", Fault("corrupt", at_page=2))
    assert backend.set(hashes(), pool, source_slots()) == PAGES  # silent, like a bad disk
    assert backend.get(hashes(), pool, target_slots()) == 2
    assert backend.metrics.corrupt == 1 and leading_pages_equal(pool, 2)


def test_slow_holds_a_page_until_released() -> None:
    backend, pool, names = controlled()
    backend.inject("get", Fault("slow", at_page=1))
    outcome: list[int] = []
    worker = threading.Thread(target=lambda: outcome.append(
        backend.get(names, pool, target_slots())))
    worker.start()
    assert backend.wait_held()
    assert outcome == [] and backend.held == 1
    backend.release()
    worker.join(timeout=30)
    assert not worker.is_alive() and outcome == [PAGES]
    assert leading_pages_equal(pool, PAGES)


def test_a_slow_page_never_released_fails_instead_of_hanging() -> None:
    backend = ControlledBackend(MemoryBackend(), hold_timeout_s=0.01)
    backend.inject("exists", "slow")
    with pytest.raises(StorageError, match="not released"):
        backend.exists(hashes())


def test_faults_are_taken_one_per_call_in_order() -> None:
    backend, _, names = controlled()
    backend.inject("exists", "ok", "raise")
    assert backend.queued_faults("exists") == 2
    assert backend.exists(names) == PAGES
    with pytest.raises(StorageError):
        backend.exists(names)
    assert backend.queued_faults("exists") == 0


@pytest.mark.parametrize(("make", "argument"), [
    (lambda: Fault("explode"), "kind"),  # type: ignore[arg-type]
    (lambda: Fault("raise", at_page=1), "at_page"),
    (lambda: Fault("die", at_page=0), "at_page"),
    (lambda: Fault("short", at_page=-1), "at_page"),
    (lambda: ControlledBackend(MemoryBackend()).inject("exists", "corrupt"), "faults"),
    (lambda: ControlledBackend(MemoryBackend()).inject(
        "delete", "ok"), "operation"),  # type: ignore[arg-type]
    (lambda: ControlledBackend("memory"), "inner"),  # type: ignore[arg-type]
    (lambda: ControlledBackend(MemoryBackend(), hold_timeout_s=0), "hold_timeout_s"),
])
def test_bad_fault_arguments_are_typed_errors(make: object, argument: str) -> None:
    with pytest.raises(StorageArgumentError) as raised:
        make()  # type: ignore[operator]
    assert raised.value.argument == argument


FOREIGN_KINDS = ["runtime_error", "os_error", "memory_error"]


@pytest.mark.parametrize("kind", FOREIGN_KINDS)
@pytest.mark.parametrize("operation", ["exists", "get", "set"])
@pytest.mark.parametrize("at_page", [0, 2])
def test_a_foreign_exception_is_restated_as_a_storage_error(kind: str, operation: str,
                                                            at_page: int) -> None:
    """#17: RuntimeError, OSError or MemoryError out of a backend call reaches the caller
    as a StorageError with the leading pages done before it (as ``raise``/``die``)."""
    backend, pool, names = controlled()
    backend.inject(operation, Fault(kind, at_page))  # type: ignore[arg-type]
    call = {"exists": lambda: backend.exists(names),
            "get": lambda: backend.get(names, pool, target_slots()),
            "set": lambda: backend.set(hashes(PAGES, "other"), pool, source_slots())}
    with pytest.raises(StorageError) as raised:
        call[operation]()
    assert raised.value.pages_done == at_page and kind.split("_")[0] in str(raised.value).lower()
    assert backend.metrics.errors == 1
    if operation == "get":
        assert leading_pages_equal(pool, at_page) and rest_is_nan(pool, at_page)
    if operation == "set":
        assert backend.exists(hashes(PAGES, "other")) == at_page
    assert call[operation]() == PAGES  # one fault, one call


@pytest.mark.parametrize("operation", ["exists", "get", "set"])
def test_an_interrupt_goes_through_a_backend_call_unchanged(operation: str) -> None:
    backend, pool, names = controlled()
    backend.inject(operation, Fault("interrupt", 1))
    call = {"exists": lambda: backend.exists(names),
            "get": lambda: backend.get(names, pool, target_slots()),
            "set": lambda: backend.set(hashes(PAGES, "other"), pool, source_slots())}
    with pytest.raises(InjectedInterrupt):
        call[operation]()
    assert backend.metrics.errors == 1
    if operation == "get":
        assert rest_is_nan(pool, 0)  # an interrupt says nothing of the pages done
    assert call[operation]() == PAGES
