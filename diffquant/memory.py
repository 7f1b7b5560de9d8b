"""Peak memory of a profile or sweep, estimated before it starts, so a run that cannot fit is refused in one line
instead of being killed by the kernel's out-of-memory killer minutes later.

The estimate is the model's weights, one forward's activations at the widest layer, and one query block of
tapped attention (taps/attention.py sizes blocks to a memory budget; its floor of 64 rows can still exceed the
machine at very long windows)."""

from __future__ import annotations

from dataclasses import dataclass

from diffquant.errors import DiffquantError

ACTIVATION_COPIES = 12  # live [batch, T, width] tensors in one decoder layer's forward, at the widest width


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Estimate:
    weights: int
    activations: int
    attention: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.attention

    def text(self) -> str:
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
        return (f"about {gib(self.total)} (weights {gib(self.weights)}, activations {gib(self.activations)}, "
                f"attention blocks {gib(self.attention)})")


def estimate(model, batch: int, seq_len: int) -> Estimate:
    """Peak bytes of running `model` on [batch, seq_len] tokens with taps on its attention."""
    from diffquant.taps.attention import BYTES_PER_LOGIT, query_block

    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    width = max(c.hidden_size, getattr(c, "intermediate_size", None) or 4 * c.hidden_size)
    activations = ACTIVATION_COPIES * batch * seq_len * width * 4
    heads = c.num_attention_heads
    rows = min(seq_len, query_block(batch, heads, seq_len))
    return Estimate(weights, activations, rows * batch * heads * seq_len * BYTES_PER_LOGIT)


def check_fits(model, batch: int, seq_len: int, what: str) -> Estimate:
    """Refuse (one line) a run whose estimated peak exceeds the memory this machine has available. The model
    is loaded already, so what must still fit is the activations and the attention blocks."""
    est = estimate(model, batch, seq_len)
    free = available_bytes()
    if free is not None and est.activations + est.attention > free:
        raise DiffquantError(f"{what} on [{batch} × {seq_len:,}] tokens needs {est.text()}, but {free / 2**30:.1f} GiB "
                             "are available: lower --batch-size or --seq-len")
    return est
