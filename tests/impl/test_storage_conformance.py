"""The storage tier refines the model (spec/09): the storage conformance machine under
the Hypothesis profile, with faults injected into the backend; faults are tallied here."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.coverage import THREADED_IO_STEP
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.storage_machine import make_storage_machine
from hiradix.conformance.tally import Tally
from hiradix.storage import ControlledBackend, MemoryBackend, StorageError
from hiradix.storage.hashing import page_hashes
from hiradix.storage.io import StorageIO
from hiradix_model import Key

from stats import SUMMARY

SCENARIOS = [
    Scenario(),
    Scenario(write_policy="write_through_selective", page_size=1, host_pages=10),
    Scenario(write_policy="write_back", host_pages=6),
]
FAULTS: Counter[str] = Counter()
TALLY = Tally()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_storage_tier_refines_the_model(scenario: Scenario) -> None:
    current = settings()
    machine = make_storage_machine(scenario, TALLY, FAULTS)
    run_state_machine_as_test(machine, settings=settings(
        current, max_examples=max(1, current.max_examples // 2),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert TALLY.examples > 0 and TALLY.checks > 0


def test_the_runs_exercised_storage_and_faults() -> None:
    """After the machine runs (same module, run in order): storage steps and faults."""
    if TALLY.examples == 0:
        pytest.skip("run with the conformance test")
    for name in ("attach_storage", "prefetch_from_storage", "check_prefetch_progress",
                 "io_prefetch_query", "drain_storage_queues",
                 "progress: timed out while the I/O ran"):
        assert TALLY.ops[name] > 0, (name, dict(TALLY.ops))
    assert sum(FAULTS.values()) > 0
    # Issue 17: foreign exceptions and interrupts reach the I/O, not only StorageErrors.
    for fault in ("get:runtime_error", "set:os_error", "interrupt:reached run_io"):
        assert FAULTS[fault] > 0, (fault, dict(FAULTS))
    # Issue 15: the rare states the swarm, the small hosts and the short timeouts reach.
    for state in ("host full", "host pages all protected", "prefetch in flight",
                  "storage write in flight", "branching host-only subtree", THREADED_IO_STEP):
        assert TALLY.states[state] > 0, (state, dict(TALLY.states))
    SUMMARY.append(f"impl storage conformance: {TALLY.examples} examples, {TALLY.steps} "
                   f"steps, {TALLY.checks} checks; faults "
                   f"{dict(sorted(FAULTS.items()))}; ops {dict(sorted(TALLY.ops.items()))}; "
                   f"states {dict(sorted(TALLY.states.items()))}; "
                   f"swarm {dict(sorted(TALLY.swarm.items()))}")


TOKENS = (1, 2, 3, 1, 2, 3, 1, 2)


@pytest.mark.parametrize("fault", ["corrupt", "short", "raise"])
def test_a_faulty_fetch_is_a_step_of_the_machine(fault: str) -> None:
    """One round trip, driven by hand, whose fetch takes ``fault`` at its first page: the
    machine reports it to the model as that fault and both agree afterwards (with
    ``corrupt``, the page is discarded on both sides)."""
    seen: Counter[str] = Counter()
    machine = make_storage_machine(Scenario(), None, seen)()
    machine.cycle(request="r0", index=0, evict=24, use_anchor=False, dt=0, run=True,
                  fresh=(TOKENS, None), fetch_fault=(fault, 0))
    machine.refines_the_model()
    assert seen[f"fetch reported:{fault}"] == 1, dict(seen)
    storage, identity = machine.model.storage, machine.tier.identity
    assert storage is not None and identity is not None
    first_page = Key(TOKENS[:2])
    first_hash = page_hashes(list(TOKENS[:2]), 2, identity, None)[0]
    kept = fault != "corrupt"  # a corrupt page is discarded, on both sides
    assert (storage.sid(first_page) in storage.stored) is kept
    assert machine.backend.inner.has_page(first_hash) is kept
    assert machine.backend.metrics.corrupt == (not kept)
    machine.teardown()


# A swarm seed that draws threaded I/O, the scenario's host, the best_effort policy with
# no threshold and no rule off (checked below, so that a change of the draws shows).
THREADED_SEED = 36


def threaded_machine(tally: Tally) -> object:
    machine = make_storage_machine(Scenario(), tally, Counter())()
    machine.swarm(seed=THREADED_SEED)
    assert machine.threaded and not machine.off, (machine.threaded, machine.off)
    assert machine.tier.io is not None and all(t.is_alive() for t in machine.tier.io.threads)
    return machine


def test_threaded_io_is_stepped_through_the_gate() -> None:
    """A round trip through storage on the I/O threads: every backend call waits at the
    gate until the machine lets it through, the results are reported as they come, the
    model agrees after every step, and teardown joins the threads."""
    tally = Tally()
    machine = threaded_machine(tally)
    machine.cycle(request="r0", index=0, evict=24, use_anchor=False, dt=0, run=True,
                  fresh=(TOKENS, None), fetch_fault=None)
    machine.refines_the_model()
    assert tally.ops["io_prefetch_fetch"] == 1 and tally.ops["io_storage_write"] >= 1, \
        dict(tally.ops)
    assert tally.states[THREADED_IO_STEP] >= 1, dict(tally.states)
    assert machine.tier.metrics.prefetch_tokens_inserted == len(TOKENS)
    threads = machine.tier.io.threads
    machine.teardown()
    assert not any(t.is_alive() for t in threads)


def test_threaded_reset_and_partial_runs_do_not_hang() -> None:
    """Writes left waiting at the gate, one result let through (``limit``), then reset
    with the rest still waiting: the waiting calls are refused, the old threads joined,
    and the model agrees after each step."""
    tally = Tally()
    machine = threaded_machine(tally)
    for tokens in (TOKENS, (2, 3, 1, 2, 3, 1)):
        machine.request(tokens, None, dt=0, chunked=False, priority=0, keep_lock=False,
                        quota=None)
        machine.refines_the_model()
    machine.writing_check()  # nothing acknowledged yet: the copies are in flight
    machine.finish_copies("d2h", 3)
    machine.writing_check()  # S-R1: the backups go to the gate
    machine.refines_the_model()
    assert machine.backend.waiting("set") == 1
    machine.run_io(limit=1)
    machine.refines_the_model()
    old = machine.tier.io
    machine.reset(0)
    machine.refines_the_model()
    assert not any(t.is_alive() for t in old.threads)
    assert machine.backend.waiting("set") == 0 and not machine.outstanding
    machine.teardown()


PAGE = "0" * 64


def test_a_call_never_let_through_fails_naming_the_wait() -> None:
    """The gate's safety net: a call from another thread that is never let through
    fails after the timeout, and a refused one at once; the closing thread's own calls
    pass."""
    backend = ControlledBackend(MemoryBackend())
    backend.close_gate(0.05)
    assert backend.exists([PAGE]) == 0  # this thread closed the gate: it passes
    errors: list[BaseException] = []

    def call() -> None:
        try:
            backend.exists([PAGE])
        except StorageError as error:
            errors.append(error)
    thread = threading.Thread(target=call)
    thread.start()
    thread.join(5)
    assert len(errors) == 1 and "not let through within 0.05 s" in str(errors[0]), errors
    backend.close_gate(5.0)
    thread = threading.Thread(target=call)
    thread.start()
    assert backend.wait_at_gate(["exists"], 5.0)
    backend.refuse(True)
    thread.join(5)
    assert len(errors) == 2 and "refused" in str(errors[1]), errors
    assert backend.waiting("exists") == 0


def interrupted_write(machine: Any) -> None:
    """A request served, its host copy acknowledged, its storage write queued (not run),
    then ``interrupt_io``: the write's batch call raises an interrupt at its first page."""
    machine.request(TOKENS, None, dt=0, chunked=False, priority=0, keep_lock=False,
                    quota=None)
    engine = machine.cache.engine
    engine.complete("d2h", engine.queued("d2h"))
    machine.writing_check()
    machine.refines_the_model()
    assert machine.io_pending() and not machine.threaded
    machine.interrupt_io()


