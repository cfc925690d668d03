"""match_prefix (spec/03-operations.md, "match_prefix")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key, page_keys
from hiradix_model.ops._draft import Draft, require_key, require_tick
from hiradix_model.state import State


@dataclass(frozen=True)
class MatchResult:
    device_slots: tuple[int, ...]  # slots of the leading run of device pages
    last_device_page: Key | None  # the deepest page of that run; None: the root
    last_host_page: Key | None  # the deepest matched page with a host copy; None: the root
    host_hit_tokens: int  # tokens of matched host-only pages after the device run


def match_prefix(state: State, key: Key, now: int) -> tuple[State, MatchResult]:
    """Find the longest cached page prefix of ``key``; stamp the matched pages with ``now``.

    pre: not check(state)
    post: not check(__return__[0])
    post: len(__return__[1].device_slots) % state.config.page_size == 0
    post: __return__[0].pages.keys() == state.pages.keys()
    raises: PreconditionError
    """
    require_key(key)
    draft = Draft(state)
    require_tick(draft, now)
    draft.clock = now
    matched = []
    for page in page_keys(key, draft.ps):
        record = draft.pages.get(page)
        if record is None:
            break
        matched.append(page)
        draft.set_page(page, replace(record, last_tick=now))
    device = [p for p in matched if draft.page(p).device is not None]
    with_host = [p for p in matched if draft.page(p).host is not None]
    slots = tuple(s for p in device for s in draft.page(p).device or ())
    result = MatchResult(
        device_slots=slots,
        last_device_page=device[-1] if device else None,
        last_host_page=with_host[-1] if with_host else None,
        host_hit_tokens=draft.ps * (len(matched) - len(device)),
    )
    return draft.freeze(), result
