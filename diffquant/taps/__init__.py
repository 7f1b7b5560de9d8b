"""Sites and taps: name every activation, attach observers and transforms to it.

The site names (`sites`) are plain data; the tap machinery (`tap`) imports torch and transformers, so its
names load on first use: `diffquant sites` and argument errors answer without them."""

from diffquant.taps.sites import POINTS, Site, SiteTable, site_docs

_TAP = ("Attachment", "Batch", "TapContext", "attach", "site_table", "tapped")
__all__ = ["POINTS", "Site", "SiteTable", "site_docs", *_TAP]


def __getattr__(name: str):
    if name in _TAP:
        from diffquant.taps import tap

        return getattr(tap, name)
    raise AttributeError(f"module 'diffquant.taps' has no attribute {name!r}")
