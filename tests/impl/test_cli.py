"""``hiradix check`` usage errors: one line on stderr, exit 2, before any example runs --
never a conformance FAILED with a reproducer (issue #6, "failing loudly")."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hiradix import cli
from hiradix.conformance.adapters import ENGINES, EngineUnavailable, probe

BAD = [
    (["--examples", "0"], "--examples: must be positive"),
    (["--seconds", "-1"], "--seconds: must be positive"),
    (["--page-sizes", "0"], "--page-sizes: must be positive"),
    (["--steps", "0"], "--steps: must be positive"),
    (["--policies", "write_sometimes"], "--policies: unknown write_sometimes"),
    (["--strategies", "random"], "--strategies: unknown random"),
    (["--engine", "ours", "--policies", "write_back"], "--policies: the differential suite"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_command_line_is_one_line_and_exit_2(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"hiradix check: {message}"), err
    assert err.count("\n") == 1 and "FAILED" not in out + err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA usage error")
def test_the_cuda_engine_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--engine", "cuda", "--seconds", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


MISSING = [(engine, package) for engine, package in [
    ("sglang", "sglang"), ("sglang-radix", "sglang"), ("sglang-unified", "sglang"),
    ("sglang-unified-rust", "sglang"), ("vllm", "vllm"), ("vllm-offload", "vllm")]
    if importlib.util.find_spec(package) is None]


@pytest.mark.skipif(not MISSING, reason="every engine is installed in this environment")
@pytest.mark.parametrize(("engine", "package"), MISSING)
def test_a_missing_engine_is_a_usage_error_naming_its_setup(
        engine: str, package: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EngineUnavailable, match=f"{package} is not installed.*make "):
        probe(engine)
    assert cli.main(["check", "--engine", engine, "--seconds", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "make " in err and "FAILED" not in out + err


def test_every_engine_is_registered_with_a_probe() -> None:
    assert set(ENGINES) >= {"ours", "sglang", "sglang-radix", "sglang-unified",
                            "sglang-unified-rust", "vllm", "vllm-offload"}
    assert probe("ours") == "hiradix"


def test_an_engine_whose_api_changed_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def renamed(engine: str, scenario: object) -> object:
        def build() -> object:
            raise AttributeError("module 'sglang.srt.mem_cache' has no attribute 'HiRadixCache'")
        return build
    monkeypatch.setattr(cli, "factory", renamed)
    assert cli.main(["check", "--engine", "ours", "--seconds", "1"]) == 2
    out, err = capsys.readouterr()
    assert "does not match its adapter's API" in err and "HiRadixCache" in err
    assert "FAILED" not in out


def test_traces_name_the_engine_with_its_installed_version() -> None:
    assert cli.engine_label("ours", "hiradix") == "hiradix"
    assert cli.engine_label("sglang-unified", "0.5.23") == "sglang-unified 0.5.23"
