"""Engines a component machine drives, by name: where each one's module is, its builder
and its probe, imported only when asked for (an engine's package is in its own venv)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Generic, TypeVar

B = TypeVar("B")


class EngineRegistry(Generic[B]):
    """``entries``: name -> (module, builder attribute, probe attribute). Engines in
    ``request_level`` have a probe but no builder: their own request-level machine
    (named by ``driver``) drives them."""

    def __init__(self, entries: Mapping[str, tuple[str, str, str]],
                 request_level: frozenset[str], driver: str, protocol: str) -> None:
        self.entries = entries
        self.request_level = request_level
        self.driver = driver
        self.protocol = protocol

    def probe(self, engine: str) -> str:
        """The installed version of ``engine``; ``EngineUnavailable`` if it cannot run."""
        module, _, probe_name = self.entries[engine]
        version: str = getattr(importlib.import_module(module), probe_name)()
        return version

    def builder(self, engine: str) -> B:
        """The constructor of fresh adapters of ``engine``, one per configuration."""
        if engine in self.request_level:
            raise ValueError(f"engine: {engine} is driven by {self.driver}, not by the "
                             f"{self.protocol} machine")
        module, build_name, _ = self.entries[engine]
        build: B = getattr(importlib.import_module(module), build_name)
        return build
