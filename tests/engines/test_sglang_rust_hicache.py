"""SGLang 0.5.23's UnifiedRadixCache with HiCache on its Rust tree core against the model
(engine ``sglang-unified-rust-hicache``, spec/07r "The host tier").

Run from the 0.5.23 environment (``make sglang23-env``) with
``.venv-sglang23/bin/python -m pytest``.
Besides bounded differential runs and a fixed run through the whole host cycle, the host
tier's checks are shown to fail on a wrong model or a tampered engine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.differential import make_differential
from hiradix.conformance.machine import describe_difference
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix_model import Key, State
from hiradix_model.errors import IllegalChoice

ENGINE = "sglang-unified-rust-hicache"


@pytest.fixture(autouse=True)
def rust_tree_core() -> None:
    """Skip where SGLang is absent or not 0.5.23; otherwise the adapter must probe clean."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed here (make sglang23-env)")
    if importlib.metadata.version("sglang") != "0.5.23":
        pytest.skip("the Rust tree core ships with sglang 0.5.23")
    from hiradix.engines.sglang.rust_hicache import probe
    probe(ENGINE)  # EngineUnavailable here is a broken environment: the test fails


@pytest.fixture
def without_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter without its Python reference core: the hidden fields (DEV-R1) are the
    model's, and nothing is adopted."""
    from hiradix.engines.sglang.rust_hicache import SglangRustHicacheAdapter
    monkeypatch.setattr(SglangRustHicacheAdapter, "_reference", lambda self, scenario: None)


