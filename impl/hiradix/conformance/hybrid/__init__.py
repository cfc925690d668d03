"""Checking (FULL, SWA) hybrid caches against the model of spec/13."""
