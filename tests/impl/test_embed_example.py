"""examples/embed.py, the README's "Embed it in a scheduler" loop, runs and does what it
says: cached prefixes are reused, evicted pages come back from host, and after a restart
the pages come back from the file backend with their KV intact."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed.py"


def test_the_embedding_example_reuses_every_tier() -> None:
    spec = importlib.util.spec_from_file_location("embed_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = module.main("cpu")
    assert figures == {
        "first": 0,  # nothing cached yet
        "second": 24,  # the 6-page prompt, from device
        "after_evict": 24,  # from host, loaded back
        "pages_written": 7,  # cache.writing_check backed every page up to storage
        "storage_hit": 24,  # after the restart: all 6 pages in storage
        "prefetched": 24,
        "after_restart": 24,  # from the prefetched host copies, loaded back
    }


def test_the_example_runs_as_a_script() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "after_restart: 24" in done.stdout
