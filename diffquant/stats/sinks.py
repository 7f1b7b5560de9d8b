"""Attention sinks and massive activations, as streaming, mergeable per-layer statistics.

- **First-token mass** (Gu et al. 2024, arXiv 2410.10781): per head, the attention a query puts on the
  first position of its sequence (the first key it may attend), averaged over queries. Query 0 is left
  out: it can attend only to itself, so its mass is 1 whatever the head does. A head is a **sink** when
  its mean mass exceeds ε (0.3, as Gu et al.); the **sink rate** is the fraction of sink heads.
- **DIFF: per differential head** j (softmax maps A1 = map j, A2 = map j + H/2, as transformers pairs them):
  the first-key masses of A1 and A2 and the layer's λ, and the head's **share** on the first token,
  mean over queries of (A1 − λ·A2)[q, 0] / (1 − λ): the rows of the differential map sum to 1 − λ, so the
  share is the fraction of the head's output weight on token 0, as a softmax head's mass is. A2 mass on
  token 0 *cancels* A1's (a head with A1 mass 0.1, A2 mass 0.6 and λ = 0.5 has share −0.4), and a layer
  with λ < 0 adds its maps. A differential head is a sink when its share exceeds ε, and DIFF's sink rate
  counts differential heads, never A1 and A2 maps pooled (their own rates stay as detail). Where
  |1 − λ| ≤ 0.05 the share is undefined (a near-zero row sum): the layer says so and its heads are not
  counted.
- **Value-state drain** (Guo et al. 2024, arXiv 2410.13835): per sequence, ‖v₀‖ / median over t ≥ 1 of
  ‖v_t‖ (the output of v_proj, all heads), averaged over sequences.
- **Massive activations** (Sun et al. 2024, arXiv 2402.17762): per sequence, the residual-state norm
  ratio max_t ‖h_t‖ / median_t ‖h_t‖ of the decoder-layer output, averaged over sequences, and the largest
  one seen with its sequence, position and the channel of its largest |value|.

Padding: only valid tokens and valid (query, key) pairs count; the first position is the first valid one.
"""

from __future__ import annotations

import torch

from diffquant.errors import DiffquantError

from diffquant.stats.constants import EPSILON, LAMBDA_GUARD  # noqa: E402,F401 - defined there, used here
# Results files name the sink rate they hold: "share" = DIFF counted per differential head by its share on token 0.
# Files without it were written when DIFF's rate pooled its A1 and A2 maps (A2 is subtracted: no headline).
SINK_DEFINITION = "share"


def differential_share(map_mass: list[float], lam: float | None) -> tuple[list[float] | None, str | None]:
    """(Each differential head's share on the first token, None) from the mean first-key entries of its
    map A1 − λ·A2; (None, why) where the share is undefined."""
    if lam is None:
        return None, "λ was not observed"
    if 1.0 - lam <= LAMBDA_GUARD:
        return None, (f"1 − λ = {1.0 - lam:.3g} ≤ {LAMBDA_GUARD}: the differential map's rows sum to about 0 or "
                      "less, so a share of them is undefined (with λ > 1 a negative mass over a negative sum would "
                      "read as a large share)")
    return [m / (1.0 - lam) for m in map_mass], None


