"""The (FULL, MAMBA) caches the Mamba machine drives: name -> (module, builder, probe).

Each module's probe returns the installed version, or raises ``EngineUnavailable`` with
one line naming the setup command; its builder makes a fresh ``MambaEngine`` per
configuration (spec/13m).
"""

from __future__ import annotations

from hiradix.conformance.mamba.machine import Build
from hiradix.conformance.registry import EngineRegistry

MAMBA_ENGINES: dict[str, tuple[str, str, str]] = {
    "ours-mamba": ("hiradix.conformance.adapters.ours_mamba", "build", "probe"),
    "sglang-mamba": ("hiradix.conformance.adapters.sglang_mamba", "build", "probe"),
    "sglang-mamba-hicache-write_through": (
        "hiradix.conformance.adapters.sglang_mamba_hicache", "build_write_through", "probe"),
    "sglang-mamba-hicache-write_back": (
        "hiradix.conformance.adapters.sglang_mamba_hicache", "build_write_back", "probe"),
    # vLLM's coordinator with a Mamba group is no MambaEngine: mamba.vllm_machine drives
    # it per request (spec/13m, 13m.8a), so it has a probe here and no builder.
    "vllm-mamba": ("hiradix.conformance.adapters.vllm_mamba", "VllmMamba", "probe"),
}
REQUEST_LEVEL = frozenset({"vllm-mamba"})

_REGISTRY: EngineRegistry[Build] = EngineRegistry(
    MAMBA_ENGINES, REQUEST_LEVEL, "mamba.vllm_machine", "MambaEngine")
probe = _REGISTRY.probe
builder = _REGISTRY.builder
