"""``hiradix.render``: the tree drawn by tier as text and SVG, and ``hiradix show``."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.show import demo, replay_on_impl, show_main
from hiradix.keys import RadixKey
from hiradix.render import render_svg, render_text, views
from hiradix.storage import MemoryBackend
from hiradix.storage.tier import StorageTier, TierSettings
from hiradix.tree import TreeNode
from hiradix_model.config import Config
from hiradix_model.trace import header

SVG = "{http://www.w3.org/2000/svg}"


def land(cache: HiRadixCache) -> None:
    """Finish and acknowledge the device-to-host copies in flight."""
    engine = cache.engine
    engine.complete("d2h", engine.queued("d2h"))  # type: ignore[attr-defined]
    cache.writing_check()


def cached(tokens: tuple[int, ...], landed: bool = True) -> tuple[HiRadixCache, TreeNode]:
    """A cache (controlled copies, write_through) holding ``tokens``; with ``landed``
    the backup copies are done and acknowledged."""
    cache = Scenario().build(ManualClock(1), None)
    slots = cache.device_pool.alloc(len(tokens))
    assert slots is not None
    cache.insert(RadixKey(tokens), slots)
    if landed:
        land(cache)
    return cache, cache.match_prefix(RadixKey(tokens)).last_device_node


def line_of(text: str, tokens: str) -> str:
    (line,) = [ln for ln in text.splitlines() if tokens in ln]
    return line


def node_groups(svg: str) -> dict[str, ET.Element]:
    root = ET.fromstring(svg)
    return {g.attrib["id"]: g for g in root.iter(f"{SVG}g") if g.get("class") == "node"}


def test_a_locked_node_shows_its_lock_count_and_loses_it_when_unlocked() -> None:
    cache, node = cached((1, 2, 3, 4))
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert "lock=2" in line_of(render_text(cache), "[1 2 3 4]")
    group = node_groups(render_svg(cache))[f"node-{node.id}"]
    assert group.get("data-lock-ref") == "2"
    assert group.find(f"{SVG}rect").get("stroke") == "#d62728"  # type: ignore[union-attr]
    cache.dec_lock_ref(node)
    cache.dec_lock_ref(node)
    assert "lock=" not in line_of(render_text(cache), "[1 2 3 4]")


def test_a_host_only_node_is_drawn_as_host_only() -> None:
    cache, node = cached((1, 2, 3, 4))
    assert "device+host" in line_of(render_text(cache), "[1 2 3 4]")
    cache.evict(4)
    assert node.device is None and node.host is not None
    line = line_of(render_text(cache), "[1 2 3 4]")
    assert " -H " in line and "host only" in line
    group = node_groups(render_svg(cache))[f"node-{node.id}"]
    assert group.get("data-tier") == "host only"


def test_the_svg_parses_and_has_one_element_per_node() -> None:
    cache, _ = cached((1, 2, 3, 4, 5, 6))
    for tail in ((1, 2, 7, 8), (9, 10), (1, 2, 3, 4, 11, 12)):
        got = cache.match_prefix(RadixKey(tail))
        new = cache.device_pool.alloc(len(tail) - len(got.device_slots))
        assert new is not None
        cache.insert(RadixKey(tail), torch.cat([got.device_slots, new]))
        land(cache)
    groups = node_groups(render_svg(cache))
    assert len(cache.nodes()) == 6
    assert set(groups) == {f"node-{n.id}" for n in cache.nodes()}
    # One text line per node as well, below the three header lines and "root".
    assert len(render_text(cache).splitlines()) == 4 + len(cache.nodes())


def test_an_empty_cache_renders() -> None:
    cache = Scenario().build(ManualClock(1), None)
    assert render_text(cache).splitlines()[-1] == "root"
    assert node_groups(render_svg(cache)) == {}


def test_pages_in_storage_and_host_protection_are_shown() -> None:
    cache, _ = cached((1, 2, 3, 4), landed=False)
    tier = StorageTier(cache)
    tier.attach(MemoryBackend(), "m", TierSettings(prefetch_threshold=2), threaded=False)
    assert "stored 0/2" in line_of(render_text(cache, tier), "[1 2 3 4]")
    engine = cache.engine
    engine.complete("d2h", engine.queued("d2h"))  # type: ignore[attr-defined]
    tier.writing_check()  # backs the pages up: host-protected until the ack is drained
    text = render_text(cache, tier)
    assert all("host_ref=1" in ln for ln in text.splitlines() if ln.startswith(("├", "└", " ")))
    assert tier.io is not None
    tier.io.run_pending()
    tier.drain_storage_queues()
    text = render_text(cache, tier)
    assert "host_ref" not in text.split("root\n")[1]
    assert text.count("DHS") == len(cache.nodes()) and "storage: memory attached" in text
    stored = [v.stored for v in views(cache, tier)]
    assert stored == [1] * len(stored)
    svg = ET.fromstring(render_svg(cache, tier))
    assert len([r for r in svg.iter(f"{SVG}rect") if r.get("class") == "stored"]) == len(stored)
    # Without the tier, no storage flag at all.
    assert "DHS" not in render_text(cache) and "stored" not in render_text(cache)


def test_a_tier_of_another_cache_is_refused() -> None:
    cache, _ = cached((1, 2))
    other, _ = cached((1, 2))
    with pytest.raises(ValueError, match="another cache"):
        render_text(cache, StorageTier(other))


def test_copies_in_flight_are_marked() -> None:
    cache, _ = cached((1, 2, 3, 4), landed=False)
    assert "copying d2h" in render_text(cache)
    land(cache)
    assert "copying" not in render_text(cache)


def test_the_demo_shows_every_tier_a_lock_and_a_protection(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cache, tier = demo()
    cache.check_invariants()
    text = render_text(cache, tier)
    for word in ("device only", "host only", "device+host", "lock=1", "host_ref=1",
                 "stored 1/1", "lora-a: "):
        assert word in text, word
    assert show_main([]) == 0
    assert capsys.readouterr().out == text
    picture = tmp_path / "tree.svg"
    assert show_main(["--svg", str(picture)]) == 0
    assert len(node_groups(picture.read_text())) == len(cache.nodes())


def write_trace(path: Path, steps: list[dict[str, object]]) -> None:
    config = Config(page_size=2, device_slots=8, host_slots=16)
    path.write_text(header(config, "hiradix") + "\n"
                    + "".join(json.dumps(step) + "\n" for step in steps))


def key(*tokens: int) -> dict[str, object]:
    return {"tokens": list(tokens), "namespace": None}


def test_a_trace_is_replayed_on_the_implementation(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [
        {"op": "alloc", "args": {"key": key(1, 2, 3, 4), "start": 0, "slots": [4, 5, 6, 7]}},
        {"op": "insert", "args": {"key": key(1, 2, 3, 4), "slots": [4, 5, 6, 7], "now": 1}},
        {"op": "alloc", "args": {"key": key(1, 2, 7, 8), "start": 2, "slots": [0, 1]}},
        {"op": "insert", "args": {"key": key(1, 2, 7, 8), "slots": [4, 5, 0, 1], "now": 2}},
        {"op": "writing_check", "args": {"count": 2}},
        {"op": "evict", "args": {"num_tokens": 2, "victims": []}},
        {"op": "inc_lock_ref", "args": {"page": key(1, 2, 7, 8)}},
        {"op": "dec_lock_ref", "args": {"page": key(9, 9)}},  # not cached: a note
        {"op": "adopt", "args": {"pages": [], "why": "x"}},  # not a cache operation
    ])
    cache, notes = replay_on_impl(str(path))
    cache.check_invariants()
    assert [n.split(": ")[1] for n in notes] == ["dec_lock_ref", "adopt"]
    text = render_text(cache)
    assert "host only" in line_of(text, "[3 4]") and "lock=1" in line_of(text, "[7 8]")
    assert "lock=1" in line_of(text, "[1 2]")
    assert show_main([str(path)]) == 0
    out = capsys.readouterr()
    assert "host only" in out.out and f"{path}:9: dec_lock_ref" in out.err


@pytest.mark.parametrize("content, where", [("", ":0: "), ('{"format": "x"}\n', ":1: "),
                                             ("not json\n", ":1: ")])
def test_a_broken_trace_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         content: str, where: str) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(content)
    assert show_main([str(path)]) == 2
    assert f"{path}{where}" in capsys.readouterr().err
    assert show_main([str(tmp_path / "missing.jsonl")]) == 2
