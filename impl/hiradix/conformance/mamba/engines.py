"""The (FULL, MAMBA) caches the Mamba machine drives: name -> (module, builder, probe).

Each module's probe returns the installed version, or raises ``EngineUnavailable`` with
one line naming the setup command; its builder makes a fresh ``MambaEngine`` per
configuration (spec/13m).
"""

from __future__ import annotations

import importlib

from hiradix.conformance.mamba.machine import Build

MAMBA_ENGINES: dict[str, tuple[str, str, str]] = {
    "ours-mamba": ("hiradix.conformance.adapters.ours_mamba", "build", "probe"),
    "sglang-mamba": ("hiradix.conformance.adapters.sglang_mamba", "build", "probe"),
    # vLLM's coordinator with a Mamba group is no MambaEngine: mamba.vllm_machine drives
    # it per request (spec/13m, 13m.8a), so it has a probe here and no builder.
    "vllm-mamba": ("hiradix.conformance.adapters.vllm_mamba", "VllmMamba", "probe"),
}
REQUEST_LEVEL = frozenset({"vllm-mamba"})


def probe(engine: str) -> str:
    """The installed version of ``engine``; ``EngineUnavailable`` if it cannot run here."""
    module, _, probe_name = MAMBA_ENGINES[engine]
    version: str = getattr(importlib.import_module(module), probe_name)()
    return version


def builder(engine: str) -> Build:
    """The constructor of fresh adapters of ``engine``, one per configuration."""
    if engine in REQUEST_LEVEL:
        raise ValueError(f"engine: {engine} is driven by mamba.vllm_machine, not by the "
                         f"MambaEngine machine")
    module, build_name, _ = MAMBA_ENGINES[engine]
    build: Build = getattr(importlib.import_module(module), build_name)
    return build
