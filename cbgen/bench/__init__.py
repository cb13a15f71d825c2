"""Benchmark harness: ``python -m cbgen bench`` (see README, "Benchmark")."""
