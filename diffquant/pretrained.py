"""The one call that loads a transformers causal LM from a folder, as diffquant loads every model."""

from __future__ import annotations


def from_pretrained(path, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` as diffquant loads every model: without transformers' hub kernels.

    Since transformers 5.2x `from_pretrained` kernelizes every model when the `kernels` package is installed (a
    dependency of transformers 5.25): on CUDA it swaps the forwards of RMSNorm, rotary embeddings and activations
    for kernels fetched from the hub. diffquant measures the model's own code, and downloads nothing unasked; with
    the default, a CUDA load without network failed outright (benchmarks/gpu_check.sh on an H100, 2026-12-05:
    "Version 2 of 'kernels-community/rotary' is not available in the local cache"). `use_kernels=True` opts in."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **{"use_kernels": False, **kwargs})
