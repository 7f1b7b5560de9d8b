"""The one exception type diffquant raises for bad input (kept apart so every layer can import it downward)."""


class DiffquantError(Exception):
    """An error caused by the user's input; the CLI prints it as one line, without a traceback."""
