"""Storage configuration: which backend, and the prefetch policy knobs (spec/09, 9.1).

It is read from a JSON string, or from a file named ``@path``: JSON (``.json``), TOML
(``.toml``) or YAML (``.yaml``/``.yml``, which needs PyYAML), as SGLang's
``--hicache-storage-backend-extra-config`` is. Every field is checked when the
``StorageConfig`` is made, however it is made; a bad field raises ``StorageConfigError``
naming the field, what it takes and what it got. Unknown fields are errors too: a typo
must not silently fall back to a default.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args

from hiradix._slots import is_int
from hiradix.host_pool import HostKVPool
from hiradix.storage.backend import StorageBackend
from hiradix.storage.errors import StorageArgumentError, StorageConfigError
from hiradix.storage.file import FileBackend
from hiradix.storage.hashing import PageIdentity
from hiradix.storage.memory import MemoryBackend

BackendKind = Literal["memory", "file"]
BACKENDS: tuple[BackendKind, ...] = get_args(BackendKind)
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = get_args(PrefetchPolicy)
FILE_FORMATS = (".json", ".toml", ".yaml", ".yml")
MAX_CONFIG_BYTES = 1 << 20  # a storage config is a few hundred bytes


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    """The storage tier's settings. ``model_identity`` has no default: it goes into every
    page hash, and two models sharing a default would share pages. Times are seconds;
    the prefetch timeout is ``timeout_base_s + timeout_per_1k_tokens_s * tokens / 1024``,
    capped at ``timeout_max_s``. ``max_prefetch_tokens_in_flight`` None: no set limit."""

    backend: BackendKind = "memory"
    path: str | None = None  # the file backend's directory
    prefetch_policy: PrefetchPolicy = "best_effort"
    prefetch_threshold_tokens: int = 256  # a shorter storage hit is not prefetched
    timeout_base_s: float = 2.0
    timeout_per_1k_tokens_s: float = 0.1
    timeout_max_s: float = 30.0
    max_prefetch_tokens_in_flight: int | None = None
    model_identity: str

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise StorageConfigError.bad_value("backend", f"one of {BACKENDS}", self.backend)
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise StorageConfigError.bad_value("path", "a non-empty str", self.path)
        if self.backend == "file" and self.path is None:
            raise StorageConfigError("path", "is required by the file backend")
        if self.backend != "file" and self.path is not None:
            raise StorageConfigError("path", f"applies only to the file backend, not "
                                             f"{self.backend!r}", value=self.path)
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise StorageConfigError.bad_value("prefetch_policy", f"one of {PREFETCH_POLICIES}",
                                               self.prefetch_policy)
        threshold = self.prefetch_threshold_tokens
        if not is_int(threshold) or threshold < 0:
            raise StorageConfigError.bad_value("prefetch_threshold_tokens", "an int >= 0",
                                               threshold)
        for name in ("timeout_base_s", "timeout_per_1k_tokens_s", "timeout_max_s"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise StorageConfigError.bad_value(name, "a finite number >= 0", value)
            object.__setattr__(self, name, float(value))
        if self.timeout_max_s < self.timeout_base_s:
            raise StorageConfigError("timeout_max_s", f"must be >= timeout_base_s "
                                                      f"({self.timeout_base_s}), got "
                                                      f"{self.timeout_max_s}",
                                     expected=f"a number >= {self.timeout_base_s}",
                                     value=self.timeout_max_s)
        limit = self.max_prefetch_tokens_in_flight
        if limit is not None and (not is_int(limit) or limit < 1):
            raise StorageConfigError.bad_value("max_prefetch_tokens_in_flight",
                                               "an int >= 1 or null", limit)
        if not isinstance(self.model_identity, str) or not self.model_identity:
            raise StorageConfigError.bad_value("model_identity", "a non-empty str",
                                               self.model_identity)


FIELDS = tuple(field.name for field in fields(StorageConfig))


def config_from_mapping(values: Mapping[str, Any]) -> StorageConfig:
    """A ``StorageConfig`` from parsed fields (a JSON object, a TOML table, a YAML map)."""
    if not isinstance(values, Mapping):
        raise StorageConfigError.bad_value("config", "a mapping of fields", values)
    for name in values:
        if name not in FIELDS:
            raise StorageConfigError(str(name), f"is not a storage config field; the "
                                                f"fields are {', '.join(FIELDS)}")
    if "model_identity" not in values:
        raise StorageConfigError("model_identity", "is required: it goes into every page "
                                                   "hash, so pages of two models never mix")
    return StorageConfig(**dict(values))


def _read_file(path_text: str) -> Any:
    """The parsed contents of a config file; its format from its extension."""
    if not path_text:
        raise StorageConfigError("text", "'@' must be followed by a file path")
    if "\0" in path_text:
        raise StorageConfigError("text", "the config file path contains a NUL character")
    path = Path(path_text)
    suffix = path.suffix.lower()
    if suffix not in FILE_FORMATS:
        raise StorageConfigError("text", f"config file {path} has extension {suffix!r}; "
                                         f"expected one of {FILE_FORMATS}")
    content = _read_text(path)
    try:
        return _parse_file(content, path, suffix)
    except RecursionError as error:
        raise StorageConfigError("text", f"{path} nests too deeply to parse") from error


def _read_text(path: Path) -> str:
    """The file's text: a regular file of at most MAX_CONFIG_BYTES, in UTF-8. Checked
    on the open descriptor, so a FIFO or a device (``/dev/zero``) is refused, not read
    (non-blocking open: opening a FIFO would otherwise wait for a writer)."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as stream:
            info = os.fstat(stream.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise StorageConfigError("text", f"config file {path} is not a regular file")
            data = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise StorageConfigError("text", f"cannot read config file {path}: {error}") from error
    if len(data) > MAX_CONFIG_BYTES:
        raise StorageConfigError("text", f"config file {path} is larger than "
                                         f"{MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise StorageConfigError("text", f"config file {path} is not UTF-8: {error}") from error


def _parse_file(content: str, path: Path, suffix: str) -> Any:
    if suffix == ".json":
        return _parse_json(content, str(path))
    if suffix == ".toml":
        try:
            return tomllib.loads(content)
        except tomllib.TOMLDecodeError as error:
            raise StorageConfigError("text", f"{path} is not valid TOML: {error}") from error
    try:
        yaml = importlib.import_module("yaml")
    except ImportError as error:
        raise StorageConfigError("text", f"reading the YAML file {path} needs PyYAML, which "
                                         "is not installed: pip install pyyaml") from error
    try:
        return yaml.safe_load(content)
    except yaml.YAMLError as error:
        raise StorageConfigError("text", f"{path} is not valid YAML: {error}") from error


def _parse_json(content: str, where: str) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError as error:
        raise StorageConfigError("text", f"{where} is not valid JSON: {error}") from error
    except RecursionError as error:
        raise StorageConfigError("text", f"{where} nests too deeply to parse") from error


def parse_storage_config(text: str) -> StorageConfig:
    """A ``StorageConfig`` from a JSON object string, or from ``@path`` (JSON, TOML or
    YAML by extension)."""
    if not isinstance(text, str):
        raise StorageConfigError.bad_value("text", "a JSON string or '@path'", text)
    values = _read_file(text[1:]) if text.startswith("@") else _parse_json(text, "the text")
    return config_from_mapping(values)


def make_backend(config: StorageConfig) -> StorageBackend:
    """The backend ``config`` names."""
    if not isinstance(config, StorageConfig):
        raise StorageArgumentError("config", f"must be a StorageConfig, got "
                                             f"{type(config).__name__}")
    if config.backend == "file":
        assert config.path is not None  # checked by StorageConfig
        return FileBackend(config.path)
    return MemoryBackend()


def prefetch_timeout(config: StorageConfig, num_tokens: int) -> float:
    """Seconds a ``timeout``-policy prefetch of ``num_tokens`` tokens may run: linear in
    the tokens, capped at ``timeout_max_s``. Any int count has an answer: one at or past
    the cap (however large, past what a float holds) is the cap."""
    if not isinstance(config, StorageConfig):
        raise StorageArgumentError("config", f"must be a StorageConfig, got "
                                             f"{type(config).__name__}")
    if not is_int(num_tokens) or num_tokens < 0:
        raise StorageArgumentError("num_tokens", f"must be an int >= 0, got {num_tokens!r}")
    try:
        linear = config.timeout_base_s + config.timeout_per_1k_tokens_s * num_tokens / 1024
    except OverflowError:  # a count past what a float holds: in exact fractions instead
        exact = (Fraction(config.timeout_base_s)
                 + Fraction(config.timeout_per_1k_tokens_s) * num_tokens / 1024)
        return float(min(Fraction(config.timeout_max_s), exact))
    return min(config.timeout_max_s, linear)


def page_identity(config: StorageConfig, host_pool: HostKVPool) -> PageIdentity:
    """The identity every page hash of this cache covers: the configured model and the
    host pool's KV dtype and layout."""
    if not isinstance(config, StorageConfig):
        raise StorageArgumentError("config", f"must be a StorageConfig, got "
                                             f"{type(config).__name__}")
    return PageIdentity.for_pool(host_pool, config.model_identity)
