"""Which engine tests run here, and how an engine that cannot run is reported.

An engine whose package is not installed in this environment, or is installed at a
version its adapter does not drive, is skipped: that environment was never set up for
it. An engine that is installed at a driven version but does not import or construct as
its adapter expects fails: a broken environment must be loud. ``.ci/run`` names the
engines each environment it built must run in ``HIRADIX_REQUIRE_ENGINES``
(comma-separated); for those, every kind of unavailability fails.
"""

from __future__ import annotations

import os

import pytest

from hiradix.engines import EngineUnavailable, probe


def require(engine: str) -> str:
    """The installed version of ``engine`` (any engine ``hiradix.engines.lookup`` knows);
    skips or fails the calling test otherwise."""
    required = set(filter(None, os.environ.get("HIRADIX_REQUIRE_ENGINES", "").split(",")))
    try:
        return probe(engine)
    except EngineUnavailable as unavailable:
        if engine in required or unavailable.kind == "api":
            pytest.fail(f"{unavailable} [HIRADIX_REQUIRE_ENGINES={','.join(sorted(required))}]",
                        pytrace=False)
        pytest.skip(str(unavailable))
