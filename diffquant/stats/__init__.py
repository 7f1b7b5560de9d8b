"""Streaming, mergeable activation statistics, computed on the activation's device."""

from diffquant.stats.histogram import AbsHistogram
from diffquant.stats.moments import Moments
from diffquant.stats.site_stats import QUANTILES, SiteStats
from diffquant.stats.topk import TopK

__all__ = ["AbsHistogram", "Moments", "QUANTILES", "SiteStats", "TopK"]
