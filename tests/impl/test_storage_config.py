"""Storage configuration: parsing from JSON text and @files, field checks, the backend
factory and the prefetch timeout."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.storage import (
    FileBackend,
    MemoryBackend,
    StorageArgumentError,
    StorageConfig,
    StorageConfigError,
    config_from_mapping,
    make_backend,
    page_identity,
    parse_storage_config,
    prefetch_timeout,
)
from hiradix.storage.config import MAX_CONFIG_BYTES

FULL = {
    "backend": "file",
    "path": "/var/cache/hiradix",
    "prefetch_policy": "timeout",
    "prefetch_threshold_tokens": 128,
    "timeout_base_s": 1,
    "timeout_per_1k_tokens_s": 0.5,
    "timeout_max_s": 8.0,
    "max_prefetch_tokens_in_flight": 4096,
    "model_identity": "llama-3-8b@abc123",
}
EXPECTED = StorageConfig(backend="file", path="/var/cache/hiradix", prefetch_policy="timeout",
                         prefetch_threshold_tokens=128, timeout_base_s=1.0,
                         timeout_per_1k_tokens_s=0.5, timeout_max_s=8.0,
                         max_prefetch_tokens_in_flight=4096,
                         model_identity="llama-3-8b@abc123")
TOML = """
backend = "file"
path = "/var/cache/hiradix"
prefetch_policy = "timeout"
prefetch_threshold_tokens = 128
timeout_base_s = 1
timeout_per_1k_tokens_s = 0.5
timeout_max_s = 8.0
max_prefetch_tokens_in_flight = 4096
model_identity = "llama-3-8b@abc123"
"""


def test_defaults_from_a_minimal_json_string() -> None:
    config = parse_storage_config('{"model_identity": "m"}')
    assert config == StorageConfig(model_identity="m")
    assert (config.backend, config.path, config.prefetch_policy) == ("memory", None,
                                                                     "best_effort")
    assert config.prefetch_threshold_tokens == 256
    assert config.max_prefetch_tokens_in_flight is None


def test_every_field_from_a_json_string() -> None:
    config = parse_storage_config(json.dumps(FULL))
    assert config == EXPECTED
    assert isinstance(config.timeout_base_s, float)  # ints are taken as seconds too


def test_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "storage.json"
    path.write_text(json.dumps(FULL))
    assert parse_storage_config(f"@{path}") == EXPECTED


def test_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "storage.TOML"
    path.write_text(TOML)
    assert parse_storage_config(f"@{path}") == EXPECTED


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML not installed")
def test_from_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "storage.yaml"
    path.write_text(TOML.replace(" = ", ": "))  # every value here is YAML as written
    assert parse_storage_config(f"@{path}") == EXPECTED


def test_yaml_files_go_through_yaml_safe_load(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs without PyYAML too: a stand-in module records what the parser was handed.
    seen: list[str] = []
    stand_in = types.ModuleType("yaml")

    def safe_load(text: str) -> object:
        seen.append(text)
        return {"model_identity": "from-yaml"}

    stand_in.safe_load = safe_load  # type: ignore[attr-defined]
    stand_in.YAMLError = ValueError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "yaml", stand_in)
    path = tmp_path / "storage.yaml"
    path.write_text("model_identity: from-yaml\n")
    assert parse_storage_config(f"@{path}") == StorageConfig(model_identity="from-yaml")
    assert seen == ["model_identity: from-yaml\n"]


def test_yaml_without_pyyaml_says_to_install_it(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    path = tmp_path / "storage.yml"
    path.write_text("model_identity: m\n")
    with pytest.raises(StorageConfigError, match="pip install pyyaml"):
        parse_storage_config(f"@{path}")


BAD_VALUES = [
    ("backend", "redis"),
    ("backend", None),
    ("path", ""),
    ("path", 7),
    ("prefetch_policy", "eager"),
    ("prefetch_threshold_tokens", -1),
    ("prefetch_threshold_tokens", 2.5),
    ("prefetch_threshold_tokens", True),
    ("prefetch_threshold_tokens", "256"),
    ("timeout_base_s", -0.1),
    ("timeout_base_s", "1"),
    ("timeout_per_1k_tokens_s", float("inf")),
    ("timeout_per_1k_tokens_s", False),
    ("timeout_max_s", None),
    ("max_prefetch_tokens_in_flight", 0),
    ("max_prefetch_tokens_in_flight", 1.0),
    ("model_identity", ""),
    ("model_identity", 3),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_each_bad_value_names_its_field_the_expectation_and_the_value(
        field: str, value: object) -> None:
    fields = {**FULL, field: value}
    with pytest.raises(StorageConfigError) as raised:
        config_from_mapping(fields)
    error = raised.value
    assert error.field == field == error.argument
    assert error.expected is not None and error.expected in str(error)
    assert error.value == value
    assert repr(value) in str(error)


@pytest.mark.parametrize(("fields", "field", "says"), [
    ({"model_identity": "m", "backend": "file"}, "path", "required"),
    ({"model_identity": "m", "path": "/tmp/x"}, "path", "only to the file backend"),
    ({"model_identity": "m", "timeout_base_s": 5, "timeout_max_s": 4}, "timeout_max_s",
     ">= timeout_base_s"),
    ({"backend": "memory"}, "model_identity", "required"),
    ({"model_identity": "m", "prefetch_timeout": 3}, "prefetch_timeout", "not a storage"),
])
def test_inconsistent_or_unknown_fields_are_named(fields: dict[str, object], field: str,
                                                  says: str) -> None:
    with pytest.raises(StorageConfigError, match=says) as raised:
        parse_storage_config(json.dumps(fields))
    assert raised.value.field == field


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a mapping of fields"),
    ("@", "followed by a file path"),
    ("@/no/such/storage.json", "cannot read"),
    ("@storage.ini", "extension"),
])
def test_unreadable_text_is_a_typed_error(text: str, says: str) -> None:
    with pytest.raises(StorageConfigError, match=says):
        parse_storage_config(text)


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.json"
    os.mkfifo(path)  # opening it for reading would wait for a writer
    return path


def _device(tmp_path: Path) -> Path:
    path = tmp_path / "zero.json"
    path.symlink_to("/dev/zero")  # endless: reading it would never finish
    return path


def _written(name: str, data: bytes) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        return path
    return make


@pytest.mark.parametrize(("make", "says"), [
    (_fifo, "not a regular file"),
    (_device, "not a regular file"),
    (_written("latin.json", b'{"model_identity": "caf\xe9"}'), "not UTF-8"),
    (_written("huge.json", b" " * (MAX_CONFIG_BYTES + 1) + b"{}"), "larger than"),
    (_written("deep.json", b"[" * 100_000 + b"]" * 100_000), "nests too deeply"),
    (_written("deep.toml", b"x = " + b"[" * 100_000 + b"]" * 100_000), "nests too deeply"),
])
def test_hostile_config_files_are_typed_errors(tmp_path: Path, make: Callable[[Path], Path],
                                               says: str) -> None:
    with pytest.raises(StorageConfigError, match=says) as raised:
        parse_storage_config(f"@{make(tmp_path)}")
    assert raised.value.field == "text"


def test_a_path_with_nul_is_a_typed_error() -> None:
    with pytest.raises(StorageConfigError, match="NUL") as raised:
        parse_storage_config("@/tmp/a\0b.json")
    assert raised.value.field == "text"


def test_bad_toml_and_non_string_text(tmp_path: Path) -> None:
    path = tmp_path / "storage.toml"
    path.write_text("backend = \n")
    with pytest.raises(StorageConfigError, match="not valid TOML"):
        parse_storage_config(f"@{path}")
    with pytest.raises(StorageConfigError) as raised:
        parse_storage_config(b"{}")  # type: ignore[arg-type]
    assert raised.value.field == "text"


def test_make_backend(tmp_path: Path) -> None:
    memory = make_backend(StorageConfig(model_identity="m"))
    assert isinstance(memory, MemoryBackend)
    file = make_backend(StorageConfig(model_identity="m", backend="file",
                                      path=str(tmp_path / "pages")))
    assert isinstance(file, FileBackend) and file.root == tmp_path / "pages"
    with pytest.raises(StorageArgumentError):
        make_backend({"backend": "memory"})  # type: ignore[arg-type]


def test_prefetch_timeout_is_linear_and_capped() -> None:
    config = StorageConfig(model_identity="m", timeout_base_s=2.0,
                           timeout_per_1k_tokens_s=0.5, timeout_max_s=4.0)
    assert prefetch_timeout(config, 0) == 2.0
    assert prefetch_timeout(config, 2048) == 3.0
    assert prefetch_timeout(config, 10 ** 6) == 4.0
    for bad in (-1, 1.5, True):
        with pytest.raises(StorageArgumentError) as raised:
            prefetch_timeout(config, bad)  # type: ignore[arg-type]
        assert raised.value.argument == "num_tokens"


@given(st.floats(0, 100), st.floats(0, 10), st.floats(0, 100), st.integers(0, 10 ** 7))
def test_prefetch_timeout_stays_between_base_and_max(base: float, slope: float, extra: float,
                                                     tokens: int) -> None:
    config = StorageConfig(model_identity="m", timeout_base_s=base,
                           timeout_per_1k_tokens_s=slope, timeout_max_s=base + extra)
    timeout = prefetch_timeout(config, tokens)
    assert base <= timeout <= base + extra
    assert timeout == min(base + extra, base + slope * tokens / 1024)


def test_page_identity_uses_the_model_identity() -> None:
    device = DeviceKVPool(num_slots=4, page_size=2, layers=1, dtype=torch.float16)
    host = HostKVPool(device, num_slots=4)
    identity = page_identity(StorageConfig(model_identity="qwen@1"), host)
    assert (identity.model, identity.dtype) == ("qwen@1", "float16")
