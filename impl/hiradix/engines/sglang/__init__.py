"""SGLang's caches (0.5.20 and 0.5.23): RadixCache, HiRadixCache, UnifiedRadixCache on the
Python and Rust cores, with HiCache and storage, (FULL, SWA) and (FULL, MAMBA); its event
stream. Each runs from its own venv (make sglang-env, make sglang23-env)."""

# The eviction strategies SGLang's server takes (``--radix-eviction-policy`` choices,
# 0.5.20 and 0.5.23 ``arg_groups/choices.py:190``; 0.5.23 adds ``tlru``, which the spec
# lacks: DEV-28). The cache classes implement ``fifo``, ``mru`` and ``filo`` too
# (``mem_cache/utils.py:59-67``): reachable only beyond the server (spec/04 4.4).
SERVER_STRATEGIES: tuple[str, ...] = ("lru", "lfu", "slru", "priority")


def server_space() -> dict[str, tuple[object, ...]]:
    """What SGLang's server can run of the scenario space (``catalog.CacheEngine``)."""
    return {"eviction": SERVER_STRATEGIES}
