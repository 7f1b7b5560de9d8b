"""Sites and taps: name every activation, attach observers and transforms to it."""

from diffquant.taps.sites import POINTS, Site, SiteTable, site_docs
from diffquant.taps.tap import Attachment, Batch, TapContext, attach, site_table, tapped

__all__ = ["POINTS", "Site", "SiteTable", "site_docs", "Attachment", "Batch", "TapContext", "attach", "site_table", "tapped"]
