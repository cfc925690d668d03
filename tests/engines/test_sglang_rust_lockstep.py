"""spec/07r: campaign findings on SGLang 0.5.23's Rust tree core, checked against the
Python tree core by serving the same steps to both through ``UnifiedRadixCache``'s API
(``adapters/sglang_rust_lockstep.py``), and against the Python-core adapter, which reads
and adopts SGLang's stamps (DEV-1).

A finding is classified "DEV-1 seen through DEV-R1" when three things hold: the Rust-core
adapter without its reference core (the hidden fields the model's) reports it, both cores
keep the same slots after every step (so the Rust core evicts what the Python core
evicts), and the Python-core adapter passes the same steps. The Rust-core adapter with
its reference core (the default) then passes them too.

Run from the 0.5.23 environment (``make sglang23-env``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

import pytest

from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix.engines.sglang.rust_lockstep import Lockstep
from hiradix_model.errors import IllegalChoice


@pytest.fixture(autouse=True)
def both_tree_cores() -> None:
    """Skip where SGLang is absent or not 0.5.23; otherwise both cores must load."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed here (make sglang23-env)")
    if importlib.metadata.version("sglang") != "0.5.23":
        pytest.skip("the Rust tree core ships with sglang 0.5.23")
    from hiradix.engines.sglang.rust import probe
    probe("sglang-unified-rust")  # EngineUnavailable here is a broken environment

Step = tuple[str, dict[str, Any]]


def _request(tokens: tuple[int, ...], dt: int, *, chunked: bool = False, keep: bool = False,
             priority: int = 0, namespace: str | None = None) -> Step:
    return ("request", dict(tokens=tokens, dt=dt, chunked=chunked, keep_lock=keep,
                            priority=priority, namespace=namespace))


def _unlock(index: int) -> Step:
    return ("unlock", dict(index=index))


# spec/07r, p2/lfu: the campaign's example shrunk to seven steps.
P2_LFU: list[Step] = [
    _request((1, 1, 1, 2, 3, 2, 1, 2), 1, chunked=True, priority=2),
    _request((1, 1, 3), 0, chunked=True, keep=True, priority=2),
    _unlock(6),
    _request((3, 2, 2, 3), 2, namespace="b"),
    _request((3, 1, 3, 1, 2, 3, 3), 0, chunked=True),
    _request((3, 3), 1, chunked=True, keep=True, priority=2),
    _request((3, 1, 2), 1, priority=2),
]

# spec/07r, p1/lfu: a 60 s campaign's example (seed 1, 36 steps), shrunk by removing
# steps, tokens and flags one at a time while the Rust-core adapter still reported a
# victim ranked above a leaf: the last match splits (3, 2) at (3,), the split stamps
# (3, 2) (DEV-1), and (1,) goes where the model would take (3, 2).
P1_LFU: list[Step] = [
    _request((3, 2), 1), _request((1,), 1), _request((2,), 1),
    _request((3, 3), 1, namespace="b"), _request((3, 3), 1),
]


def _on_adapter(engine: str, scenario: Scenario, steps: list[Step]) -> str | None:
    """The differential machine on ``engine``: the IllegalChoice it reports, if any."""
    machine = make_differential(factory(engine, scenario))()
    try:
        machine.engine_refines_the_model()
        for rule, args in steps:
            getattr(machine, rule)(**args)
            machine.engine_refines_the_model()
    except IllegalChoice as found:
        return str(found)
    finally:
        machine.teardown()
    return None


def _cores_agree_throughout(scenario: Scenario, steps: list[Step]) -> int:
    """Both tree cores served ``steps``: the slots they keep, their free slots and
    totals agree after every step. Returns the tokens both evicted in all."""
    lockstep = Lockstep(scenario)
    try:
        for index, (rule, args) in enumerate(steps):
            getattr(lockstep, rule)(**{k: v for k, v in args.items() if k != "dt"})
            snapshots = lockstep.snapshots()
            assert lockstep.agree(), (index, rule, args, snapshots)
        return lockstep.evicted()
    finally:
        lockstep.close()


@pytest.mark.parametrize(("scenario", "steps", "victim"), [
    (Scenario(page_size=2, eviction="lfu"), P2_LFU, "Key(tokens=(3, 3)"),
    (Scenario(page_size=1, eviction="lfu"), P1_LFU, "Key(tokens=(1,)"),
], ids=["p2-lfu", "p1-lfu"])
def test_dev_r1_lfu_findings_are_dev_1_the_python_core_evicts_the_same(
        scenario: Scenario, steps: list[Step], victim: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """spec/07r: the p2/lfu and p1/lfu findings. The two cores keep the same slots after
    every step, evictions included; the Python-core adapter, which adopts SGLang's stamps
    (DEV-1), passes the same steps, and so does the Rust-core adapter reading the stamps
    off its reference core. Without the reference it reports the victim (the model, not
    knowing the split's stamp, ranks another leaf lower). So the Rust core evicts what
    the Python core evicts: DEV-1 seen through DEV-R1, not a Rust-core bug."""
    assert _on_adapter("sglang-unified-rust", scenario, steps) is None  # with the reference
    assert _cores_agree_throughout(scenario, steps) > 0, "no eviction: nothing was compared"
    assert _on_adapter("sglang-unified", scenario, steps) is None
    from hiradix.engines.sglang.rust import SglangRustAdapter
    monkeypatch.setattr(SglangRustAdapter, "_reference", lambda self, scenario: None)
    found = _on_adapter("sglang-unified-rust", scenario, steps)
    assert found is not None and found.startswith(f"victims[0]: {victim}"), found


def test_the_lockstep_sees_a_core_that_evicts_differently() -> None:
    """The comparison can fail: an eviction on the Rust side only parts the cores."""
    lockstep = Lockstep(Scenario(page_size=1, eviction="lru"))
    try:
        lockstep.request((1, 2, 3))
        lockstep.request((2, 3))
        assert lockstep.agree()
        lockstep.sides[1].cache.evict(lockstep.env.modules["base"].EvictParams(num_tokens=1))
        assert not lockstep.agree()
        python, rust = lockstep.snapshots().values()
        assert len(rust.free) == len(python.free) + 3  # the older leaf (1, 2, 3), whole
    finally:
        lockstep.close()
