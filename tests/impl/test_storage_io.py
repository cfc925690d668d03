"""Storage tier, I/O layer: StorageIO's prefetch and backup, threaded and synchronous;
terminate, faults, shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from hiradix.device_pool import DeviceKVPool
from hiradix.errors import InvalidArgument
from hiradix.host_pool import HostKVPool
from hiradix.storage import (
    BackupResult,
    ControlledBackend,
    Fault,
    InjectedInterrupt,
    MemoryBackend,
    PageIdentity,
    PageRead,
    PrefetchResult,
    StorageArgumentError,
    StorageIO,
    page_hashes,
)

P = 2
PAGES = 4
WAIT_S = 30.0  # a safety net only: every wait returns as soon as its event happens


def host_pool() -> HostKVPool:
    device = DeviceKVPool(num_slots=4 * P, page_size=P, layers=2, heads=2, head_dim=2,
                          dtype=torch.float32)
    return HostKVPool(device, num_slots=3 * PAGES * P)


def slots(block: int, pages: int = PAGES) -> torch.Tensor:
    """The slots of ``pages`` pages in block ``block`` (blocks are PAGES pages apart)."""
    return torch.arange(block * PAGES * P, (block * PAGES + pages) * P)


NAMES = page_hashes(list(range(PAGES * P)), P, PageIdentity("m", "float32", "mha"), None)


def filled(pool: HostKVPool) -> torch.Tensor:
    values = torch.randn(pool.value_shape(PAGES * P), generator=torch.Generator().manual_seed(3))
    pool.write(slots(0), values)
    return values


def leading_equal(pool: HostKVPool, pages: int) -> bool:
    return torch.equal(pool.read(slots(1, pages)), pool.read(slots(0, pages)))


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "safety net: the condition never came"
        time.sleep(0.001)


@pytest.fixture
def pool() -> HostKVPool:
    return host_pool()


@pytest.fixture
def stored(pool: HostKVPool) -> ControlledBackend:
    """A controlled memory backend holding all PAGES pages of block 0."""
    backend = ControlledBackend(MemoryBackend())
    filled(pool)
    assert backend.set(NAMES, pool, slots(0)) == PAGES
    return backend


@pytest.fixture
def threaded(stored: ControlledBackend, pool: HostKVPool) -> Iterator[StorageIO]:
    io = StorageIO(stored, pool)
    yield io
    stored.release()  # nothing may stay held, or shutdown would wait for it
    io.shutdown()
    assert not any(thread.is_alive() for thread in io.threads)


@pytest.fixture
def synchronous(stored: ControlledBackend, pool: HostKVPool) -> StorageIO:
    return StorageIO(stored, pool, threaded=False)


# -- the happy paths -----------------------------------------------------------------------


def test_synchronous_mode_does_nothing_until_run_pending(pool: HostKVPool) -> None:
    backend = MemoryBackend()
    io = StorageIO(backend, pool, threaded=False)
    filled(pool)
    io.submit_backup("b", NAMES, slots(0))
    assert io.drain_backup() == [] and len(backend) == 0
    assert io.run_pending() == 1
    assert io.drain_backup() == [BackupResult("b", PAGES)]
    io.submit_prefetch(7, NAMES, slots(1))
    assert io.prefetch_progress(7) == 0
    assert io.run_pending() == 1
    assert io.drain_prefetch() == [PrefetchResult(7, PAGES, PAGES)]
    assert io.prefetch_progress(7) is None
    assert leading_equal(pool, PAGES)
    assert io.threads == ()


def test_threaded_backup_then_prefetch(pool: HostKVPool) -> None:
    filled(pool)
    with StorageIO(MemoryBackend(), pool, batch_pages=3) as io:
        io.submit_backup(1, NAMES, slots(0))
        assert io.wait_backup(WAIT_S) == BackupResult(1, PAGES)
        io.submit_prefetch(1, NAMES, slots(1))
        assert io.wait_prefetch(WAIT_S) == PrefetchResult(1, PAGES, PAGES)
        assert io.drain_prefetch() == [] and io.drain_backup() == []
    assert leading_equal(pool, PAGES)
    assert io.closed and not any(thread.is_alive() for thread in io.threads)


def test_prefetch_fetches_only_the_leading_hits(stored: ControlledBackend,
                                                synchronous: StorageIO,
                                                pool: HostKVPool) -> None:
    stored.discard_page(NAMES[2])
    synchronous.submit_prefetch("r", NAMES, slots(1))
    synchronous.run_pending()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", 2, 2)]
    assert leading_equal(pool, 2)


def test_too_few_hits_revoke_the_prefetch(stored: ControlledBackend,
                                          synchronous: StorageIO) -> None:
    stored.discard_page(NAMES[1])
    synchronous.submit_prefetch("r", NAMES, slots(1), min_pages=2)
    synchronous.run_pending()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", 1, 0, revoked=True)]
    assert stored.metrics.pages_prefetched == 0


def test_a_miss_during_the_fetch_ends_the_run(stored: ControlledBackend,
                                              synchronous: StorageIO,
                                              pool: HostKVPool) -> None:
    stored.inject("get", "ok", Fault("short", at_page=0))  # the second batch finds nothing
    synchronous.submit_prefetch("r", NAMES, slots(1))
    synchronous.run_pending()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", PAGES, 1)]
    assert leading_equal(pool, 1)


# -- terminate ---------------------------------------------------------------------------


def test_terminate_mid_prefetch_stops_at_the_next_page(stored: ControlledBackend,
                                                       threaded: StorageIO,
                                                       pool: HostKVPool) -> None:
    stored.inject("get", "ok", "ok", "slow")  # one page per call: page 2 is held
    threaded.submit_prefetch("r", NAMES, slots(1))
    assert stored.wait_held(timeout_s=WAIT_S)
    assert threaded.prefetch_progress("r") == 2
    assert threaded.terminate("r")
    stored.release()
    result = threaded.wait_prefetch(WAIT_S)
    assert result == PrefetchResult("r", PAGES, 3, terminated=True)  # page 2 was finished
    assert leading_equal(pool, 3)
    assert not threaded.terminate("r")  # done: nothing to stop


def test_terminate_from_inside_a_synchronous_run(pool: HostKVPool) -> None:
    class Terminating(MemoryBackend):
        """Terminates prefetch "r" while reading its second page."""

        io: StorageIO

        def read_page(self, page_hash: str) -> PageRead:
            if page_hash == NAMES[1]:
                assert self.io.terminate("r")
            return super().read_page(page_hash)

    backend = Terminating()
    filled(pool)
    backend.set(NAMES, pool, slots(0))
    io = backend.io = StorageIO(backend, pool, threaded=False)
    io.submit_prefetch("r", NAMES, slots(1))
    io.run_pending()
    assert io.drain_prefetch() == [PrefetchResult("r", PAGES, 2, terminated=True)]


def test_terminate_before_it_runs_fetches_nothing(synchronous: StorageIO,
                                                  stored: ControlledBackend) -> None:
    synchronous.submit_prefetch("r", NAMES, slots(1))
    assert synchronous.terminate("r")
    synchronous.run_pending()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", 0, 0, terminated=True)]
    assert stored.metrics.hits == 0  # not even the hit query was asked
    assert not synchronous.terminate("never submitted")


# -- faults --------------------------------------------------------------------------------


def test_a_failed_hit_query_is_reported(stored: ControlledBackend,
                                        synchronous: StorageIO) -> None:
    stored.inject("exists", "raise")
    synchronous.submit_prefetch("r", NAMES, slots(1))
    synchronous.run_pending()
    [result] = synchronous.drain_prefetch()
    assert (result.pages_hit, result.pages_done) == (0, 0)
    assert result.error is not None and result.error.operation == "exists"


def test_a_backend_dying_mid_batch_reports_the_pages_done(stored: ControlledBackend,
                                                          pool: HostKVPool) -> None:
    io = StorageIO(stored, pool, threaded=False, batch_pages=PAGES)
    stored.inject("get", Fault("die", at_page=3))
    io.submit_prefetch("r", NAMES, slots(1))
    io.run_pending()
    [result] = io.drain_prefetch()
    assert result.pages_done == 3 and result.error is not None
    assert result.error.pages_done == 3
    assert leading_equal(pool, 3)


def test_a_backup_dying_mid_run_reports_the_pages_stored(pool: HostKVPool) -> None:
    backend = ControlledBackend(MemoryBackend())
    filled(pool)
    io = StorageIO(backend, pool, threaded=False)
    backend.inject("set", "ok", "raise")  # one page per call: the second page fails
    io.submit_backup("b", NAMES, slots(0))
    io.run_pending()
    [result] = io.drain_backup()
    assert result.pages_done == 1 and result.error is not None
    assert backend.exists(NAMES) == 1


def test_corrupt_pages_end_the_prefetch_and_are_not_counted(stored: ControlledBackend,
                                                            synchronous: StorageIO,
                                                            pool: HostKVPool) -> None:
    stored.inject("get", "ok", "corrupt")
    synchronous.submit_prefetch("r", NAMES, slots(1))
    synchronous.run_pending()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", PAGES, 1, corrupt=True)]
    assert leading_equal(pool, 1)
    assert bool(pool.read(slots(1)[P:2 * P]).isnan().all())  # garbage, reported as no data
    assert stored.exists(NAMES) == 1  # the damaged page was discarded (DEV-S11)


def test_a_short_prefetch_is_not_reported_corrupt(stored: ControlledBackend,
                                                  synchronous: StorageIO) -> None:
    stored.inject("get", "ok", Fault("short", 0))  # the second batch returns nothing
    synchronous.submit_prefetch("r", NAMES, slots(1))
    synchronous.run_pending()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", PAGES, 1)]
    assert stored.exists(NAMES) == PAGES


def test_an_unexpected_error_still_gives_a_result_and_the_thread_lives_on(
        pool: HostKVPool) -> None:
    class Broken(MemoryBackend):
        def has_page(self, page_hash: str) -> bool:
            raise RuntimeError("bug in a backend")

    with StorageIO(Broken(), pool) as io:
        io.submit_prefetch("r", NAMES, slots(1))
        result = io.wait_prefetch(WAIT_S)
        assert result is not None and result.error is not None
        assert isinstance(result.error.__cause__, RuntimeError)
        io.submit_backup("b", [], torch.empty(0, dtype=torch.int64))
        assert io.wait_backup(WAIT_S) == BackupResult("b", 0)


def test_a_backup_reads_each_page_when_it_writes_it(stored: ControlledBackend,
                                                    threaded: StorageIO,
                                                    pool: HostKVPool) -> None:
    # Why host slots under backup must not change (INV-STORAGE-WRITE-PROTECT): a page
    # rewritten while the backup is held is stored with its new bytes.
    stored.clear()
    stored.inject("set", "ok", "slow")
    threaded.submit_backup("b", NAMES, slots(0))
    assert stored.wait_held(timeout_s=WAIT_S)
    pool.write(slots(0)[P:2 * P], torch.zeros(pool.value_shape(P)))
    stored.release()
    assert threaded.wait_backup(WAIT_S) == BackupResult("b", PAGES)
    assert stored.get(NAMES, pool, slots(1)) == PAGES
    assert torch.equal(pool.read(slots(1)[P:2 * P]), torch.zeros(pool.value_shape(P)))


# -- shutdown ------------------------------------------------------------------------------


def test_shutdown_is_idempotent_and_refuses_new_work(threaded: StorageIO) -> None:
    threaded.shutdown()
    threaded.shutdown()
    assert threaded.closed and not any(thread.is_alive() for thread in threaded.threads)
    with pytest.raises(StorageArgumentError, match="shut down"):
        threaded.submit_prefetch("late", NAMES, slots(1))


def test_shutdown_stops_running_and_queued_work(stored: ControlledBackend,
                                                pool: HostKVPool) -> None:
    io = StorageIO(stored, pool)
    stored.inject("get", "slow")
    io.submit_prefetch("running", NAMES, slots(1))
    assert stored.wait_held(timeout_s=WAIT_S)
    io.submit_prefetch("queued", NAMES, slots(2))
    stopper = threading.Thread(target=io.shutdown)
    stopper.start()
    wait_until(lambda: io.closed)
    stored.release()
    stopper.join(timeout=WAIT_S)
    assert not stopper.is_alive()
    assert not any(thread.is_alive() for thread in io.threads)
    assert io.drain_prefetch() == [PrefetchResult("running", PAGES, 1, terminated=True),
                                   PrefetchResult("queued", 0, 0, terminated=True)]


def test_synchronous_shutdown_ends_queued_work_as_terminated(synchronous: StorageIO) -> None:
    synchronous.submit_prefetch("r", NAMES, slots(1))
    synchronous.submit_backup("b", NAMES, slots(0))
    synchronous.shutdown()
    synchronous.shutdown()
    assert synchronous.drain_prefetch() == [PrefetchResult("r", 0, 0, terminated=True)]
    assert synchronous.drain_backup() == [BackupResult("b", 0, terminated=True)]
    assert synchronous.run_pending() == 0


# -- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "argument"), [
    (lambda io: io.submit_prefetch(1.5, NAMES, slots(1)), "op_id"),
    (lambda io: io.submit_prefetch(True, NAMES, slots(1)), "op_id"),
    (lambda io: io.submit_prefetch(1, NAMES, slots(1, PAGES - 1)), "host_slots"),
    (lambda io: io.submit_prefetch(1, NAMES, torch.zeros(PAGES * P, dtype=torch.int64)),
     "host_slots"),
    (lambda io: io.submit_prefetch(1, ["nope"], slots(1, 1)), "hashes[0]"),
    (lambda io: io.submit_prefetch(1, NAMES, slots(1), min_pages=-1), "min_pages"),
    (lambda io: io.submit_backup("b", NAMES, [0, 1]), "host_slots"),
    (lambda io: io.terminate(None), "op_id"),
])
def test_bad_submissions_are_typed_errors_and_queue_nothing(
        synchronous: StorageIO, call: Callable[[StorageIO], object], argument: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        call(synchronous)
    assert raised.value.argument == argument
    assert synchronous.run_pending() == 0


def test_an_op_id_is_reusable_once_its_result_is_out(synchronous: StorageIO) -> None:
    synchronous.submit_prefetch("r", NAMES, slots(1))
    with pytest.raises(StorageArgumentError, match="still running"):
        synchronous.submit_prefetch("r", NAMES, slots(2))
    synchronous.submit_backup("r", NAMES, slots(0))  # backups have their own ids
    assert synchronous.run_pending() == 2
    synchronous.submit_prefetch("r", NAMES, slots(2))
    assert synchronous.run_pending() == 1


def test_run_pending_is_for_synchronous_mode(threaded: StorageIO) -> None:
    with pytest.raises(StorageArgumentError) as raised:
        threaded.run_pending()
    assert raised.value.argument == "threaded"


@pytest.mark.parametrize(("arguments", "argument"), [
    ({"backend": "memory"}, "backend"),
    ({"host_pool": None}, "host_pool"),
    ({"threaded": 1}, "threaded"),
    ({"batch_pages": 0}, "batch_pages"),
])
def test_bad_constructor_arguments_are_typed_errors(pool: HostKVPool,
                                                    arguments: dict[str, object],
                                                    argument: str) -> None:
    call: dict[str, object] = {"backend": MemoryBackend(), "host_pool": pool, **arguments}
    with pytest.raises(StorageArgumentError) as raised:
        StorageIO(**call)  # type: ignore[arg-type]
    assert raised.value.argument == argument


# -- interrupts: every operation still gets its one result (#12, #17) ----------------------


def test_an_interrupt_in_run_pending_posts_the_result_then_reaches_the_caller(
        stored: ControlledBackend, synchronous: StorageIO) -> None:
    """Before, a BaseException escaped ``_execute`` with no result posted (the slots of
    the operation were held forever) and took the queued operations with it."""
    stored.inject("get", "ok", Fault("interrupt", 0))  # the second page's batch
    synchronous.submit_prefetch("p", NAMES, slots(1))
    synchronous.submit_backup("b", NAMES, slots(0))
    with pytest.raises(InjectedInterrupt):
        synchronous.run_pending()
    (result,) = synchronous.drain_prefetch()
    assert (result.op_id, result.pages_hit, result.pages_done) == ("p", PAGES, 1)
    assert result.error is not None and isinstance(result.error.__cause__, InjectedInterrupt)
    assert synchronous.prefetch_progress("p") is None  # no longer running: id reusable
    assert synchronous.drain_backup() == []  # still queued, not lost
    assert synchronous.run_pending() == 1
    assert synchronous.drain_backup() == [BackupResult("b", PAGES)]
    assert synchronous.dead("prefetch") is None  # no thread to die


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_interrupt_ends_the_thread_and_every_operation_still_gets_a_result(
        stored: ControlledBackend, threaded: StorageIO) -> None:
    stored.inject("get", "slow", Fault("interrupt", 0))
    threaded.submit_prefetch("a", NAMES, slots(1))
    assert stored.wait_held(timeout_s=WAIT_S)
    threaded.submit_prefetch("b", NAMES, slots(2))  # queued behind a
    stored.release()
    results = [threaded.wait_prefetch(WAIT_S) for _ in range(2)]
    assert [r.op_id for r in results if r is not None] == ["a", "b"]
    first, second = results
    assert first is not None and (first.pages_hit, first.pages_done) == (PAGES, 1)
    assert first.error is not None
    assert second is not None and second.pages_done == 0 and second.error is not None
    assert "died" in second.error.reason
    wait_until(lambda: not threaded.threads[0].is_alive())
    assert threaded.dead("prefetch") is not None and threaded.dead("backup") is None
    threaded.submit_prefetch("c", NAMES, slots(2))  # fails at once, with a result
    late = threaded.wait_prefetch(WAIT_S)
    assert late is not None and late.op_id == "c" and late.error is not None
    threaded.submit_backup("w", NAMES, slots(0))  # the other direction lives on
    assert threaded.wait_backup(WAIT_S) == BackupResult("w", PAGES)
    with pytest.raises(StorageArgumentError) as caught:
        threaded.dead("neither")  # type: ignore[arg-type]
    assert caught.value.argument == "kind"