def first_key_mass(probs: torch.Tensor, valid: torch.Tensor | None, block: tuple[int, int, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over queries of the mass on each row's first valid key, per head; number of queries counted).
    probs: [batch, head, q, k]; valid broadcastable to it; `block` (taps/context.py's `Block`) when probs holds a
    block of rows (and maybe fewer keys than the call). Query rows whose first valid key is themselves (the first
    token) or that have no valid key are not counted."""
    b, h, q, k = probs.shape
    start, total, keys = (0, q, k) if block is None else (block[0], block[2], block[3])
    if valid is None:  # every key visible: only a query whose own key is key 0 (the call's first token) is left out
        mass = probs[:, :, (1 if start + keys - total == 0 else 0):, 0].float()
        return mass.sum(dim=(0, 2)).double(), torch.tensor(b * mass.shape[2], dtype=torch.float64, device=probs.device)
    v = valid.expand(b, -1, q, k)[:, :1]  # the mask is the same for every head
    first = v.to(torch.int8).argmax(dim=-1)  # [b, 1, q] first valid key of each query row
    own = torch.arange(start, start + q, device=probs.device) + (keys - total)  # each query's own key position
    rows = v.any(dim=-1) & (first != own)  # not the query itself
    return first_key_sums(probs.float().gather(-1, first[..., None].expand(b, h, q, 1))[..., 0], rows)


def first_key_sums(mass: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`first_key_mass` from each query's mass on its first valid key ([batch, head, q]) and the query rows
    to count (boolean, broadcastable to [batch, 1, q])."""
    rows = rows.expand(mass.shape[0], 1, mass.shape[2])
    return torch.where(rows, mass.float(), 0.0).sum(dim=(0, 2)).double(), rows.sum().double()


def norm_ratio(x: torch.Tensor, valid_tokens: torch.Tensor | None, first_only: bool):
    """Per sequence of x [batch, pos, channel]: ‖x_first‖ / median of the others' norms (`first_only`), or
    max / median over all positions (median: the middle value, or the mean of the two middle ones).
    Returns (ratios [batch], positions [batch]); sequences with fewer than two valid tokens get nan."""
    norms = x.float().norm(dim=-1)  # [batch, pos]
    if valid_tokens is not None:
        norms = torch.where(valid_tokens.reshape(norms.shape), norms, torch.nan)
    ok = ~norms.isnan()
    if first_only:
        where = ok.to(torch.int8).argmax(dim=1)
        top = norms.gather(1, where[:, None])[:, 0]
        rest = norms.scatter(1, where[:, None], torch.nan)
    else:
        where = norms.nan_to_num(-1.0).argmax(dim=1)
        top = norms.gather(1, where[:, None])[:, 0]
        rest = norms
    ratios = top / torch.nanquantile(rest, 0.5, dim=1).clamp_min(1e-30)
    return torch.where(ok.sum(dim=1) >= 2, ratios, torch.nan), where


class LayerSinks:
    """The sink and massive-activation sums of one layer; `merge` adds them (exact). Every sum stays on the device
    of the activations it comes from until `summary` (nothing is read back to the host per forward); `to` moves
    them (as the profiler does before merging ranks)."""

    def __init__(self):
        self.mass: dict[str, torch.Tensor] = {}  # "probs" / "map": per-head float64 sums of first-key mass
        self.queries: dict[str, torch.Tensor] = {}
        self._lam: torch.Tensor | None = None  # DIFF: the layer's λ (a parameter: constant while profiling)
        self.value: torch.Tensor | None = None  # float64 [sum of ratios, sequences]
        self.massive: torch.Tensor | None = None
        # the largest massive-activation ratio seen: float64 [ratio, row, position, channel, norm]; ratio -1: none
        self._massive_max: torch.Tensor | None = None

    def __setstate__(self, state: dict) -> None:  # profiles saved before the sums stayed on the device: numbers
        if "lam" in state:
            lam, best = state.pop("lam"), state.pop("massive_max")
            state["_lam"] = None if lam is None else torch.tensor(lam, dtype=torch.float64)
            for key in ("value", "massive"):
                state[key] = torch.tensor(state[key], dtype=torch.float64)
            state["_massive_max"] = None if best is None else torch.tensor(
                [best[k] for k in ("ratio", "row", "position", "channel", "norm")], dtype=torch.float64)
        self.__dict__.update(state)

    @property
    def lam(self) -> float | None:
        return None if self._lam is None else float(self._lam)

    @lam.setter
    def lam(self, value: float | None) -> None:  # docs/rerender.py sets λ recovered from stored masses
        self._lam = None if value is None else torch.tensor(float(value), dtype=torch.float64)

    @property
    def massive_max(self) -> dict | None:
        if self._massive_max is None or float(self._massive_max[0]) < 0:
            return None
        ratio, row, position, channel, norm = self._massive_max.tolist()
        return {"ratio": ratio, "row": int(row), "position": int(position), "channel": int(channel), "norm": norm}

    def add_mass(self, which: str, probs: torch.Tensor, valid: torch.Tensor | None, block=None) -> None:
        self._add(which, *first_key_mass(probs.detach(), valid, block))

    def add_first_key(self, which: str, mass: torch.Tensor, rows: torch.Tensor) -> None:
        """`add_mass` from each query's mass on its first key alone (see `first_key_sums`)."""
        self._add(which, *first_key_sums(mass.detach(), rows))

    def _add(self, which: str, s: torch.Tensor, n: torch.Tensor) -> None:
        self.mass[which] = s + self.mass[which] if which in self.mass else s
        self.queries[which] = n + self.queries[which] if which in self.queries else n

    def add_lambda(self, lam: torch.Tensor) -> None:
        if lam.numel() != 1:
            raise DiffquantError(f"a DIFF layer's λ has {lam.numel()} values; diffquant's sink metrics take one per layer")
        self._lam = lam.detach().reshape(())

    def add_values(self, v: torch.Tensor, valid_tokens: torch.Tensor | None) -> None:
        r, _ = norm_ratio(v.detach(), valid_tokens, first_only=True)
        self.value = _add_sums(self.value, r)

    def add_hidden(self, h: torch.Tensor, valid_tokens: torch.Tensor | None, row_offset: int = 0) -> None:
        r, pos = norm_ratio(h.detach(), valid_tokens, first_only=False)
        self.massive = _add_sums(self.massive, r)
        ok = ~r.isnan()
        best = torch.where(ok, r, -1.0).argmax()  # the first of the largest ratios; -1 where none is defined
        p = pos[best]
        token = h[best, p]
        found = torch.stack([torch.where(ok[best], r[best], -1.0).double(), (best + row_offset).double(), p.double(),
                             token.abs().argmax().double(), token.float().norm().double()])
        if self._massive_max is None:
            self._massive_max = torch.full_like(found, -1.0)
        self._massive_max = torch.where(found[0] > self._massive_max[0], found, self._massive_max)

    def to(self, device) -> "LayerSinks":
        out = LayerSinks()
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        out.mass = {k: v.to(device) for k, v in self.mass.items()}
        out.queries = {k: v.to(device) for k, v in self.queries.items()}
        out._lam, out.value, out.massive, out._massive_max = (move(self._lam), move(self.value), move(self.massive),
                                                             move(self._massive_max))
        return out

    def merge(self, other: "LayerSinks") -> "LayerSinks":
        out = LayerSinks()
        for which in set(self.mass) | set(other.mass):
            out.mass[which] = _sum(self.mass.get(which), other.mass.get(which))
            out.queries[which] = _sum(self.queries.get(which), other.queries.get(which))
        out._lam = self._lam if self._lam is not None else other._lam
        out.value, out.massive = _sum(self.value, other.value), _sum(self.massive, other.massive)
        best = [m for m in (self._massive_max, other._massive_max) if m is not None]
        out._massive_max = best[0] if len(best) == 1 else None if not best else (
            best[1].to(best[0].device) if float(best[1][0]) > float(best[0][0]) else best[0])
        return out

    def summary(self, diff: bool, epsilon: float = EPSILON) -> dict:
        """Per layer: `first_mass` (every softmax map), `share` (each counted head's share on the first
        token: a softmax head's first-key mass, a differential head's share), `sink` (heads counted and
        sinks among them); DIFF adds λ, the A1 and A2 masses per differential head, their own sink counts,
        `first_mass_map` (the differential map's mean first-key entry, before dividing by 1 − λ) and
        `share_undefined` where the share is."""
        mean = {w: (total.cpu() / max(1.0, float(self.queries[w]))).tolist() for w, total in self.mass.items()}
        out: dict = {}
        if "probs" in mean:
            mass = mean["probs"]
            out["first_mass"] = mass
            if not diff:
                out["share"] = mass
                out["sink"] = {"heads": len(mass), "sinks": sum(v > epsilon for v in mass)}
            else:
                half = len(mass) // 2
                out["lambda"] = self.lam
                out["first_mass_A1"], out["first_mass_A2"] = mass[:half], mass[half:]
                out["sink_A1"] = {"heads": half, "sinks": sum(v > epsilon for v in mass[:half])}
                out["sink_A2"] = {"heads": half, "sinks": sum(v > epsilon for v in mass[half:])}
        if diff and "map" in mean:
            share, why = differential_share(mean["map"], self.lam)
            heads = len(mean["map"])
            out["first_mass_map"] = mean["map"]
            out["share"] = share if share is not None else [None] * heads
            out["sink"] = {"heads": heads, "sinks": sum(v > epsilon for v in share or ()),
                           "undefined": heads if share is None else 0}
            if why:
                out["share_undefined"] = why
        out["value_ratio"] = _mean(self.value)
        out["massive_ratio"] = _mean(self.massive)
        out["massive_max"] = self.massive_max
        return out


def _add_sums(sums: torch.Tensor | None, ratios: torch.Tensor) -> torch.Tensor:
    """[sum, count] (float64) plus the defined ratios (not NaN) of one batch: their sum taken in float32, as one
    sum of the defined ratios alone would be, then added in float64."""
    ok = ~ratios.isnan()
    part = torch.stack([torch.where(ok, ratios, 0.0).sum().double(), ok.sum().double()])
    return part if sums is None else sums + part


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return a + b.to(a.device)


def _mean(sums: torch.Tensor | None) -> float | None:
    if sums is None:
        return None
    total, count = sums.tolist()
    return total / count if count else None


def model_sink_rates(layers: dict[int, dict]) -> dict:
    """Over all layers: `sink_rate` (Gu et al.'s metric; DIFF: over differential heads by their share),
    the unit it counts, the heads counted and left undefined, the mean first-token share; DIFF: each map's
    own sink rate (detail, never the headline) and λ per layer; the extreme massive-activation and
    value-drain ratios."""
    diff = any("lambda" in s for s in layers.values())
    rates: dict = {}
    counts = [s["sink"] for s in layers.values() if "sink" in s]
    if counts:
        heads = sum(c["heads"] - c.get("undefined", 0) for c in counts)
        rates["sink_rate"] = sum(c["sinks"] for c in counts) / heads if heads else None
        rates["sink_unit"] = "differential head (share of A1 − λ·A2 on token 0)" if diff else "attention head"
        rates["sink_heads"] = heads
        shares = [v for s in layers.values() for v in s.get("share", ()) if v is not None]
        rates["first_share_mean"] = sum(shares) / len(shares) if shares else None
    if diff:
        rates["sink_heads_undefined"] = sum(c.get("undefined", 0) for c in counts)
        for key in ("sink_A1", "sink_A2"):
            parts = [s[key] for s in layers.values() if key in s]
            heads = sum(c["heads"] for c in parts)
            rates[key.replace("sink", "sink_rate")] = sum(c["sinks"] for c in parts) / heads if heads else None
        rates["lambda"] = [s.get("lambda") for _, s in sorted(layers.items())]
    ratios = [s["massive_ratio"] for s in layers.values() if s.get("massive_ratio") is not None]
    rates["massive_ratio_max"] = max(ratios) if ratios else None
    values = [s["value_ratio"] for s in layers.values() if s.get("value_ratio") is not None]
    rates["value_ratio_min"] = min(values) if values else None
    return rates
