"""hiradix check --report and the plots module (matplotlib is in the test extra)."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest

from hiradix import cli
from hiradix.conformance import plots
from hiradix.conformance.coverage import COVERAGE
from hiradix.conformance.machine import EXERCISED
from hiradix.conformance.tally import Tally

PNG = b"\x89PNG\r\n\x1a\n"


def test_hit_rates_are_shares_of_the_asked_tokens_per_window() -> None:
    hits = [(10, 5, 0), (10, 0, 10), (4, 4, 0)]
    ends, device, host = plots.hit_rates(hits, window=2)
    assert ends == [2, 3]
    assert device == [0.25, 1.0] and host == [0.5, 0.0]
    assert plots.hit_rates([]) == ([], [], [])


def test_the_report_draws_hit_rates_and_coverage(tmp_path: Path) -> None:
    tally = Tally(hits=[(8, 4, 2)] * 120)
    tally.exercised.update({next(iter(EXERCISED)): 3})
    tally.states.update({next(iter(COVERAGE)): 5})
    tally.rules.update({"request": 120})
    written = plots.write_check_report(tally, str(tmp_path / "r"), EXERCISED, COVERAGE)
    assert [p.name for p in written] == ["hits.png", "coverage.png"]
    assert all(p.read_bytes().startswith(PNG) for p in written)


def test_check_report_counts_the_requests_it_plots(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["check", "--examples", "3", "--page-sizes", "2", "--seed", "1",
                     "--database", "none", "--report", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert (tmp_path / "hits.png").read_bytes().startswith(PNG)
    assert f"(report: {tmp_path / 'hits.png'}" in out


def test_without_matplotlib_report_and_plot_are_usage_errors(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(plots.importlib, "import_module",
                        lambda name: no_matplotlib(name))
    assert cli.main(["check", "--examples", "1", "--report", "/tmp/never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hiradix[plots]" in err[0] and "--report" in err[0]


def test_the_bench_plot_takes_the_tables_medians(tmp_path: Path) -> None:
    from hiradix.bench.cache import medians

    rows = [["1", "insert", "unified-python", "832.4 (1124)", "442.5", "768.8 (1121)", "369.9",
             "0.92", "0.84"],
            ["16", "evict", "unified-rust", "1,291.4 (633)", "1,140.5", "193.1 (654)", "83.0",
             "0.15", "0.07"]]
    assert medians(rows) == [(1, "insert", "unified-python", 442.5, 369.9),
                             (16, "evict", "unified-rust", 1140.5, 83.0)]
    path = plots.write_bench_plot(medians(rows), str(tmp_path / "bench.png"))
    assert path.read_bytes().startswith(PNG)
