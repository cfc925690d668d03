"""Engine adapters for the differential suite (see ``base`` for the protocol).

Each engine lives in its own module, which offers three functions:

- ``probe(engine) -> str``: import the engine, check it is a version the adapter knows
  and that the API it drives is there; return the installed version, or raise
  ``EngineUnavailable`` with one line naming the package and the command that sets it up;
- ``factory(engine, scenario)``: a constructor of fresh adapters for one scenario;
- ``scenario_space(engine)``: the scenario values the engine's adapter takes.

``ours`` is always available. SGLang's engines need ``make sglang-env`` (0.5.20) or
``make sglang23-env`` (0.5.23), vLLM's ``make vllm-env``; each is run from its own
virtual environment.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from hiradix.conformance.adapters.base import OPERATIONS, EngineAdapter, EngineUnavailable
from hiradix.conformance.scenario import Scenario

# engine name -> the module that adapts it
MODULES = {
    "ours": "hiradix.conformance.adapters.ours",
    "sglang-radix": "hiradix.conformance.adapters.sglang",
    "sglang": "hiradix.conformance.adapters.sglang",
    "sglang-unified": "hiradix.conformance.adapters.sglang_unified",
    "sglang-storage": "hiradix.conformance.adapters.sglang_storage",
    "sglang-unified-storage": "hiradix.conformance.adapters.sglang_unified_storage",
    "sglang-unified-rust": "hiradix.conformance.adapters.sglang_rust",
    "sglang-unified-rust-hicache": "hiradix.conformance.adapters.sglang_rust_hicache",
    "vllm": "hiradix.conformance.adapters.vllm",
    "vllm-offload": "hiradix.conformance.adapters.vllm",
}
ENGINES = tuple(MODULES)


def _module(engine: str) -> ModuleType:
    if engine not in MODULES:
        raise ValueError(f"engine: must be one of {ENGINES}, got {engine!r}")
    return importlib.import_module(MODULES[engine])


def probe(engine: str) -> str:
    """The installed version of ``engine``; ``EngineUnavailable`` if it cannot run here."""
    version: str = _module(engine).probe(engine)
    return version


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    """A constructor of fresh adapters of ``engine`` for ``scenario``."""
    made: Callable[[], EngineAdapter] = _module(engine).factory(engine, scenario)
    return made


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values ``engine``'s adapter takes (an axis absent: any value)."""
    space: dict[str, tuple[object, ...]] = _module(engine).scenario_space(engine)
    return space


__all__ = ["ENGINES", "OPERATIONS", "EngineAdapter", "EngineUnavailable", "factory", "probe",
           "scenario_space"]
