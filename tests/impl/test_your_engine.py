"""Checking a cache that is not ours (spec/16, issue 30): ``examples/toycache`` and its
adapter package, installed as their developer would, found out by ``hiradix check`` and by
the pytest plugin; and the catalog's one-line refusal of registrations that name no engine.

The example packages are built from copies (pip builds in the source folder) and installed
with ``pip --target`` from no index, so the test needs no network.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix import cli, pytest_plugin
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("toycache", "toycache-hiradix")
# A budget of examples, not seconds, and a seed: the same examples on a loaded machine
# (the shipped bug shows within the first few dozen).
BUDGET = ("--examples", "150", "--seed", "1")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both example packages installed into a folder of their own (entry points included)."""
    sources, target = tmp_path_factory.mktemp("sources"), tmp_path_factory.mktemp("site")
    copies = [str(shutil.copytree(ROOT / "examples" / name, sources / name))
              for name in EXAMPLES]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target), *copies],
                   check=True, capture_output=True, timeout=180)
    return target


def run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python args`` with the installed examples, hiradix and its model importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (site, ROOT / "impl",
                                                                  ROOT / "model"))),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def check(engine: str, site: Path, cwd: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return run(["-m", "hiradix", "check", "--engine", engine, *BUDGET,
                "--database", "none", *more], site, cwd)


def test_the_shipped_bug_is_found_and_its_reproducer_replays(site: Path,
                                                             tmp_path: Path) -> None:
    done = check("toycache", site, tmp_path)
    assert done.returncode == 1, done.stderr
    failure = done.stdout.splitlines()[1]  # the exception line under "FAILED on …"
    assert done.stdout.startswith("FAILED on") and "is not an evictable leaf" in failure
    script = done.stdout[done.stdout.index("# Reproducer written by"):]
    assert "factory('toycache'" in script
    (tmp_path / "reproducer.py").write_text(script)
    replayed = run(["reproducer.py"], site, tmp_path)
    assert replayed.returncode != 0 and failure in replayed.stderr, replayed.stderr
    assert "no failure reproduced" not in replayed.stdout


def test_the_fixed_cache_passes(site: Path, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    done = check("toycache-fixed", site, tmp_path, "--json", str(results))
    assert done.returncode == 0, done.stdout + done.stderr
    campaign = json.loads(results.read_text())["campaigns"][0]
    assert campaign["engine"] == "toycache-fixed" and campaign["version"] == "0.1.0"
    assert campaign["steps"] > 0 and campaign["failure"] is None


def test_module_attribute_needs_no_entry_point(site: Path, tmp_path: Path) -> None:
    bare = tmp_path / "site"
    shutil.copytree(site, bare, ignore=shutil.ignore_patterns("toycache_hiradix-*.dist-info"))
    found = {d.metadata["Name"] for d in importlib.metadata.distributions(path=[str(bare)])}
    assert found == {"toycache"}  # no adapter distribution: its entry points are gone
    done = check("toycache_hiradix:ENGINE", bare, tmp_path)
    assert done.returncode == 1, done.stderr
    assert "factory('toycache_hiradix:ENGINE'" in done.stdout


def test_the_adapter_without_its_cache_is_one_line_naming_the_install(site: Path,
                                                                       tmp_path: Path) -> None:
    alone = tmp_path / "site"
    shutil.copytree(site, alone, ignore=shutil.ignore_patterns("toycache", "toycache-*"))
    done = check("toycache", alone, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == ("hiradix check: toycache: toycache is not installed here "
                           "(pip install examples/toycache)\n")


def test_the_pytest_plugin_makes_one_item_per_engine(site: Path, tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("")
    report = tmp_path / "report.xml"
    done = run(["-m", "pytest", "-p", "hiradix.pytest_plugin", "-p", "no:cacheprovider",
                "--hiradix-engine", "toycache-fixed", "--hiradix-engine", "toycache",
                "--hiradix-engine", "no-such-cache", "--hiradix-examples", "150",
                "--hiradix-seed", "1",
                f"--junitxml={report}"], site, tmp_path)
    assert "2 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    cases = {case.get("name"): case for case in ET.parse(report).iter("testcase")}
    assert set(cases) == {"hiradix-check[toycache-fixed]", "hiradix-check[toycache]",
                          "hiradix-check[no-such-cache]"}
    assert cases["hiradix-check[toycache-fixed]"].find("failure") is None
    found = cases["hiradix-check[toycache]"].find("failure")
    assert found is not None and "is not an evictable leaf" in (found.text or "")
    assert "Reproducer:" in (found.text or "") and "factory('toycache'" in (found.text or "")
    assert cases["hiradix-check[no-such-cache]"].find("skipped") is None  # never a skip
    unknown = cases["hiradix-check[no-such-cache]"].find("failure")
    assert unknown is not None
    assert re.fullmatch(r"hiradix check: --engine: unknown engine 'no-such-cache' .*",
                        (unknown.text or "").strip())


class Options:
    """A pytest config that was given no ``--hiradix-engine``."""

    def getoption(self, name: str) -> Any:
        return {"hiradix_engine": [], "hiradix_seconds": 30.0, "hiradix_examples": None,
                "hiradix_seed": None}[name]


def test_the_plugin_adds_nothing_without_the_option() -> None:
    items: list[pytest.Item] = []
    pytest_plugin.pytest_collection_modifyitems(None, Options(), items)  # type: ignore[arg-type]
    assert items == []


def test_the_plugin_is_registered_with_pytest() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"hiradix": "hiradix.pytest_plugin"}


# -- planted bugs: each observation of the adapter can fail ----------------------------

def _keeps_the_callers_slots(module: Any) -> Callable[..., None]:
    reset = module.ToyCache.reset

    def planted(cache: Any) -> None:
        free = list(cache.allocator.free_pages)
        reset(cache)
        cache.allocator.free_pages = free
    return planted


def _splits_without_the_lock(module: Any) -> Callable[..., Any]:
    split = module.ToyCache._split

    def planted(cache: Any, node: Any, at: int) -> Any:
        upper = split(cache, node, at)
        upper.lock_ref = 0  # the upper half of a locked node must stay locked
        return upper
    return planted


def _keeps_the_first_priority(module: Any) -> Callable[..., int]:
    insert = module.ToyCache.insert

    def planted(cache: Any, tokens: Any, slots: Any, namespace: Any = None,
                priority: int = 0) -> int:
        before = {node: node.priority for node in cache.nodes()}
        done: int = insert(cache, tokens, slots, namespace, priority)
        for node in cache.nodes():
            node.priority = before.get(node, node.priority)
        return done
    return planted


# ToyCache's method -> (its planted version, what the failure says): each is seen by
# another observation (the free pool; lock counts, and the evictable tokens a lock call
# changes; page priorities).
PLANTED: dict[str, tuple[str, Callable[[Any], Callable[..., Any]], str]] = {
    "reset keeps the callers' slots": ("reset", _keeps_the_callers_slots,
                                       r"^device_free: impl"),
    "a split drops the lock": ("_split", _splits_without_the_lock,
                               r"^(inc|dec)_lock_ref: toycache-fixed"
                               r"|impl Page\(.*lock=(\d+),.* != model Page\(.*lock=(?!\2,)\d+,"),
    "a found page keeps its priority": ("insert", _keeps_the_first_priority,
                                        r"impl Page\(.*priority=(\d+)\) != "
                                        r"model Page\(.*priority=(?!\1\))\d+\)"),
}


@pytest.fixture
def toycache(site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(site))
    import toycache

    yield toycache


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_in_a_fixed_cache_is_found(bug: str, toycache: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import toycache_hiradix

    method, plant, seen = PLANTED[bug]
    monkeypatch.setattr(toycache.ToyCache, method, plant(toycache))
    machine = make_differential(lambda: toycache_hiradix.ToyCacheAdapter(
        Scenario(page_size=1), "toycache-fixed", True))
    with pytest.raises(AssertionError) as found:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=1000, stateful_step_count=30, deadline=None, database=None,
            derandomize=True,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
    assert re.search(seen, str(found.value), re.MULTILINE), found.value


# -- registrations that name no engine --------------------------------------------------

NOT_ENGINES = '''
from hiradix.engines import CacheEngine
from hiradix.engines.catalog import BUILT_IN

NUMBER = 3
MISNAMED = BUILT_IN["ours"]
'''
ENTRY_POINTS = """[hiradix.engines]
not-an-engine = toycache_test_not_engines:NUMBER
misnamed = toycache_test_not_engines:MISNAMED
no-module = toycache_test_no_such_module:ENGINE
"""
REFUSED = [
    ("toycache_test_not_engines:NUMBER", "is a int, not an engine record"),
    ("toycache_test_not_engines:NOTHING", "has no attribute 'NOTHING'"),
    ("not-an-engine", "the entry point not-an-engine = toycache_test_not_engines:NUMBER is "
                      "a int, not an engine record"),
    ("misnamed", "is registered as 'misnamed' but names itself 'ours'"),
    ("no-module", "the entry point no-module = toycache_test_no_such_module:ENGINE does not "
                  "load"),
]


@pytest.mark.parametrize(("engine", "message"), REFUSED, ids=[e for e, _ in REFUSED])
def test_a_registration_that_is_no_engine_is_one_line_and_exit_2(
        engine: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "toycache_test_not_engines.py").write_text(NOT_ENGINES)
    info = tmp_path / "toycache_test_not_engines-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toycache-test-not-engines\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "toycache_test_not_engines", raising=False)
    assert cli.main(["check", "--engine", engine, "--seconds", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and message in err and "FAILED" not in out + err, err
