"""SGLang's own KV events against INV-EVENTS-REPLAY (spec/11, 11.6).

SGLang 0.5.20 records ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` when its
recorder (``cache.kv_events``) is enabled, as ``--enable-kv-cache-events`` does. Blocks
are named by int64 hashes; a stored block carries its parent's hash and its page's
tokens, so the page it names is its parent's page plus those tokens, as a router
rebuilds it. The hashes leave the namespace (``extra_key``) out (DEV-E1), so a decoded
page is a page of namespace None: compare only runs without namespaces.
"""

from __future__ import annotations

from typing import Any

from hiradix_model import Event, Key, State
from hiradix_model.events import NOTHING, TIERS, Resident, Tier, replay, residency_problems

MEDIA: dict[str, Tier] = {"GPU": "device", "CPU_PINNED": "host", "DISK": "storage",
                          "EXTERNAL": "storage"}


class SglangEvents:
    """Turns on ``cache``'s event recorder and replays what it records, step by step."""

    def __init__(self, cache: Any) -> None:
        cache.kv_events.enabled = True
        self.recorder = cache.kv_events
        self.names: dict[int, Key] = {}  # block hash -> the page it was stored as
        self.resident: Resident = NOTHING
        self.counts: dict[str, int] = {}  # events decoded, by "kind tier"

    def decode(self, event: Any) -> list[Event]:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":  # no medium: every tier
            return [Event("cleared", tier) for tier in TIERS]
        tier = MEDIA["GPU" if event.medium is None else event.medium]
        if kind == "BlockRemoved":
            return [Event("removed", tier, self.names[h]) for h in event.block_hashes]
        assert kind == "BlockStored", kind
        prefix = () if event.parent_block_hash is None \
            else self.names[event.parent_block_hash].tokens
        size, decoded = event.block_size, []
        for index, block in enumerate(event.block_hashes):
            page = Key(prefix + tuple(event.token_ids[index * size:(index + 1) * size]))
            self.names[block] = page
            decoded.append(Event("stored", tier, page))
            prefix = page.tokens
        return decoded

    def check(self, model: State) -> list[str]:
        """Replay the events recorded since the last check; the problems against
        ``model`` (empty: the stream is exact)."""
        events = [e for raw in self.recorder.take() for e in self.decode(raw)]
        for event in events:
            name = f"{event.kind} {event.tier}"
            self.counts[name] = self.counts.get(name, 0) + 1
        self.resident, problems = replay(events, self.resident)
        return problems + list(residency_problems(model, self.resident))
