"""The committed results and the generators that write the reports from them: python -m docs.NAME (see docs/README.md)."""
