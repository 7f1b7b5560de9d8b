"""Sub-commands beyond the basics, registered in one place (explicit, no import side effects)."""

from __future__ import annotations


def register(sub) -> None:
    """Add each feature's sub-command parser."""
    from diffquant import profile

    profile.add_parser(sub)
