"""Benchmarks: our cache against its peers as shipped, at scale, and the transfer engines."""
