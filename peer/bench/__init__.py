"""Benchmarks: each measures side by side in one run, prints a table and can write JSON. Never run as tests."""
