"""LMCache (0.5.6): its CPU and disk tiers, alone and under SGLang's LMCRadixCache.
Runs from its own venv (make lmcache-env)."""
