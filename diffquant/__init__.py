"""diffquant: profile and quantize Differential Transformers and their matched baselines.

Heavy modules (torch, transformers) load lazily so `diffquant --help` answers at once.
"""

__version__ = "0.1.0"


class DiffquantError(Exception):
    """An error caused by the user's input; the CLI prints it as one line, without a traceback."""
