"""Hypothesis profiles, chosen by HIRADIX_PROFILE: ci (bounded), dev (default), soak."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "dev", max_examples=500, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "soak", max_examples=20000, stateful_step_count=200, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.load_profile(os.environ.get("HIRADIX_PROFILE", "dev"))


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    from stats import RUNS

    if RUNS:
        rules = ", ".join(f"{k}={v}" for k, v in sorted(RUNS.items())
                          if k not in ("examples", "steps"))
        terminalreporter.write_line(
            f"stateful runs: {RUNS['examples']} examples, {RUNS['steps']} steps "
            f"(profile {os.environ.get('HIRADIX_PROFILE', 'dev')}); rules: {rules}"
        )
