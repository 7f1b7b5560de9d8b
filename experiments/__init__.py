"""Experiments: one entry point per question (python -m experiments.NAME); see experiments/README.md."""
