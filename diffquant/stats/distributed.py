"""Merge statistics across torch.distributed ranks."""

from __future__ import annotations

import torch

from diffquant.stats.site_stats import SiteStats


def merge_across_ranks(stats: dict[str, SiteStats]) -> dict[str, SiteStats]:
    """All-gather every rank's statistics (moved to CPU, they are small) and merge them on each rank (see
    `gather_merge`), back on the device they were computed on."""
    if rank_world()[1] == 1:
        return stats
    device = next(iter(stats.values())).nonfinite.device if stats else torch.device("cpu")
    merged = gather_merge({name: s.to("cpu") for name, s in stats.items()})
    return {name: s.to(device) for name, s in merged.items()}


def gather_merge(objects: dict) -> dict:
    """All-gather a dict of small CPU statistics with a `merge` method and merge them on each rank, in rank
    order, over every key some rank has: a rank that ran no batch holds none, and adds nothing."""
    import torch.distributed as dist

    if rank_world()[1] == 1:
        return objects
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, objects)
    return merge_in_rank_order(gathered)


def merge_in_rank_order(parts: list[dict]) -> dict:
    """One dict from every rank's: each key's values merged left to right in rank order (`a.merge(b)`, so ties
    keep the lower rank's, as one process fed the ranks' batches in turn would), over every key some rank has."""
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = value if key not in merged else merged[key].merge(value)
    return merged


def init_distributed() -> None:
    """Join the torchrun process group when launched by torchrun (gloo on CPU, nccl on CUDA)."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def finish_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (nothing outside torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside torchrun."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
