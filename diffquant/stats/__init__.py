"""Streaming, mergeable activation statistics, computed on the activation's device (stats/site_stats.py:
SiteStats; histogram, moments, topk: its parts; sinks, metric_sets: the sink and the papers' metrics)."""
