"""The public adapter protocol: how any engine's prefix cache is held to the model.

An engine developer writes two things, in a package of their own:

- an **adapter** (``EngineAdapter``, in ``hiradix.engines.protocol``): one instance wraps
  one cache built for one model ``Config``; it issues the operations of spec/03 in the
  model's vocabulary and reads the cache back as the model's abstract ``State``. It
  declares what it cannot do (``operations``, ``inexpressible``), what it translates
  (``adopted``, ``mapped``), the known bugs a campaign steers around (``avoid``) and the
  **guards** of the engine's server (``guards``): situations its scheduler never creates
  (a reset while copies are in flight, say), which campaigns respect unless
  ``--beyond-server`` asks otherwise, so that every failure they report is reachable
  through the engine's server.
- an **engine record** (``CacheEngine``; ``ComponentEngine`` for hybrid caches): its
  name, family, a probe (the installed version, or ``EngineUnavailable`` with one line
  saying how to set it up) and a factory of adapters per configuration; registered as an
  entry point of the ``hiradix.engines`` group, or named as ``--engine module:attribute``.

``examples/toycache`` is a worked example, and spec/16-your-engine.md the guide. The
built-in engines (ours, SGLang's, vLLM's, LMCache's) use this same protocol, one
sub-package per family.
"""

from hiradix.engines.catalog import (
    BUILT_IN,
    ENTRY_POINT_GROUP,
    CacheEngine,
    ComponentEngine,
    Deferred,
    Engine,
    EngineError,
    cache_engine,
    factory,
    flat_engine,
    lookup,
    mamba_engine,
    names,
    probe,
    scenario_space,
    server_space,
    swa_engine,
)
from hiradix.engines.protocol import (
    OPERATIONS,
    EngineAdapter,
    EngineUnavailable,
    probe_engine,
    unsupported,
)

__all__ = ["BUILT_IN", "ENTRY_POINT_GROUP", "OPERATIONS", "CacheEngine", "ComponentEngine",
           "Deferred", "Engine", "EngineAdapter", "EngineError", "EngineUnavailable",
           "cache_engine", "factory", "flat_engine", "lookup", "mamba_engine", "names", "probe",
           "probe_engine", "scenario_space", "server_space", "swa_engine", "unsupported"]
