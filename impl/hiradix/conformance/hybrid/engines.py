"""The (FULL, SWA) caches the hybrid machine drives: name -> the adapter module.

Each module offers ``probe() -> str`` (the installed version, or ``EngineUnavailable``
with one line naming the setup command) and ``build(config) -> SwaEngine``.
"""

from __future__ import annotations

import importlib

from hiradix.conformance.hybrid.machine import Build

HYBRID_ENGINES = {
    "ours-swa": "hiradix.conformance.adapters.ours_swa",
    "sglang-swa": "hiradix.conformance.adapters.sglang_swa",
}


def probe(engine: str) -> str:
    """The installed version of ``engine``; ``EngineUnavailable`` if it cannot run here."""
    version: str = importlib.import_module(HYBRID_ENGINES[engine]).probe()
    return version


def builder(engine: str) -> Build:
    """The constructor of fresh adapters of ``engine``, one per configuration."""
    build: Build = importlib.import_module(HYBRID_ENGINES[engine]).build
    return build
