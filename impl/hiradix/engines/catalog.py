"""Which engines ``hiradix check --engine NAME`` can drive, and how each is found.

An engine is a record (``CacheEngine`` or ``ComponentEngine``) that says how to probe it
(its installed version, or ``EngineUnavailable``) and how to build what a campaign drives.
A name is looked up, in order, as

1. ``package.module:attribute`` -- that attribute, imported (an adapter kept anywhere);
2. a built-in engine (``BUILT_IN``: ours, SGLang's, vLLM's);
3. an entry point of the ``hiradix.engines`` group, as an installed package declares it::

       [project.entry-points."hiradix.engines"]
       toycache = "toycache_hiradix:ENGINE"

Nothing an engine needs is imported until it is probed or built: each engine lives in its
own virtual environment, and a catalog that imported them all would need them all.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # annotations only: the machines import this package's protocol
    from hypothesis.stateful import RuleBasedStateMachine

    from hiradix.conformance.batches import ComponentCampaign
    from hiradix.conformance.scenario import Scenario
    from hiradix.conformance.tally import Tally
    from hiradix.engines.protocol import EngineAdapter

ENTRY_POINT_GROUP = "hiradix.engines"
Components = Literal["(FULL, SWA)", "(FULL, MAMBA)", "(CPU, DISK)", "(DEVICE, CPU, DISK)"]


class EngineError(ValueError):
    """An ``--engine`` that names nothing runnable: unknown, or not an engine record. A
    usage error (``hiradix check`` prints it and exits 2), never a conformance failure."""


def _no_constraints() -> Mapping[str, tuple[object, ...]]:
    return {}


@dataclass(frozen=True)
class CacheEngine:
    """An engine whose cache is driven operation by operation through an
    ``EngineAdapter`` (spec/03): by the differential machine, or by ``machine`` where
    the engine's API needs a machine of its own.

    - ``probe()``: the installed version; ``EngineUnavailable`` if it cannot run here.
    - ``factory(scenario)``: a constructor of fresh adapters for one configuration.
    - ``scenario_space()``: the configuration values the adapter takes, per
      ``Scenario`` field (a field absent: any value).
    - ``machine(scenario, tally)``: a state machine class of the engine's own, or None.
    - ``server_space()``: the configuration values the engine's own server can run, per
      ``Scenario`` field (a field absent: any the adapter takes). Campaigns keep to them
      unless ``--beyond-server``, so that what they report is reachable from the server.
    """

    name: str
    family: str
    probe: Callable[[], str]
    factory: Callable[[Scenario], Callable[[], EngineAdapter]]
    scenario_space: Callable[[], Mapping[str, tuple[object, ...]]] = _no_constraints
    machine: Callable[[Scenario, Tally | None], type[RuleBasedStateMachine]] | None = None
    description: str = ""
    server_space: Callable[[], Mapping[str, tuple[object, ...]]] = _no_constraints


class CampaignRunner(Protocol):
    """A component campaign over page sizes (``batches.run_campaign_of``'s arguments)."""

    def __call__(self, page_sizes: Sequence[int], *, until: float,
                 examples: int | None = ..., steps: int = ..., batch: int = ...,
                 seeded: int | None = ...) -> ComponentCampaign: ...


@dataclass(frozen=True)
class ComponentEngine:
    """An engine a component campaign drives: a hybrid cache, (FULL, SWA) by the machine
    of spec/13, (FULL, MAMBA) by that of spec/13m; or flat per-chunk tiers, (CPU, DISK),
    by that of spec/15 15.5; or a device tree over flat tiers, (DEVICE, CPU, DISK), by
    that of spec/15 15.9. ``swa_engine``, ``mamba_engine`` and ``flat_engine`` make one
    from a builder of ``SwaEngine`` / ``MambaEngine`` / ``FlatEngine``."""

    name: str
    family: str
    components: Components
    probe: Callable[[], str]
    campaign: CampaignRunner
    description: str = ""


Engine = CacheEngine | ComponentEngine


@dataclass(frozen=True)
class Deferred:
    """``module.attribute(*leading, *args)``, the module imported at the first call."""

    module: str
    attribute: str
    leading: tuple[object, ...] = field(default=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function = getattr(importlib.import_module(self.module), self.attribute)
        return function(*self.leading, *args, **kwargs)


@dataclass(frozen=True)
class _ComponentCampaign:
    """The generic machine of ``components`` over the engines ``build`` makes."""

    runner: Deferred
    engine: str
    build: Callable[..., Any]

    def __call__(self, page_sizes: Sequence[int], **options: Any) -> ComponentCampaign:
        campaign: ComponentCampaign = self.runner(self.engine, self.build, page_sizes,
                                                  **options)
        return campaign


_RUNNERS = {"(FULL, SWA)": Deferred("hiradix.conformance.hybrid.campaign", "run_campaign"),
            "(FULL, MAMBA)": Deferred("hiradix.conformance.mamba.campaign", "run_campaign"),
            "(CPU, DISK)": Deferred("hiradix.conformance.flat.campaign", "run_campaign"),
            "(DEVICE, CPU, DISK)": Deferred("hiradix.conformance.flat.radix_campaign",
                                            "run_campaign")}


def swa_engine(name: str, family: str, probe: Callable[[], str],
               build: Callable[..., Any], description: str = "") -> ComponentEngine:
    """A (FULL, SWA) engine: ``build(SwaConfig) -> SwaEngine`` (conformance.hybrid.engine)."""
    return ComponentEngine(name, family, "(FULL, SWA)", probe,
                           _ComponentCampaign(_RUNNERS["(FULL, SWA)"], name, build),
                           description)


def mamba_engine(name: str, family: str, probe: Callable[[], str],
                 build: Callable[..., Any], description: str = "") -> ComponentEngine:
    """A (FULL, MAMBA) engine: ``build(MambaConfig) -> MambaEngine``
    (conformance.mamba.engine)."""
    return ComponentEngine(name, family, "(FULL, MAMBA)", probe,
                           _ComponentCampaign(_RUNNERS["(FULL, MAMBA)"], name, build),
                           description)


def flat_engine(name: str, family: str, probe: Callable[[], str],
                build: Callable[..., Any], description: str = "") -> ComponentEngine:
    """Flat per-chunk CPU and disk tiers: ``build(FlatConfig) -> FlatEngine``
    (conformance.flat.engine); the campaign takes its page sizes as chunk sizes."""
    return ComponentEngine(name, family, "(CPU, DISK)", probe,
                           _ComponentCampaign(_RUNNERS["(CPU, DISK)"], name, build),
                           description)


def radix_engine(name: str, family: str, probe: Callable[[], str],
                 build: Callable[..., Any], description: str = "") -> ComponentEngine:
    """A device radix tree over flat tiers: ``build(RadixConfig) -> RadixEngine``
    (conformance.flat.engine)."""
    return ComponentEngine(name, family, "(DEVICE, CPU, DISK)", probe,
                           _ComponentCampaign(_RUNNERS["(DEVICE, CPU, DISK)"], name, build),
                           description)


def _cache(name: str, family: str, module: str, machine: str | None = None,
           description: str = "") -> CacheEngine:
    """A built-in engine whose module has ``probe``, ``factory`` and ``scenario_space``
    taking the engine's name first (one module serves several names). SGLang's server
    takes only some of the eviction strategies its caches implement."""
    server = (Deferred("hiradix.engines.sglang", "server_space") if family == "sglang"
              else _no_constraints)
    return CacheEngine(
        name, family, Deferred(module, "probe", (name,)), Deferred(module, "factory", (name,)),
        Deferred(module, "scenario_space", (name,)),
        None if machine is None else Deferred(machine, "make_machine", (name,)), description,
        server)


_SG, _VL, _OURS = "hiradix.engines.sglang", "hiradix.engines.vllm", "hiradix.engines.ours"
_SWA_HICACHE = ("write_through", "write_through_selective", "write_back")
_MAMBA_HICACHE = ("write_through", "write_back")

BUILT_IN: dict[str, Engine] = {engine.name: engine for engine in (
    _cache("ours", "hiradix", f"{_OURS}.cache", description="our cache, as an adapter"),
    _cache("sglang-radix", "sglang", f"{_SG}.radix", description="RadixCache (device only)"),
    _cache("sglang", "sglang", f"{_SG}.radix", description="HiRadixCache"),
    _cache("sglang-unified", "sglang", f"{_SG}.unified", description="UnifiedRadixCache"),
    _cache("sglang-storage", "sglang", f"{_SG}.storage", f"{_SG}.storage_machine",
           "HiRadixCache with its storage tier"),
    _cache("sglang-unified-storage", "sglang", f"{_SG}.unified_storage",
           f"{_SG}.unified_storage_machine", "UnifiedRadixCache with its storage tier"),
    _cache("sglang-unified-rust", "sglang", f"{_SG}.rust",
           description="UnifiedRadixCache on the Rust tree core"),
    _cache("sglang-unified-rust-hicache", "sglang", f"{_SG}.rust_hicache",
           description="UnifiedRadixCache on the Rust core with HiCache"),
    _cache("vllm", "vllm", f"{_VL}.cache", f"{_VL}.machine", "KVCacheManager"),
    _cache("vllm-offload", "vllm", f"{_VL}.cache", f"{_VL}.machine",
           "KVCacheManager with the CPU offloading connector"),
    swa_engine("ours-swa", "hiradix", Deferred(f"{_OURS}.swa", "probe"),
               Deferred(f"{_OURS}.swa", "build")),
    swa_engine("sglang-swa", "sglang", Deferred(f"{_SG}.swa", "probe"),
               Deferred(f"{_SG}.swa", "build")),
    swa_engine("sglang-swa-rust", "sglang", Deferred(f"{_SG}.swa_rust", "probe"),
               Deferred(f"{_SG}.swa_rust", "build")),
    *(swa_engine(f"sglang-swa-hicache-{policy}", "sglang",
                 Deferred(f"{_SG}.swa", "probe_hicache"),
                 Deferred(f"{_SG}.swa", f"build_{policy}")) for policy in _SWA_HICACHE),
    # vLLM's coordinator is driven request by request (spec/13 13.9, spec/13m 13m.8a),
    # by machines of its own.
    ComponentEngine("vllm-hybrid", "vllm", "(FULL, SWA)", Deferred(f"{_VL}.hybrid", "probe"),
                    Deferred(f"{_VL}.hybrid_machine", "run_vllm_hybrid_campaign")),
    mamba_engine("ours-mamba", "hiradix", Deferred(f"{_OURS}.mamba", "probe"),
                 Deferred(f"{_OURS}.mamba", "build")),
    mamba_engine("sglang-mamba", "sglang", Deferred(f"{_SG}.mamba", "probe"),
                 Deferred(f"{_SG}.mamba", "build")),
    *(mamba_engine(f"sglang-mamba-hicache-{policy}", "sglang",
                   Deferred(f"{_SG}.mamba_hicache", "probe"),
                   Deferred(f"{_SG}.mamba_hicache", f"build_{policy}"))
      for policy in _MAMBA_HICACHE),
    ComponentEngine("vllm-mamba", "vllm", "(FULL, MAMBA)", Deferred(f"{_VL}.mamba", "probe"),
                    Deferred(f"{_VL}.mamba_machine", "run_vllm_mamba_campaign")),
    flat_engine("lmcache", "lmcache", Deferred("hiradix.engines.lmcache.flat", "probe"),
                Deferred("hiradix.engines.lmcache.flat", "build"),
                "LMCacheEngine's CPU and disk tiers (spec/15)"),
    radix_engine("sglang-lmcache", "sglang",
                 Deferred("hiradix.engines.lmcache.sglang_radix", "probe"),
                 Deferred("hiradix.engines.lmcache.sglang_radix", "build"),
                 "SGLang's LMCRadixCache over LMCache's CPU and disk tiers (spec/15 15.9)"),
)}


def installed() -> dict[str, importlib.metadata.EntryPoint]:
    """The engines installed packages declare in the ``hiradix.engines`` group."""
    return {point.name: point
            for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> tuple[str, ...]:
    """Every engine name ``lookup`` knows here: the built-in ones, then the installed."""
    return (*BUILT_IN, *sorted(set(installed()) - set(BUILT_IN)))


def _checked(found: object, where: str, name: str | None) -> Engine:
    if not isinstance(found, (CacheEngine, ComponentEngine)):
        raise EngineError(f"--engine: {where} is a {type(found).__name__}, not an engine "
                          "record (hiradix.engines.CacheEngine or ComponentEngine)")
    if name is not None and found.name != name:
        raise EngineError(f"--engine: {where} is registered as {name!r} but names itself "
                          f"{found.name!r}")
    return found


def _imported(reference: str) -> Engine:
    module, _, attribute = reference.partition(":")
    if not module or not attribute:
        raise EngineError(f"--engine: {reference!r} must be package.module:attribute")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except ImportError as missing:
        raise EngineError(f"--engine: cannot import {module}: {missing}") from None
    except AttributeError:
        raise EngineError(f"--engine: {module} has no attribute {attribute!r}") from None
    return _checked(found, reference, None)


def lookup(name: str) -> Engine:
    """The engine ``name`` names (see the module's docstring for the order)."""
    if ":" in name:
        return _imported(name)
    if name in BUILT_IN:
        return BUILT_IN[name]
    points = installed()
    if name in points:
        try:
            found = points[name].load()
        except (ImportError, AttributeError) as broken:
            raise EngineError(f"--engine: the entry point {name} = {points[name].value} "
                              f"does not load: {broken}") from None
        return _checked(found, f"the entry point {name} = {points[name].value}", name)
    raise EngineError(f"--engine: unknown engine {name!r} (known here: "
                      f"{', '.join(names())}; or package.module:attribute)")


def cache_engine(name: str) -> CacheEngine:
    """``lookup(name)``, which must be a ``CacheEngine``."""
    engine = lookup(name)
    if not isinstance(engine, CacheEngine):
        raise EngineError(f"--engine: {name} is a {engine.components} engine, driven by "
                          "its component campaign, not by an adapter")
    return engine


def probe(name: str) -> str:
    """The installed version of engine ``name``; ``EngineUnavailable`` if it cannot run."""
    return lookup(name).probe()


def factory(name: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    """A constructor of fresh adapters of engine ``name`` for ``scenario``."""
    return cache_engine(name).factory(scenario)


def scenario_space(name: str) -> dict[str, tuple[object, ...]]:
    """The scenario values engine ``name``'s adapter takes (an axis absent: any value)."""
    return dict(cache_engine(name).scenario_space())


def server_space(name: str) -> dict[str, tuple[object, ...]]:
    """The scenario values engine ``name``'s own server can run (an axis absent: any)."""
    return dict(cache_engine(name).server_space())

