"""The storage tier sees its cache only through ``CachePort`` (issue 30): the tier never
imports ``hiradix.cache`` nor reaches into another object's private names, the cache
imports its tier and checker at module level (no cycle left to defer), a ``HiRadixCache``
is a ``CachePort``, a stand-in lacking one member is refused, and the tier drives a real
cache through the port (backup to storage, reset, prefetch back as host-only pages)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.keys import RadixKey
from hiradix.storage import MemoryBackend, StorageArgumentError
from hiradix.storage.cache_port import CachePort
from hiradix.storage.tier import StorageTier, TierSettings

IMPL = Path(__file__).resolve().parents[2] / "impl" / "hiradix"
TIER = IMPL / "storage" / "tier.py"
PORT = IMPL / "storage" / "cache_port.py"
CACHE = IMPL / "cache.py"


def private_reaches(source: str) -> list[str]:
    """Each ``x._name`` in ``source`` whose ``x`` is not ``self`` (dunders aside): a reach
    into another object's private names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def imports(source: str) -> list[tuple[str, bool]]:
    """Each module ``source`` imports (``from a import b`` gives ``a`` and ``a.b``), and
    whether the import is at module level (not in a function, class or ``if``)."""
    tree = ast.parse(source)
    top = {id(statement) for statement in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
            found += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def test_the_finders_see_planted_reaches_and_imports() -> None:
    """The two finders below can fail: each sees what it looks for."""
    assert private_reaches("self.cache._walk(key)\nself._attached\nx.__class__") == [
        "line 1: self.cache._walk"]
    assert ("hiradix.cache", False) in imports(
        "if TYPE_CHECKING:\n    from hiradix.cache import HiRadixCache")
    assert ("hiradix.cache", False) in imports("def f():\n    from hiradix import cache")
    assert ("hiradix.storage.tier", True) in imports("from hiradix.storage.tier import X")


@pytest.mark.parametrize("path", [TIER, PORT], ids=lambda p: p.name)
def test_the_tier_side_reaches_into_no_private_name_of_another_object(path: Path) -> None:
    assert private_reaches(path.read_text()) == []


@pytest.mark.parametrize("path", [TIER, PORT], ids=lambda p: p.name)
def test_the_tier_side_never_imports_the_cache(path: Path) -> None:
    """Not even under TYPE_CHECKING or inside a function: the port is all it knows."""
    assert [name for name, _ in imports(path.read_text())
            if name in ("hiradix.cache", "hiradix.checker")] == []


def test_the_cache_imports_its_tier_and_checker_at_module_level() -> None:
    """The cycle is gone, so nothing of hiradix is imported lazily in cache.py."""
    found = imports(CACHE.read_text())
    assert ("hiradix.storage.tier", True) in found and ("hiradix.checker", True) in found
    assert [name for name, top in found if name.startswith("hiradix") and not top] == []


def port_members() -> list[str]:
    """The names ``CachePort`` declares, read from its source (no private typing API)."""
    (port,) = [node for node in ast.parse(PORT.read_text()).body
               if isinstance(node, ast.ClassDef) and node.name == "CachePort"]
    names = [node.target.id for node in port.body
             if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    return names + [node.name for node in port.body if isinstance(node, ast.FunctionDef)]


def test_a_hiradix_cache_is_a_cache_port_under_public_names() -> None:
    cache = HiRadixCache.create(device_slots=8, page_size=2)
    members = port_members()
    assert {"descend", "walk", "now", "make_host_room", "page_refs",
            "refresh_leaf_sets", "require_node", "on_reset"} <= set(members)
    assert [name for name in members if name.startswith("_")] == []
    assert isinstance(cache, CachePort)
    for name in members:  # each a public member of the cache, none an alias to a private
        assert name in dir(cache), name


def test_the_tier_refuses_a_cache_without_the_port() -> None:
    """A stand-in with every member of the port but one is no cache for the tier."""
    real = HiRadixCache.create(device_slots=8, page_size=2)
    members = port_members()
    whole = SimpleNamespace(**{name: getattr(real, name) for name in members})
    assert isinstance(whole, CachePort)
    for missing in members:
        partial = SimpleNamespace(**{n: getattr(real, n) for n in members if n != missing})
        with pytest.raises(StorageArgumentError) as caught:
            StorageTier(partial)
        assert caught.value.argument == "cache", missing


def test_the_tier_drives_a_real_cache_through_the_port() -> None:
    """Back up to storage, reset (the tier's hook), then prefetch the pages back: they
    hang under the root as host-only pages and the cache's audit passes throughout."""
    cache = HiRadixCache.create(device_slots=8, page_size=2, clock=ManualClock(1))
    assert cache.attach_storage_backend(MemoryBackend(), "model", TierSettings(
        prefetch_threshold=2, prefetch_token_limit=100), threaded=False) == "attached"
    tier = cache.storage
    assert tier is not None
    key = RadixKey((1, 2, 3, 4))
    slots = cache.alloc(4)
    assert slots is not None
    cache.insert(key, slots)
    assert cache.writing_check() == 1  # the synchronous engine: the copy has landed
    cache.check_invariants()
    tier.check()
    assert tier.metrics.write_pages_issued == 2
    assert tier.io is not None and tier.io.run_pending() == 1  # the write, run here
    tier.drain_storage_queues()
    cache.reset()
    assert tier.query_storage_hit_length(key) == 4
    assert tier.prefetch_from_storage("r", key) == 4
    assert tier.io is not None and tier.io.run_pending() == 1  # the fetch
    assert tier.check_prefetch_progress("r")
    assert tier.pop_prefetch_loaded_tokens("r") == 4
    match = cache.match_prefix(key)
    assert len(match.device_slots) == 0 and match.host_hit_length == 4
    cache.check_invariants()
    tier.check()
