"""The (FULL, MAMBA) hybrid cache on the device tier (spec/13m).

- ``node``: a radix node (a state on its last page) and the split that keeps handles valid;
- ``tree``: the tree of nodes and the walk along a key;
- ``pools``: the full KV pool and the Mamba state pool (13m.3 alloc/free, states, fork);
- ``cache``: ``MambaCache``, the operations of 13m.3 (insert, match_prefix, locks);
- ``evict``: evict_full and evict_states, least recently used first (13m.3);
- ``checker``: the invariants of 13m.5 on the concrete cache.
"""

from hiradix.mamba.cache import MambaCache, MambaMatch
from hiradix.mamba.node import MambaNode

__all__ = ["MambaCache", "MambaMatch", "MambaNode"]
