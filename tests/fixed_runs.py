"""A fixed, deterministic run of the differential machine, shared by the engine tests."""

from __future__ import annotations

from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix_model import trace


def drive(scenario: Scenario, engine: str) -> list[str]:
    """A fixed run of the differential machine, as trace lines: requests sharing a
    prefix, eviction to host, a returning request that loads back, acknowledgements."""
    machine = make_differential(factory(engine, scenario))()
    for tokens in [(1, 2, 3, 1), (1, 2, 3, 2, 2), (3, 1)]:
        machine.request(tokens=tokens, namespace=None, dt=1, chunked=False, priority=0,
                        keep_lock=False)
        machine.engine_refines_the_model()
    machine.writing_check()
    machine.evict(num_tokens=8)
    machine.engine_refines_the_model()
    machine.request_again(index=1, evict_first=0)
    machine.engine_refines_the_model()
    if machine.model.pending:
        machine.loading_check()
        machine.writing_check()
    machine.engine_refines_the_model()
    machine.teardown()
    ops_seen = {step.op for step in machine.trace}
    assert {"insert", "evict", "init_load_back"} <= ops_seen, ops_seen
    header = trace.header(machine.engine.config, engine)
    return [header, *(step.to_json() for step in machine.trace)]

