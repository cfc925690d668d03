"""hiradix: the production two-tier radix KV cache (torch).

The implementation lands with issue #3; until then this package holds only its version.
The executable spec is the sibling package ``hiradix_model``.
"""

__version__ = "0.1.0"
