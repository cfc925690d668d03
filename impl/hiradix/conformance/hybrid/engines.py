"""The (FULL, SWA) caches the hybrid machine drives: name -> (module, builder, probe).

Each module's probe returns the installed version, or raises ``EngineUnavailable`` with
one line naming the setup command; its builder makes a fresh ``SwaEngine`` per
configuration. SGLang's cache with HiCache is one engine per write policy, so that a
replayed example always meets the same policy.
"""

from __future__ import annotations

from hiradix.conformance.hybrid.machine import Build
from hiradix.conformance.registry import EngineRegistry

_SGLANG = "hiradix.conformance.adapters.sglang_swa"
HYBRID_ENGINES: dict[str, tuple[str, str, str]] = {
    "ours-swa": ("hiradix.conformance.adapters.ours_swa", "build", "probe"),
    "sglang-swa": (_SGLANG, "build", "probe"),
    "sglang-swa-rust": ("hiradix.conformance.adapters.sglang_swa_rust", "build", "probe"),
    **{f"sglang-swa-hicache-{policy}": (_SGLANG, f"build_{policy}", "probe_hicache")
       for policy in ("write_through", "write_through_selective", "write_back")},
    # vLLM's hybrid coordinator is no SwaEngine: hybrid.vllm_machine drives it per
    # request (spec/13, 13.9), so it has a probe here and no SwaEngine builder.
    "vllm-hybrid": ("hiradix.conformance.adapters.vllm_hybrid", "VllmHybrid", "probe"),
}
REQUEST_LEVEL = frozenset({"vllm-hybrid"})

_REGISTRY: EngineRegistry[Build] = EngineRegistry(
    HYBRID_ENGINES, REQUEST_LEVEL, "hybrid.vllm_machine", "SwaEngine")
probe = _REGISTRY.probe
builder = _REGISTRY.builder
