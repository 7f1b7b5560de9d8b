"""Exact streaming top-k of |x| with the coordinates of each value."""

from __future__ import annotations

import torch


class TopK:
    """The k largest |x| seen, with their signed values, coordinates in the site's dims, and token ids.

    `coords` holds one column per site dim plus the token id at the query/token position (-1 when
    unknown); the batch coordinate is global (row offset added).

    Nothing is read back to the host while values are offered (except with `add`'s `read_back`, where reading is
    free): where fewer than k valid values were offered, the kept entries include left-out ones, whose |x| is -1,
    so they sort below every value; `abs`, `values` and `coords` hold only the valid entries.
    """

    def __init__(self, k: int, ndim: int, device=None):
        self.k = k
        self._abs = torch.empty(0, dtype=torch.float32, device=device)
        self._values = torch.empty(0, dtype=torch.float32, device=device)
        self._coords = torch.empty(0, ndim + 1, dtype=torch.int64, device=device)

    def __setstate__(self, state: dict) -> None:  # profiles saved before held only valid entries, named without _
        self.__dict__.update({("_" + k if k in ("abs", "values", "coords") else k): v for k, v in state.items()})

    @property
    def abs(self) -> torch.Tensor:
        return self._abs[self._abs >= 0]

    @property
    def values(self) -> torch.Tensor:
        return self._values[self._abs >= 0]

    @property
    def coords(self) -> torch.Tensor:
        return self._coords[self._abs >= 0]

    def add(self, x: torch.Tensor, ok: torch.Tensor | None, dims: tuple[str, ...], input_ids=None,
            row_offset: int = 0, rowmax: torch.Tensor | None = None, pos_offset: int = 0,
            pos_total: int | None = None, read_back: bool = False, finite: bool = False) -> None:
        """Offer the values of x (shaped by `dims`) where `ok` (broadcastable) is True (None: all of them).
        `pos_offset` is added to the position coordinate when x holds positions pos_offset.. of `pos_total`.

        With `rowmax` (|x| maxima along the last dim, 0 or -1 for rows without a valid value), only the k rows
        with the largest maxima are searched: every element of the top k lies in one of them (a row
        outside them has k larger elements elsewhere). With `read_back` (where reading a value back costs
        nothing: SiteStats' FREE_READS), an update none of whose rows reaches the least of k kept values returns
        at once: merged, its values would all sort after the kept ones, which the stable merge keeps as they are.
        Few are skipped where every update holds a large value (SmolLM2's logits: 52 of 1,290 query blocks per
        forward, each other block holding a first-key logit as large as the running top-100). With `finite`, inf and
        NaN are left out here (the caller's `ok` does not leave them out; its `rowmax` must)."""
        k = min(self.k, x.numel())
        if k == 0:
            return
        if rowmax is not None and x.dim() >= 2 and rowmax.numel() > k:
            if read_back and self._abs.numel() == self.k and not bool((rowmax >= self._abs[-1]).any()):
                return
            _, rows = torch.topk(rowmax.reshape(-1), k)
            # index the (maybe broadcast) mask by row coordinates: no full-size copy
            mask = None if ok is None else ok.expand(x.shape)[torch.unravel_index(rows, x.shape[:-1])]
            self.add_rows(rows, x.reshape(-1, x.shape[-1])[rows], mask, x.shape, dims, input_ids, row_offset,
                          pos_offset, pos_total, finite)
            return
        a = x.float().abs() if ok is None else torch.where(ok, x.float().abs(), -1.0)
        if finite:
            a = torch.where(a.isfinite(), a, -1.0)
        top, idx = torch.topk(a.reshape(-1), k)
        self._offer(top, x.reshape(-1)[idx].float(), idx, x.shape, dims, input_ids, row_offset, pos_offset, pos_total)

    def add_rows(self, rows: torch.Tensor, values: torch.Tensor, ok: torch.Tensor | None, shape: torch.Size,
                 dims: tuple[str, ...], input_ids=None, row_offset: int = 0, pos_offset: int = 0,
                 pos_total: int | None = None, finite: bool = False) -> None:
        """Offer the rows `rows` (flat indices over shape[:-1]) of a tensor shaped `shape`, given as `values`
        [len(rows), shape[-1]] with `ok` of the same shape (None: all valid): `add`'s search once it chose its rows
        (the tapped attention's Triton path gives the rows it recomputed, kernels/flash.py)."""
        k = min(self.k, values.numel())
        if k == 0:
            return
        width = shape[-1]
        cand = values.float().abs()
        if ok is not None:
            cand = torch.where(ok, cand, -1.0)
        if finite:
            cand = torch.where(cand.isfinite(), cand, -1.0)
        top, col = torch.topk(cand.reshape(-1), k)
        idx = rows[col // width] * width + col % width
        self._offer(top, values.reshape(-1)[col].float(), idx, shape, dims, input_ids, row_offset, pos_offset,
                    pos_total)

    def _offer(self, top, values, idx, shape, dims, input_ids, row_offset, pos_offset, pos_total) -> None:
        """Merge the entries at flat indices `idx` of a tensor shaped `shape` (|x| `top`, signed `values`), with their
        coordinates and token ids."""
        coords = torch.stack(torch.unravel_index(idx, shape), dim=1) if len(shape) else idx.new_zeros(len(idx), 0)
        token = torch.full((len(idx), 1), -1, dtype=torch.int64, device=idx.device)
        pos_dim = dims.index("pos") if "pos" in dims else dims.index("q_pos") if "q_pos" in dims else None
        if pos_dim is not None:
            coords[:, pos_dim] += pos_offset
        if "batch" in dims:
            b = dims.index("batch")
            total = pos_total if pos_total is not None else (shape[pos_dim] if pos_dim is not None else None)
            if input_ids is not None and pos_dim is not None and input_ids.shape[1] == total:
                ids = input_ids.to(idx.device)
                token[:, 0] = ids[coords[:, b], coords[:, pos_dim]]
            coords[:, b] += row_offset
        self._merge_raw(top, values, torch.cat([coords, token], dim=1))

    def _merge_raw(self, a, v, c) -> None:
        """Keep the k largest of the kept entries and these, by a stable sort: of equal |x|, those kept before
        stay first and in their order (torch.topk orders ties by its own algorithm, which depends on the array's
        length: with it, an update skipped for having nothing to add could reorder the kept ties)."""
        device = self._abs.device
        a = torch.cat([self._abs, a.to(device)])
        v = torch.cat([self._values, v.to(device)])
        c = torch.cat([self._coords, c.to(device)])
        k = min(self.k, a.numel())
        top, idx = torch.sort(a, descending=True, stable=True)
        top, idx = top[:k], idx[:k]
        self._abs, self._values, self._coords = top, v[idx], c[idx]

    def merge(self, other: "TopK") -> "TopK":
        out = TopK(self.k, self._coords.shape[1] - 1, self._abs.device)
        out._abs, out._values, out._coords = self._abs, self._values, self._coords
        out._merge_raw(other._abs, other._values, other._coords)
        return out

    def rank(self, r: int) -> float | None:
        """The r-th largest |x| (1-based), or None if fewer were seen."""
        value = float(self._abs[r - 1]) if r <= self._abs.numel() else -1.0
        return value if value >= 0 else None
