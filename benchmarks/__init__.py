"""Benchmarks and cross-checks against other tools, each run as a module from the repository root: python -m benchmarks.NAME."""
