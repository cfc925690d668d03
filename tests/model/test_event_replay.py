"""The model's KV events (spec/11): replay, residency, the reference stream."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model import Event, Key, initial, violations
from hiradix_model.events import (
    NOTHING,
    device_resident,
    host_resident,
    replay,
    residency_problems,
    step_events,
    storage_may,
    storage_must,
)

import scenario
from scenario import BACKING_UP, HOST_ONLY, LOADED, build_storage

PAGE = Key((1, 2))


def test_device_and_host_replay_is_strict() -> None:
    twice = [Event("stored", "device", PAGE), Event("stored", "device", PAGE)]
    assert len(replay(twice)[1]) == 1
    phantom = [Event("removed", "host", PAGE)]
    assert len(replay(phantom)[1]) == 1


def test_storage_replay_is_idempotent_and_cleared_empties_a_tier() -> None:
    events = [Event("stored", "storage", PAGE), Event("stored", "storage", PAGE),
              Event("removed", "storage", Key((9, 9))), Event("stored", "device", PAGE),
              Event("cleared", "device")]
    resident, problems = replay(events)
    assert problems == []
    assert resident["storage"] == {PAGE} and resident["device"] == frozenset()


def test_a_backup_in_flight_is_not_yet_on_host() -> None:
    state = scenario.build()
    assert BACKING_UP in device_resident(state) and BACKING_UP not in host_resident(state)
    assert HOST_ONLY in host_resident(state) and HOST_ONLY not in device_resident(state)
    assert LOADED in device_resident(state)


def test_the_reference_stream_from_empty_replays_to_the_state() -> None:
    state = build_storage(scenario.build())
    stream = step_events(replace(initial(state.config), storage=None), state)
    assert violations(replace(state, events=stream)) == {}
    resident, problems = replay(stream)
    assert problems == [] and resident["storage"] == storage_may(state)


def test_storage_residency_is_bounded_by_what_was_written_and_what_is_there() -> None:
    state = build_storage(scenario.build())
    told = {**NOTHING, "device": device_resident(state), "host": host_resident(state)}
    must = storage_must(state)
    assert must, "the scenario has a handled, unreleased storage write"
    assert list(residency_problems(state, {**told, "storage": must})) == []
    missing = list(residency_problems(state, told))
    assert missing and all("never said so" in m for m in missing)
    stale = {**told, "storage": must | {Key((9, 9))}}
    assert [m for m in residency_problems(state, stale) if "not in storage" in m]
