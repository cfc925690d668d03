"""Checking (FULL, MAMBA) caches against spec/13 (13.11): protocol, abstraction, machine."""