def test_an_interrupted_write_still_gets_its_failed_result() -> None:
    """Issue 17: an interrupt (a BaseException, not an Exception) in a storage write is
    re-raised to the caller only after its operation's failed result was posted, so the
    write ends (nothing stored, its pages' protection released) as a raise would."""
    seen: Counter[str] = Counter()
    machine = make_storage_machine(Scenario(), None, seen)()
    interrupted_write(machine)
    machine.refines_the_model()
    assert seen["interrupt:reached run_io"] == 1 and seen["set:interrupt"] == 1, dict(seen)
    assert seen["write reported:raise"] == 1, dict(seen)
    assert not machine.io_pending()
    machine.drain()
    machine.refines_the_model()


def test_an_interrupt_that_skips_the_result_leaves_the_write_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps with _execute posting a result for Exceptions only (the bug the
    issue plants): the write never ends, which the test above would fail on."""
    def execute_exceptions_only(io: StorageIO, op: Any) -> None:
        try:
            result = io._prefetch(op) if op.kind == "prefetch" else io._backup(op)
        except Exception as error:
            io._finish(op, io._failed(op, io._failure(op, error)))
            return
        io._finish(op, result)

    monkeypatch.setattr(StorageIO, "_execute", execute_exceptions_only)
    seen: Counter[str] = Counter()
    machine = make_storage_machine(Scenario(), None, seen)()
    interrupted_write(machine)
    assert seen["interrupt:reached run_io"] == 1, dict(seen)
    assert seen["write reported:raise"] == 0 and machine.io_pending(), dict(seen)
