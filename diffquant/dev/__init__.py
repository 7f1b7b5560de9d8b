"""Tools for diffquant's own tests and benchmarks, kept out of the package root: counting host syncs and kernel
launches (syncs.py)."""