# The hidden fields come from the host reference core (spec/07r DEV-R1), so
# recency-ranked strategies run too; p2/priority on MLA is where the bounded run stopped
# before the reference (spec/07r, "The host tier's priority findings").
SCENARIOS = [Scenario(page_size=ps, eviction=strategy, kv_layout=kv)  # type: ignore[arg-type]
             for ps, strategy, kv in [(1, "lru", "mha"), (2, "priority", "mla"),
                                      (4, "fifo", "mha"), (2, "lfu", "mla"),
                                      (1, "mru", "mha")]]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_the_rust_core_with_hicache_refines_the_model(scenario: Scenario) -> None:
    current = settings()
    run_state_machine_as_test(make_differential(factory(ENGINE, scenario)), settings=settings(
        current, max_examples=max(1, current.max_examples // 15), derandomize=True,
        database=None))


def _cycled() -> Any:
    """A machine taken through the host cycle: four requests backed up and acknowledged,
    one lock kept, then a device eviction that leaves host-only pages."""
    machine = make_differential(factory(ENGINE, Scenario(page_size=1, eviction="fifo")))()
    machine.engine_refines_the_model()
    for tokens, keep in [((1, 2, 3, 4), False), ((1, 2, 5), True), ((3, 3, 3, 3), False),
                         ((4, 4, 4, 4), False)]:
        machine.request(tokens=tokens, namespace=None, dt=1, chunked=False, priority=0,
                        keep_lock=keep)
        machine.engine_refines_the_model()
        assert machine.model.pending, "write-through issued no backup"
        machine.writing_check()
        machine.engine_refines_the_model()
    machine.evict(num_tokens=4)
    machine.engine_refines_the_model()
    return machine


def _host_only(state: State) -> list[Key]:
    return sorted((k for k, p in state.pages.items() if p.device is None and p.host),
                  key=lambda k: (k.namespace or "", k.tokens))


def test_the_host_cycle_agrees() -> None:
    """Backup, acknowledgement, device eviction to host-only pages, a load back in
    flight, host eviction while it is, the load's acknowledgement, eviction of both tiers,
    reset: the engine agrees with the model after every step."""
    machine = _cycled()
    assert _host_only(machine.model), "no host-only page"
    machine.load_back(index=0)
    machine.engine_refines_the_model()
    assert any(t.direction == "h2d" for t in machine.model.pending), "no load in flight"
    machine.evict_host(num_tokens=4)
    machine.engine_refines_the_model()
    machine.loading_check()
    machine.engine_refines_the_model()
    machine.evict(num_tokens=6)
    machine.engine_refines_the_model()
    machine.evict_host(num_tokens=8)
    machine.engine_refines_the_model()
    machine.reset(go=0)
    machine.engine_refines_the_model()
    assert not machine.model.pages
    machine.teardown()


def _differs(machine: Any, wrong: State) -> None:
    _differs_from(machine, wrong)
    machine.teardown()


def _differs_from(machine: Any, wrong: State) -> None:
    """``_differs``, the machine kept for further steps."""
    seen = machine.engine.observe(wrong)
    assert seen == machine.model, describe_difference(seen, machine.model)
    assert seen != wrong


def test_wrong_host_slots_are_caught() -> None:
    machine = _cycled()
    a, b = _host_only(machine.model)[:2]
    pages = dict(machine.model.pages)
    pages[a], pages[b] = (replace(pages[a], host=pages[b].host),
                          replace(pages[b], host=pages[a].host))
    _differs(machine, replace(machine.model, pages=pages))


def test_wrong_free_host_slots_are_caught() -> None:
    machine = _cycled()
    free = sorted(machine.model.host_free)
    _differs(machine, replace(machine.model, host_free=frozenset(free[1:])))


def test_host_kv_bytes_the_engine_lost_are_caught() -> None:
    """A host-only page's KV overwritten in the host pool: its key cannot be read off
    its bytes any more, and observe refuses."""
    machine = _cycled()
    adapter = machine.engine
    slot = machine.model.pages[_host_only(machine.model)[0]].host[0]
    adapter.host.k_buffer[0][slot] += 1  # layer_first, MHA: [layer][token, ...]
    with pytest.raises(AssertionError, match="host KV nobody wrote"):
        adapter.observe(machine.model)
    machine.teardown()


def test_host_protect_comes_from_the_host_reference_core_not_the_model() -> None:
    """spec/07r DEV-R3: the Rust core shows no host lock, so ``host_protect`` is read off
    the reference core (DEV-22 mapped): a model page with a wrong value is reported, both
    on a page no load protects and on a page of a load in flight."""
    machine = _cycled()
    adapter = machine.engine
    assert "host_protect" in adapter.unobservable and "host_protect" in adapter.mapped
    key = _host_only(machine.model)[0]
    assert machine.model.pages[key].host_protect == 0
    pages = dict(machine.model.pages)
    pages[key] = replace(pages[key], host_protect=3)
    _differs_from(machine, replace(machine.model, pages=pages))
    # A load in flight: its chain is protected (DEV-5), read off the reference's lock on
    # the anchor (DEV-22); a model that forgot the protection is reported.
    machine.load_back(index=0)
    machine.engine_refines_the_model()
    loading = [k for k, p in machine.model.pages.items() if p.host_protect]
    assert loading, "the load in flight protects no page"
    assert adapter.reference is not None and adapter.reference.cache.ongoing_load_back
    pages = {k: replace(p, host_protect=0) for k, p in machine.model.pages.items()}
    _differs_from(machine, replace(machine.model, pages=pages))
    machine.teardown()


@pytest.mark.usefixtures("without_reference")
def test_without_the_reference_host_protect_is_the_models() -> None:
    machine = _cycled()
    adapter = machine.engine
    assert adapter.reference is None
    key = _host_only(machine.model)[0]
    pages = dict(machine.model.pages)
    pages[key] = replace(pages[key], host_protect=3)
    shifted = replace(machine.model, pages=pages)
    assert adapter.observe(shifted) == shifted
    machine.teardown()


def test_hidden_fields_come_from_the_host_reference_core_not_the_model() -> None:
    """spec/07r DEV-R1 on the host tier: hits, ticks and priority are the Python
    reference core's (given the same calls, host tier included), not the model's."""
    machine = _cycled()
    adapter = machine.engine
    assert adapter.reference is not None and "last_tick" in adapter.adopted
    pages = {k: replace(p, hits=p.hits + 5, last_tick=p.last_tick + 5, priority=7)
             for k, p in machine.model.pages.items()}
    shifted = replace(machine.model, pages=pages)
    assert adapter.observe(shifted) == machine.model != shifted
    machine.teardown()


def test_a_rust_core_that_parts_from_its_host_reference_is_caught() -> None:
    """A host eviction the reference core did not make: the two trees' host slots
    differ, and observe refuses (Parted)."""
    from hiradix.engines.sglang.rust_reference import Parted
    machine = _cycled()
    adapter = machine.engine
    assert adapter.cache.evict_host(2) > 0
    with pytest.raises(Parted, match="host slots"):
        adapter.observe(machine.model)
    machine.teardown()


# spec/07r "The host tier's priority findings": a random p2/priority (MLA) campaign's
# example, shrunk by removing steps. The last request's backup makes room on the host;
# SGLang's host eviction takes one node's pages, which the model, under its own stamps,
# cannot order as the strategy ranks them: the first is not a leaf then, or ranks above
# a leaf (one more load back). DEV-1 seen through DEV-R1.
def _host_victim_steps(extra_load: bool) -> list[tuple[str, dict[str, Any]]]:
    loads = [("load_back", dict(index=61))] if extra_load else []
    return [
        ("request", dict(chunked=False, dt=0, keep_lock=False, namespace="b", priority=0,
                         tokens=(3, 3, 3, 3, 2, 3, 1, 1, 3, 1))),
        ("reset", dict(go=0)),
        ("request", dict(chunked=True, dt=2, keep_lock=True, namespace=None, priority=2,
                         tokens=(2, 2, 1, 2, 2))),
        ("request_again", dict(evict_first=12, index=17)),
        ("request_again", dict(evict_first=7, index=26)),
        ("writing_check", dict()),
        ("request", dict(chunked=True, dt=0, keep_lock=False, namespace=None, priority=2,
                         tokens=(3, 2))),
        ("request", dict(chunked=True, dt=0, keep_lock=True, namespace=None, priority=0,
                         tokens=(2,))),
        *loads,
        ("load_back", dict(index=42)),
        ("loading_check", dict()),
        ("request", dict(chunked=True, dt=0, keep_lock=False, namespace="b", priority=0,
                         tokens=(1, 3, 3, 3, 2, 2, 3, 1, 2, 1, 1, 2, 2, 2))),
        ("request", dict(chunked=False, dt=0, keep_lock=False, namespace="b", priority=2,
                         tokens=(1, 2, 3, 2, 1))),
        ("request_again", dict(evict_first=3, index=50))]


HOST_VICTIM_FINDINGS = {
    "not-a-leaf": (False, r"backup\.host_victims\[0\]: Key\(tokens=\(3, 3\), "
                          r"namespace='b'\) is not an evictable leaf"),
    "rank": (True, r"backup\.host_victims\[0\]: Key\(tokens=\(3, 3, 3, 3, 2, 3, 1, 1, 3, 1\), "
                   r"namespace='b'\) ranks \(0, 8\) but a leaf ranks \(0, 6\)"),
}
P2_PRIORITY_MLA = Scenario(page_size=2, eviction="priority", kv_layout="mla")


def _run_steps(engine: str, steps: list[tuple[str, dict[str, Any]]]) -> Any:
    machine = make_differential(factory(engine, P2_PRIORITY_MLA))()
    machine.engine_refines_the_model()
    try:
        for rule, args in steps:
            getattr(machine, rule)(**args)
            machine.engine_refines_the_model()
    finally:
        machine.teardown()
    return machine


@pytest.mark.usefixtures("without_reference")
@pytest.mark.parametrize("finding", HOST_VICTIM_FINDINGS)
def test_dev_r1_p2_priority_host_victims_diverge_without_the_reference(finding: str) -> None:
    """Without the reference core the stamps are the model's, and the backup's host
    victims are reported, as the bounded run reported them before the reference."""
    extra_load, message = HOST_VICTIM_FINDINGS[finding]
    with pytest.raises(IllegalChoice, match=message):
        _run_steps(ENGINE, _host_victim_steps(extra_load))


@pytest.mark.parametrize("finding", HOST_VICTIM_FINDINGS)
def test_dev_r1_p2_priority_host_victims_agree_with_the_reference(finding: str) -> None:
    """With the stamps the Python reference core gave the same pages (it held the same
    pages, device and host slots and locks after every step), the host eviction, which
    takes the deepest page of namespace b, is one the model allows."""
    machine = _run_steps(ENGINE, _host_victim_steps(HOST_VICTIM_FINDINGS[finding][0]))
    victims = [k for step in machine.trace if step.op == "insert" and step.args["backup"]
               for k in step.args["backup"]["host_victims"]]  # type: ignore[index]
    deepest = {"tokens": [3, 3, 3, 3, 2, 3, 1, 1, 3, 1], "namespace": "b"}
    assert deepest in victims, victims


@pytest.mark.parametrize("finding", HOST_VICTIM_FINDINGS)
def test_dev_r1_p2_priority_host_victims_the_python_core_agrees(finding: str) -> None:
    """The same steps on the Python tree core (engine sglang-unified, which reads the
    stamps) agree with the model: the findings are DEV-1 seen through DEV-R1, not a
    Rust-core difference."""
    _run_steps("sglang-unified", _host_victim_steps(HOST_VICTIM_FINDINGS[finding][0]))
