"""Peak memory of a profile or sweep, estimated before it starts, so a run that cannot fit is refused in one line
instead of being killed by the kernel's out-of-memory killer (or CUDA's allocator) minutes later.

The estimate is the model's weights, one forward's activations at the widest layer, one query block of tapped
attention (taps/attention.py sizes blocks to a memory budget; its floor of 64 rows can still exceed the
machine at very long windows) and the boolean attention mask, which is materialised whole: T × T bytes (the
mask function registered in taps/attention.py never lets transformers skip it; unpadded batches share one
[1, 1, T, T] mask through a broadcast view). What must fit is
compared with the free memory of the device the model's inputs go to: the GPU's free memory on CUDA
(`torch.cuda.mem_get_info`), MemAvailable on the CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from diffquant.errors import DiffquantError

ACTIVATION_COPIES = 12  # live [batch, T, width] tensors in one decoder layer's forward, at the widest width


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes(device: torch.device | str = "cpu",
                    cuda_free: Callable[[torch.device], tuple[int, int]] | None = None) -> int | None:
    """Free bytes where `device`'s tensors live: on CUDA the device's free memory (`cuda_free`, by default
    torch.cuda.mem_get_info: (free, total)), on the CPU the host's MemAvailable; None for other devices
    (MPS, XLA: not measured, so not refused)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int((cuda_free or torch.cuda.mem_get_info)(device)[0])
    if device.type == "cpu":
        return host_available_bytes()
    return None


@dataclass(frozen=True)
class Estimate:
    weights: int
    activations: int
    attention: int
    mask: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.running

    @property
    def running(self) -> int:
        """What a forward needs beyond the loaded weights."""
        return self.activations + self.attention + self.mask

    def text(self) -> str:
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
        return (f"about {gib(self.total)} (weights {gib(self.weights)}, activations {gib(self.activations)}, "
                f"attention blocks {gib(self.attention)}, attention mask {gib(self.mask)})")


def estimate(model, batch: int, seq_len: int) -> Estimate:
    """Peak bytes of running `model` on [batch, seq_len] tokens with taps on its attention: activations in the
    model's dtype, tapped logits at BYTES_PER_LOGIT (measured, fp32 softmax), a one-byte-per-entry mask."""
    from diffquant.taps.attention import BYTES_PER_LOGIT, query_block

    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    width = max(c.hidden_size, getattr(c, "intermediate_size", None) or 4 * c.hidden_size)
    element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    activations = ACTIVATION_COPIES * batch * seq_len * width * element
    heads = c.num_attention_heads
    rows = min(seq_len, query_block(batch, heads, seq_len, cache=False))  # the most a block may take
    return Estimate(weights, activations, rows * batch * heads * seq_len * BYTES_PER_LOGIT, seq_len * seq_len)


def check_fits(model, batch: int, seq_len: int, what: str, device: torch.device | str | None = None,
               free_bytes: Callable[[torch.device], int | None] = available_bytes) -> Estimate:
    """Refuse (one line) a run whose estimated peak exceeds the free memory of `device` (default: where the
    model's input embeddings are). The model is loaded already, so what must still fit is the activations, the
    attention blocks and the mask. `free_bytes(device)` reads the free memory (injectable for tests)."""
    if device is None:
        device = model.get_input_embeddings().weight.device
    device = torch.device(device)
    est = estimate(model, batch, seq_len)
    free = free_bytes(device)
    if free is not None and est.running > free:
        where = "free on " + str(device) if device.type != "cpu" else "available"
        raise DiffquantError(f"{what} on [{batch} × {seq_len:,}] tokens needs {est.text()}, but {free / 2**30:.1f} GiB "
                             f"are {where}: lower --batch-size or --seq-len")
    return est
