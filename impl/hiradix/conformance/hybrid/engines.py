"""The (FULL, SWA) caches the hybrid machine drives: name -> (module, builder, probe).

Each module's probe returns the installed version, or raises ``EngineUnavailable`` with
one line naming the setup command; its builder makes a fresh ``SwaEngine`` per
configuration. SGLang's cache with HiCache is one engine per write policy, so that a
replayed example always meets the same policy.
"""

from __future__ import annotations

import importlib

from hiradix.conformance.hybrid.machine import Build

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


def probe(engine: str) -> str:
    """The installed version of ``engine``; ``EngineUnavailable`` if it cannot run here."""
    module, _, probe_name = HYBRID_ENGINES[engine]
    version: str = getattr(importlib.import_module(module), probe_name)()
    return version


def builder(engine: str) -> Build:
    """The constructor of fresh adapters of ``engine``, one per configuration."""
    if engine in REQUEST_LEVEL:
        raise ValueError(f"engine: {engine} is driven by hybrid.vllm_machine, not by the "
                         f"SwaEngine machine")
    module, build_name, _ = HYBRID_ENGINES[engine]
    build: Build = getattr(importlib.import_module(module), build_name)
    return build
