"""Sub-commands beyond the basics, registered in one place (explicit, no import side effects)."""

from __future__ import annotations


def register(sub) -> None:
    """Add each feature's sub-command parser (each module keeps its heavy imports inside functions)."""
    from diffquant import profile
    from diffquant.data import cli as data_cli

    from diffquant.quant import cli as quant_cli

    profile.add_parser(sub)
    quant_cli.add_parser(sub)
    data_cli.add_parser(sub)
