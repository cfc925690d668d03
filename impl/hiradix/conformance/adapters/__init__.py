"""Engine adapters for the differential suite (see ``base`` for the protocol).

``ours`` is always available. ``sglang-radix`` (SGLang's device-only RadixCache) and
``sglang`` (HiRadixCache, device + host) need SGLang 0.5.20 importable: set up its
environment with ``make sglang-env`` and run from ``.venv-sglang``.
"""

from __future__ import annotations

from collections.abc import Callable

from hiradix.conformance.adapters.base import OPERATIONS, EngineAdapter
from hiradix.conformance.scenario import Scenario

ENGINES = ("ours", "sglang-radix", "sglang")


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    """A constructor of fresh adapters of ``engine`` for ``scenario``."""
    if engine == "ours":
        from hiradix.conformance.adapters.ours import OursAdapter
        return lambda: OursAdapter(scenario)
    if engine in ("sglang-radix", "sglang"):
        from hiradix.conformance.adapters import sglang
        return sglang.factory(engine, scenario)
    raise ValueError(f"engine: must be one of {ENGINES}, got {engine!r}")


__all__ = ["ENGINES", "OPERATIONS", "EngineAdapter", "factory"]
