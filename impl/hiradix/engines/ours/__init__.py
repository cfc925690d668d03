"""hiradix itself as an engine: the adapters over our own caches."""
