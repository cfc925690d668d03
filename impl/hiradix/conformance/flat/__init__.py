"""Checking flat-tier caches (LMCache's CPU and disk tiers) against spec/15, 15.5."""
