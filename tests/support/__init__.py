"""Shared pieces of the tests (and of the benchmarks that reuse them)."""
