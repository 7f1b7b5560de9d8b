"""Streaming central moments (count, mean, M2, M3, M4) in float64, mergeable exactly (Pébay 2008)."""

from __future__ import annotations

import torch


def sum64(t: torch.Tensor) -> torch.Tensor:
    """Sum with a float64 accumulator without a float64 copy of the tensor: rows are summed in float32
    (short, so exact to float32 rounding), the row sums in float64."""
    if t.dim() >= 2:
        return t.sum(dim=-1).double().sum()
    return t.double().sum()


def shift_central(n, delta, e1, p2, p3, p4):
    """Σ(d − δ)^p for p = 2..4 from the power sums of deviations d (Σd = e1, Σd² = p2, ...): the central sums about the
    exact mean c + δ of values whose deviations were taken from a centre c (a float32 rounding of the mean)."""
    dd = delta * delta
    return (p2 - 2 * delta * e1 + n * dd, p3 - 3 * delta * p2 + 3 * dd * e1 - n * dd * delta,
            p4 - 4 * delta * p3 + 6 * dd * p2 - 4 * dd * delta * e1 + n * dd * dd)


class Moments:
    """Moments of every valid value seen; all state lives on the activation's device as float64."""

    def __init__(self, device=None):
        z = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        self.n, self.mean, self.m2, self.m3, self.m4 = z(), z(), z(), z(), z()

    @classmethod
    def _of(cls, n, mean, m2, m3, m4) -> "Moments":
        """Moments holding these tensors, without the five zeros `__init__` makes (each a kernel launch on a GPU;
        pooling runs once per query block)."""
        m = cls.__new__(cls)
        m.n, m.mean, m.m2, m.m3, m.m4 = n, mean, m2, m3, m4
        return m

    @staticmethod
    def pool(n: torch.Tensor, s1: torch.Tensor, m2: torch.Tensor, m3: torch.Tensor, m4: torch.Tensor) -> "Moments":
        """Moments of several batches at once, from each one's count, sum and central power sums (vectors):
        each batch's sums are moved to the pooled mean (Σ(d + δ)^p expanded, Σd = 0), then added."""
        total = n.sum()
        mean = s1.sum() / total.clamp_min(1)
        delta = torch.where(n > 0, s1 / n.clamp_min(1) - mean, 0.0)
        d2 = delta * delta
        return Moments._of(total, mean, (m2 + n * d2).sum(), (m3 + 3 * delta * m2 + n * d2 * delta).sum(),
                           (m4 + 4 * delta * m3 + 6 * d2 * m2 + n * d2 * d2).sum())

    @staticmethod
    def of(x: torch.Tensor, mask: torch.Tensor | None) -> "Moments":
        """Moments of one tensor (float32 differences, float64 sums)."""
        m = Moments(x.device)
        if mask is None:
            m.n = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
            s1 = sum64(x)
        else:
            m.n = mask.sum(dtype=torch.float64)
            s1 = sum64(torch.where(mask, x, 0))
        m.mean = s1 / m.n.clamp_min(1)
        d = x - m.mean.to(x.dtype)
        if mask is not None:
            d = torch.where(mask, d, 0)
        d2 = d * d
        m.m2 = sum64(d2)
        m.m3 = sum64(d2 * d)
        m.m4 = sum64(d2.mul_(d2))
        return m

    def merge(self, other: "Moments") -> "Moments":
        """Combine two disjoint sets of values (exact up to float64 rounding)."""
        na, nb = self.n, other.n.to(self.n.device)
        n = na + nb
        safe = n.clamp_min(1)
        delta = other.mean.to(self.n.device) - self.mean
        ob = {k: getattr(other, k).to(self.n.device) for k in ("m2", "m3", "m4")}
        return Moments._of(
            n, self.mean + delta * nb / safe, self.m2 + ob["m2"] + delta**2 * na * nb / safe,
            (self.m3 + ob["m3"] + delta**3 * na * nb * (na - nb) / safe**2
             + 3 * delta * (na * ob["m2"] - nb * self.m2) / safe),
            (self.m4 + ob["m4"] + delta**4 * na * nb * (na * na - na * nb + nb * nb) / safe**3
             + 6 * delta**2 * (na * na * ob["m2"] + nb * nb * self.m2) / safe**2
             + 4 * delta * (na * ob["m3"] - nb * self.m3) / safe))

    def summary(self) -> dict:
        n = float(self.n)
        if n == 0:
            return {"count": 0, "mean": None, "std": None, "kurtosis": None}
        var = float(self.m2) / n
        kurt = (float(self.m4) / n) / var**2 if var > 0 else None
        return {"count": int(n), "mean": float(self.mean), "std": var**0.5, "kurtosis": kurt}

