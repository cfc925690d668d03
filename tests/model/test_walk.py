"""The model's own check (the main job until the implementation lands) runs and reports."""

from __future__ import annotations

import pytest

from hiradix_model import walk


def test_walk_runs_clean_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert walk.main(["--seconds", "2", "--steps", "60", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "0 violations" in out


def test_walk_fails_on_a_broken_model(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from hiradix_model.ops import _draft

    real = _draft.Draft.freeze

    def drifting(self: _draft.Draft):  # type: ignore[no-untyped-def]
        state = real(self)
        return state.__class__(**{**state.__dict__, "evictable_tokens": state.evictable_tokens
                                  + (1 if state.pages else 0)})

    monkeypatch.setattr(_draft.Draft, "freeze", drifting)
    assert walk.main(["--seconds", "2", "--steps", "60"]) == 1
    assert "INV-ACCOUNTING" in capsys.readouterr().err
