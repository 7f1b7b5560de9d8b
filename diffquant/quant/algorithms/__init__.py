"""The algorithms: GPTQ, AWQ, the fixes (SmoothQuant, rotations, clipping), the KV cache, and the registry of
recipe steps (steps.py). diffquant's own steps register as their classes are defined; importing their modules here
makes the registries whole wherever one is read (none of them loads torch)."""

from diffquant.quant.algorithms import mitigate, solvers  # noqa: F401  (defines and registers the built-in steps)
