"""The (FULL, SWA) hybrid cache on the device tier (spec/13).

- ``node``: a radix node and the split that keeps handles valid;
- ``tree``: the tree of nodes, its window walk (13.2);
- ``pools``: the full and SWA pools and the full->SWA mapping (13.3 alloc/free_swa/free);
- ``cache``: ``SwaCache``, the operations of 13.3 (insert, match_prefix, locks);
- ``evict``: evict_full and evict_swa, least recently used first (13.3);
- ``checker``: the invariants of 13.5 on the concrete cache.
"""

from hiradix.hybrid.cache import SwaCache, SwaMatch
from hiradix.hybrid.node import SwaNode
from hiradix.hybrid.pools import NO_PAIR, SwaPools

__all__ = ["NO_PAIR", "SwaCache", "SwaMatch", "SwaNode", "SwaPools"]
