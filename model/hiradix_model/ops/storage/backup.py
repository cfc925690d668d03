"""backup_pages: the scheduler's own call of S-R1 on a run of cached pages (spec/09, 9.4).

S-R1 runs by itself when a host copy lands (``writing_check``) or is made at once (a
``write_back`` eviction). A caller may also ask for it on any run of cached pages; what
it may back up is only what S-R1 itself would: pages whose host copy has landed. A page
whose device-to-host copy is still in flight has host slots that hold nothing yet, and a
write from them would store those bytes under the page's name, with a valid checksum,
for every later reader (INV-STORAGE-WRITE-SOURCE). Such a call is refused.
"""

from __future__ import annotations

from hiradix_model.errors import PreconditionError  # noqa: F401 (used by the contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key, page_keys
from hiradix_model.ops._draft import Draft, require, require_key
from hiradix_model.ops.storage._common import is_attached, issue_write, storage_of
from hiradix_model.state import State, in_flight


def backup_pages(state: State, key: Key, start: int, end: int) -> tuple[State, bool]:
    """S-R1 for pages ``[start, end)`` of ``key``; True if a write was issued.

    **Pre:** a backend is attached; ``0 <= start < end <=`` the key's whole pages; each
    page of the run is cached with a host copy that has landed (no d2h copy in flight
    writes its slots). **Effect:** S-R1 on the run: the pages the backend lacks are
    written, each host-protected until the write's ack is drained. Nothing else.

    pre: not check(state)
    post: not check(__return__[0])
    raises: PreconditionError
    """
    require(state.storage is not None and state.storage.backend is not None, "backend",
            "no storage backend is attached")
    require_key(key)
    pages = page_keys(key, state.config.page_size)
    for name, value in (("start", start), ("end", end)):
        require(isinstance(value, int) and not isinstance(value, bool), "run",
                f"{name} must be an int, got {value!r}")
    require(0 <= start < end <= len(pages), "run",
            f"pages [{start}, {end}) are not a non-empty run of the key's {len(pages)} pages")
    run = pages[start:end]
    arriving = in_flight(state, "d2h")
    for page in run:
        record = state.pages.get(page)
        require(record is not None, "run", f"{page} is not cached")
        assert record is not None
        require(record.host is not None, "run", f"{page} has no host copy to back up")
        assert record.host is not None
        require(not set(record.host) & arriving, "run",
                f"{page}'s host copy is still in flight (d2h): not acknowledged")
    draft = Draft(state)
    before = storage_of(draft).next_id
    assert is_attached(draft)
    issue_write(draft, run)
    return draft.freeze(), storage_of(draft).next_id != before
