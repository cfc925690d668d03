"""Checking (FULL, MAMBA) caches against spec/13m (13m.8): protocol, abstraction, machine."""
