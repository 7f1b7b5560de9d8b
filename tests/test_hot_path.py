"""The profile's hot path against the computation it replaced, bit for bit, and its host syncs (issue 41).

The statistics got faster: query blocks sized to the cache that end at their last visible key, masks written only
where a causal block holds masked keys, |x| taken in place, the histogram counted by index_add_, top-k kept without
boolean indexing, sink sums kept on the device, and no value read back per update off the CPU. Every statistic must
stay what the old computation gave. The references here are that computation written plainly (whole-tensor masks,
bincount, a full sort, Python floats), never the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffquant.models.presets import PRESETS, build
from diffquant.profiler import SinkObserver, StatsObserver, profile_model
from diffquant.stats import site_stats
from diffquant.stats.histogram import NBINS, AbsHistogram
from diffquant.stats.sinks import LayerSinks, norm_ratio
from diffquant.stats.site_stats import TOKEN_DIMS, SiteStats, _passes
from diffquant.stats.topk import TopK
from diffquant.dev.syncs import HostSyncs
from diffquant.taps import tapped
from diffquant.taps import attention as A

LOGIT_DIMS = ("batch", "head", "q_pos", "k_pos")


def reference_passes(x, valid, check, threshold=None):
    """The old `_passes` written plainly: every mask expanded to x's shape, no in-place arithmetic."""
    ok = None if valid is None else valid.expand_as(x)
    nonfinite = 0
    if check:
        finite = torch.isfinite(x)
        nonfinite = int((~finite).sum()) if ok is None else int((ok & ~finite).sum())
        ok = finite if ok is None else ok & finite
    ok = torch.ones_like(x, dtype=torch.bool) if ok is None else ok
    xz = torch.where(ok, x, 0.0)
    n = ok.sum().double()
    s1 = xz.sum(-1).double().sum()  # rows summed in float32, the row sums in float64
    mean = (s1 / n.clamp_min(1)).float()
    d = torch.where(ok, x - mean, 0.0)
    e1 = d.sum(-1).double().sum()
    p2 = (d * d).sum(-1).double().sum()
    p3 = (d * (d * d)).sum(-1).double().sum()
    p4 = ((d * d) * (d * d)).sum(-1).double().sum()
    s1 = n * mean.double() + e1  # the sum from the deviations, and the sums about the exact mean: Σ(d − δ)^p expanded
    delta = e1 / n.clamp_min(1)
    m2 = p2 - 2 * delta * e1 + n * delta**2
    m3 = p3 - 3 * delta * p2 + 3 * delta**2 * e1 - n * delta**3
    m4 = p4 - 4 * delta * p3 + 6 * delta**2 * p2 - 4 * delta**3 * e1 + n * delta**4
    a = xz.abs()
    bins = torch.bitwise_right_shift(a.view(torch.int32) + 0x8000, 16)  # |x|'s bit pattern rounded to 16 bits
    counts = torch.bincount(bins.reshape(-1), minlength=NBINS)[:NBINS]
    counts[0] -= int((~ok).sum())
    rowmax = a.amax(-1)
    out = {"n": n, "s1": s1, "m2": m2, "m3": m3, "m4": m4, "rowmax": rowmax, "counts": counts,
           "nonfinite": nonfinite}
    if x.dim() == 4:  # [batch, head, q_pos, k_pos]: per head, per query
        out["chan"], out["pos"] = rowmax.amax(dim=(0, 2)), rowmax.amax(dim=(0, 1))
    else:  # [batch, pos, channel]
        out["chan"], out["pos"] = a.amax(dim=(0, 1)), rowmax.amax(dim=0)
    if threshold is not None:
        out["hits"] = (a >= threshold).sum(dim=(0, 1))
    return out


def _heavy(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[..., 3] *= 40
    return x


def _causal_block(b, h, r0, r1, t, end):
    """A query block's logits and mask as the tapped attention passes them: rows r0..r1 over keys 0..end."""
    x = _heavy((b, h, r1 - r0, end), seed=r0)
    valid = (torch.arange(end)[None, :] <= torch.arange(r0, r1)[:, None])[None, None]
    return x, valid, r0 + 1


def _compare(x, valid, check, dense=0, threshold=None):
    ref = reference_passes(x, valid, check, threshold)
    dims = TOKEN_DIMS if x.dim() == 3 else LOGIT_DIMS
    out = _passes(x, valid, check, 2 if x.dim() == 3 else 1, 1 if x.dim() == 3 else 2, threshold, dense)
    counts = torch.bincount(out.bins.reshape(-1), minlength=NBINS)[:NBINS]
    counts[0] -= out.left_out
    got = {"n": out.n, "s1": out.s1, "m2": out.m2, "m3": out.m3, "m4": out.m4, "rowmax": out.rowmax,
           "counts": counts, "nonfinite": int(out.nonfinite), "chan": out.chan, "pos": out.pos}
    if threshold is not None:
        got["hits"] = out.hits
    for key, want in ref.items():
        same = torch.equal(got[key], want) if isinstance(want, torch.Tensor) else got[key] == want
        assert same, (dims, key)


@pytest.mark.parametrize("check", [False, True])
def test_passes_equal_the_old_formulas(check):
    """Token sites (with LLM.int8 hits), a causal logit block whose mask is known dense before its diagonal, and
    a padded block (mask anywhere): every output of `_passes` is the old computation's, bit for bit."""
    _compare(_heavy((4, 32, 64), 1), None, check, threshold=6.0)
    x, valid, dense = _causal_block(2, 3, 48, 80, 200, 128)
    _compare(x, valid, check, dense=dense)
    _compare(x, valid, check, dense=0)
    padded = valid & (torch.arange(128) >= 5)[None, None, None, :]  # left padding: the first keys are masked
    _compare(x, padded, check)
    _compare(_heavy((2, 16, 8), 2).bfloat16().float(), None, check)  # a bf16 model's values, in float32


def test_passes_leave_nonfinite_values_out_as_before():
    x, valid, dense = _causal_block(2, 3, 48, 80, 200, 128)
    x[0, 1, 3, 10] = float("inf")  # valid
    x[1, 2, 5, 100] = float("nan")  # masked
    _compare(x, valid, True, dense=dense)
    tokens = _heavy((4, 32, 64), 3)
    tokens[2, 7, 9] = float("-inf")
    _compare(tokens, None, True, threshold=6.0)


def test_histogram_counts_equal_bincount():
    g = torch.Generator().manual_seed(5)
    bins = torch.randint(0, NBINS, (10_000,), generator=g, dtype=torch.int32)
    hist = AbsHistogram()
    hist.add_bins(bins.view(100, 100), zeros_left_out=torch.tensor(3))
    ref = torch.bincount(bins.long(), minlength=NBINS)
    ref[0] -= 3
    assert torch.equal(hist.counts, ref)
    x = _heavy((50, 20), 6)
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    ok = torch.rand(50, 20, generator=g) > 0.3
    hist = AbsHistogram()
    hist.add(x, ok)
    keep = ok & torch.isfinite(x)
    ref = torch.bincount(torch.bitwise_right_shift(x[keep].abs().view(torch.int32) + 0x8000, 16), minlength=NBINS)
    assert torch.equal(hist.counts, ref[:NBINS])


@pytest.mark.parametrize("k", [5, 1000])  # 1000: more than the 816 valid values, so left-out entries are kept too
def test_topk_equals_a_full_sort_with_locations(k):
    x, valid, _ = _causal_block(2, 3, 0, 16, 16, 16)
    top = TopK(k, 4)
    rowmax = torch.where(valid, x.abs(), -1.0).amax(-1)
    top.add(x, valid, LOGIT_DIMS, rowmax=rowmax)
    where = valid.expand_as(x).nonzero()
    values = x[valid.expand_as(x)]
    order = values.abs().argsort(descending=True)[:k]
    assert torch.equal(top.abs, values[order].abs()) and torch.equal(top.values, values[order])
    assert torch.equal(top.coords[:, :4], where[order]) and bool((top.coords[:, 4] == -1).all())
    assert top.rank(1) == float(values.abs().max()) and (top.rank(k) is None) == (k > len(values))


def _stable_top(entries, k):
    """The k entries of largest |value| from (value, coords) offered in order, ties in the order offered: Python's
    sort is stable, so this is the rule the top-k's merge claims, written without torch."""
    return sorted(entries, key=lambda e: -abs(e[0]))[:k]


def test_topk_skipping_updates_that_cannot_enter_keeps_the_same_entries():
    """Where reading back is free, an update none of whose rows reaches the least kept |x| is skipped: over a
    stream of causal blocks the kept values and locations are those of a stable sort of everything offered, with
    and without skipping, also with ties, whose order the stable merge keeps (kept entries first, then in the order
    offered). The last block comes twice, the second time at query positions offset by 1000, so that each of its
    values ties with one already kept and the two are told apart by their coordinates."""
    blocks = [(*_causal_block(2, 3, r0, r0 + 16, 160, 160)[:2], r0) for r0 in range(0, 160, 16)]
    x, valid, _ = blocks[-1]
    blocks.append((x.clone(), valid, 1000))
    cutoff = torch.cat([x[valid.expand_as(x)].abs() for x, valid, _ in blocks]).sort(descending=True).values[19]
    entries = []  # (value, [batch, head, q_pos, k_pos]) in the order offered, those that can be among the top 20
    for x, valid, offset in blocks:
        big = valid.expand_as(x) & (x.abs() >= cutoff)
        where = big.nonzero()
        where[:, 2] += offset
        entries += list(zip(x[big].tolist(), where.tolist()))
    want = _stable_top(entries, 20)
    for x, valid, _ in blocks:  # no two values tie within one block down to the least kept |x|: the order is defined
        big = x[valid.expand_as(x)].abs()
        big = big[big >= abs(want[-1][0])]
        assert len(set(big.tolist())) == len(big)
    assert any(coords[2] >= 1000 for _, coords in want)  # a tied copy made it into the top 20, after its twin
    assert len({abs(v) for v, _ in want}) < 20
    for read_back in (False, True):
        top = TopK(20, 4)
        for x, valid, offset in blocks:
            rowmax = torch.where(valid, x.abs(), -1.0).amax(-1)
            top.add(x, valid, LOGIT_DIMS, rowmax=rowmax, pos_offset=offset, read_back=read_back)
        assert top.values.tolist() == [v for v, _ in want]
        assert top.coords[:, :4].tolist() == [c for _, c in want]


def test_topk_merge_keeps_more_than_16_ties_in_the_order_offered():
    """30 updates of one value each, |x| = 3 with alternating signs, then a 5 and a −3: k = 20 keeps the 5 first,
    then the first 19 threes in the order offered (signs and rows as a stable sort of the offers gives them). A sort
    that is not stable reorders ties past 16 elements on CPU, keeping plausible but wrong rows and signs."""
    offers = [3.0 * (-1) ** i for i in range(30)] + [5.0, -3.0]
    top = TopK(20, 3)
    for row, v in enumerate(offers):
        x = torch.tensor([[[v]]])
        top.add(x, None, TOKEN_DIMS, row_offset=row, rowmax=x.abs().amax(-1), read_back=True)
    want = _stable_top([(v, [row, 0, 0]) for row, v in enumerate(offers)], 20)
    assert top.values.tolist() == [v for v, _ in want]
    assert top.coords[:, :3].tolist() == [c for _, c in want]
    shards = [TopK(20, 3), TopK(20, 3)]  # rows 0..11 and 12..31 in two shards, merged: the first one's ties first
    for row, v in enumerate(offers):
        shards[row >= 12].add(torch.tensor([[[v]]]), None, TOKEN_DIMS, row_offset=row)
    merged = shards[0].merge(shards[1])
    assert merged.values.tolist() == [v for v, _ in want]
    assert merged.coords[:, :3].tolist() == [c for _, c in want]


@pytest.mark.parametrize("later", [[1.0, 1.0, 0.5], [1.0, 0.5, 3.0]])
def test_topk_ties_keep_their_order_whether_or_not_an_update_is_skipped(later):
    """k = 2 with tied |x| (a reviewer's cases): 3 at positions 0 and 1 (signs +, −), then an update below them
    (skipped where reading back is free) or one holding another 3 (searched either way). Ties are kept in the
    order seen: positions 0 then 1, the later 3 never displacing an earlier one."""
    first = torch.tensor([[[3.0], [-3.0], [0.0]]])
    second = torch.tensor([later]).unsqueeze(-1)
    rows = []
    for read_back in (False, True):
        top = TopK(2, 3)
        for x in (first, second):
            top.add(x, None, TOKEN_DIMS, rowmax=x.abs().amax(-1), read_back=read_back)
        rows.append((top.values.tolist(), top.coords[:, 1].tolist()))
    assert rows[0] == rows[1] == ([3.0, -3.0], [0, 1])


def _profile_micro(arch, sites, monkeypatch, block="32", cut=True):
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", block)
    monkeypatch.setattr(StatsObserver, "cut_keys", cut)
    monkeypatch.setattr(SinkObserver, "cut_keys", cut)
    model = build(PRESETS["micro"], arch, seed=4)
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(5))
    prof = profile_model(model, ids, sites, batch_size=2, progress=False, sinks=True, k=50)
    with tapped(model, {s: StatsObserver(k=5) for s in sites}), torch.no_grad():
        out = model(ids).logits
    return {n: s.summary() for n, s in prof.sites.items()}, prof.sink_summary(), out


@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_blocks_cut_at_their_last_key_equal_uncut_blocks(arch, monkeypatch):
    """300 tokens in blocks of 32 rows: every statistic, the sink metrics and the tapped model's output are the
    same bit for bit whether each block's keys end after its last visible one (the default) or run to the end."""
    sites = ["*.attn_logits", "*.attn_probs", "*.hidden"] + (["*.attn_map"] if arch == "diff" else [])
    cut = _profile_micro(arch, sites, monkeypatch)
    uncut = _profile_micro(arch, sites, monkeypatch, cut=False)
    assert cut[0] == uncut[0] and cut[1] == uncut[1] and torch.equal(cut[2], uncut[2])


def test_a_tap_without_cut_keys_sees_every_key(monkeypatch):
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "32")
    model = build(PRESETS["micro"], "baseline", seed=4)
    widths = {"stats": [], "plain": []}

    class Cut(StatsObserver):
        def __call__(self, x, ctx):
            widths["stats"].append((ctx.block.start, ctx.block.end, x.shape[-1], ctx.block.dense))

    with tapped(model, {"layers.0.attn_logits": [Cut(), lambda x, ctx: widths["plain"].append(x.shape[-1])]}):
        with torch.no_grad():
            model(torch.randint(0, 512, (1, 200)))
    assert widths["plain"] == [200] * 7  # a tap that does not take cut blocks (`cut_keys`): nobody's keys are cut
    assert widths["stats"] == [(s, min(s + 32, 200), 200, s + 1) for s in range(0, 200, 32)]


def test_cut_blocks_end_at_their_last_key(monkeypatch):
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "32")
    model = build(PRESETS["micro"], "baseline", seed=4)
    seen = []

    class Cut(StatsObserver):
        def __call__(self, x, ctx):
            seen.append((ctx.block.start, x.shape[-1], ctx.block.keys))

    with tapped(model, {"layers.0.attn_logits": Cut()}), torch.no_grad():
        model(torch.randint(0, 512, (1, 200)))
    assert seen == [(s, min(200, -(-(s + 32) // A.KEY_ALIGN) * A.KEY_ALIGN), 200) for s in range(0, 200, 32)]


@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_accelerator_path_equals_the_cpu_path(arch, monkeypatch):
    """Off the CPU every update leaves non-finite values out in one checked pass instead of reading the sum back
    first: the same statistics (here on CPU, the accelerators' strategy forced)."""
    sites = ["*.attn_logits", "*.hidden", "*.mlp_in"]
    cpu = _profile_micro(arch, sites, monkeypatch)
    monkeypatch.setattr(site_stats, "FREE_READS", frozenset())
    accelerator = _profile_micro(arch, sites, monkeypatch)
    assert cpu[0] == accelerator[0] and cpu[1] == accelerator[1]
    x = _heavy((4, 32, 64), 8)
    x[1, 2, 3] = float("nan")
    summaries = []
    for free_reads in (frozenset({"cpu"}), frozenset()):
        monkeypatch.setattr(site_stats, "FREE_READS", free_reads)
        s = SiteStats(TOKEN_DIMS)
        s.update(x)
        s.update(x * 2)
        summaries.append(s.summary())
    assert summaries[0] == summaries[1] and summaries[0]["nonfinite"] == 2


def test_layer_sinks_equal_plain_sums():
    """Massive-activation sums kept on the device equal the old Python-float sums, and the largest ratio keeps the
    first of equals with its row, position, channel and norm. (Where a sequence has fewer than two valid tokens,
    its undefined ratio counts as a 0 in its batch's float32 sum, where the old sum skipped it: the same number,
    maybe rounded differently.)"""
    g = torch.Generator().manual_seed(9)
    batches = [torch.randn(3, 12, 16, generator=g) for _ in range(4)]
    batches[1][2, 5] *= 50
    valid = torch.ones(3, 12, 1, dtype=torch.bool)
    valid[0, :5] = False  # left padding
    sinks, total, count, best = LayerSinks(), 0.0, 0, None
    for i, h in enumerate(batches):
        sinks.add_hidden(h, valid, row_offset=3 * i)
        sinks.add_values(h, valid)
        r, pos = norm_ratio(h, valid, first_only=False)
        ok = ~r.isnan()
        total, count = total + float(r[ok].sum()), count + int(ok.sum())
        j = int(torch.where(ok, r, -1.0).argmax())
        if best is None or float(r[j]) > best["ratio"]:
            p = int(pos[j])
            best = {"ratio": float(r[j]), "row": 3 * i + j, "position": p, "channel": int(h[j, p].abs().argmax()),
                    "norm": float(h[j, p].float().norm())}
    out = sinks.summary(diff=False)
    assert out["massive_ratio"] == total / count and out["massive_max"] == best
    assert sinks.to("cpu").merge(LayerSinks()).summary(diff=False) == out


def test_host_sync_counter():
    x = torch.randn(5)
    with HostSyncs() as syncs:
        bool(x.sum() > 0)
        x[x > 0]
        x.to(x.device)  # no copy: not counted
        x.to("cpu")
        torch.bincount(torch.tensor([1, 2]), minlength=4)
        x.abs().amax()
    assert dict(syncs.counts) == {"__bool__": 1, "__getitem__ with a boolean mask": 1, "to(cpu)": 1, "bincount": 1}



def test_launch_counter_counts_kernels_not_views():
    from diffquant.dev.syncs import Launches

    x = torch.randn(4, 6)
    with Launches() as n:
        y = x.view(-1).reshape(6, 4).t()[1:]  # views only
        z = (y + 1).abs_().sum(dim=0)  # add, abs_, sum
        torch.zeros(3)  # zeros -> one fill
        z.amax()
    assert dict(n.counts) == {"add": 1, "abs_": 1, "sum": 1, "zeros": 1, "amax": 1} and n.total == 5

@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_profile_adds_no_host_sync_per_forward(arch, monkeypatch):
    """Per forward with the default sites (logits, hidden states), Linear inputs and the sink metrics, the
    profile's statistics add no call that would make the host wait for an accelerator (the accelerators' path,
    forced on CPU); on CPU each update reads its sum back once (free there), and each query block of logits with
    more rows than k reads back how many of its rows can still enter the top-k once that holds k values (blocks 1-2
    of the first forward, 0-2 of the second: block 3 has 4 × 4 rows). transformers' own mask code reads one value
    per forward either way."""
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "32")
    model = build(PRESETS["micro"], arch, seed=4).eval()
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(5))
    sites = ["*.attn_logits", "*.hidden", "*.attn_in", "*.mlp_in", "*.down_in", "*.attn_out"]
    forward, counts = model.forward, []

    def counted(*args, **kwargs):
        with HostSyncs() as syncs:
            out = forward(*args, **kwargs)
        counts.append(syncs.total)
        return out

    with torch.no_grad(), HostSyncs() as plain:
        model(ids[:1], use_cache=False)
    model.forward = counted
    monkeypatch.setattr(site_stats, "FREE_READS", frozenset())
    profile_model(model, ids, sites, batch_size=1, progress=False, sinks=True)
    assert counts == [plain.total] * 2
    counts.clear()
    monkeypatch.setattr(site_stats, "FREE_READS", frozenset({"cpu"}))
    profile_model(model, ids, sites, batch_size=1, progress=False, sinks=True)
    layers = model.config.num_hidden_layers
    updates = layers * (5 + 4)  # 5 token sites, 4 query blocks of logits per layer
    assert model.config.num_attention_heads * 32 > 100 >= model.config.num_attention_heads * 4  # rows vs k
    assert counts == [plain.total + updates + layers * 2, plain.total + updates + layers * 3]


def test_env_settings_are_read_when_used(monkeypatch):
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "24")
    assert A.query_block(1, 9, 8192) == 24
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "x")
    with pytest.raises(Exception, match="DIFFQUANT_ATTN_BLOCK must be a whole number"):
        A.query_block(1, 9, 8192)


def test_masked_scores_write_only_past_dense():
    logits = torch.randn(1, 2, 4, 64)
    valid = (torch.arange(64)[None, :] <= torch.arange(40, 44)[:, None])[None, None]
    ref = logits.masked_fill(~valid, float("-inf"))
    out = A.masked_scores(logits, logits, valid, dense=41)
    assert torch.equal(out, ref) and out.data_ptr() == logits.data_ptr()
    assert np.isfinite(out[..., :41].numpy()).all()


def test_topk_row_search_takes_what_beats_the_least_kept_and_never_a_masked_value():
    """With rows searched (`rowmax`) and reading back free: an update whose largest |x| lies between the least and the
    second-least kept value enters (k = 2: 5 and 3 kept, then a 4: 5 and 4; k = 1: 3, then a 4); masked values never
    enter, even where every valid value is small (0.3 and 0.2 under masked 9s)."""
    for k, offers, want in ((2, [5.0, 3.0, 4.0], [5.0, 4.0]), (1, [3.0, 4.0], [4.0])):
        top = TopK(k, 3)
        for row, v in enumerate(offers):
            x = torch.tensor([[[v], [0.0], [0.0]]])
            top.add(x, None, TOKEN_DIMS, row_offset=row, rowmax=x.abs().amax(-1), read_back=True)
        assert top.values.tolist() == want
    x = torch.full((1, 1, 6, 4), 9.0)
    x[0, 0, 0, 0], x[0, 0, 1, 0] = 0.3, -0.2
    valid = torch.zeros(1, 1, 6, 4, dtype=torch.bool)
    valid[0, 0, :2, 0] = True
    top = TopK(3, 4)
    top.add(x, valid, LOGIT_DIMS, rowmax=torch.where(valid, x.abs(), -1.0).amax(-1), read_back=True)
    assert top.values.tolist() == pytest.approx([0.3, -0.2]) and top.coords[:, :4].tolist() == [[0, 0, 0, 0],
                                                                                                 [0, 0, 1, 0]]


def test_topk_reads_token_ids_of_query_blocks():
    """A block of query rows 4..8 of a 12-token call (`pos_offset`, `pos_total`): each kept logit's q_pos is its
    place in the call and its token id that of input_ids there, read here from the ids by hand."""
    ids = torch.arange(100, 124).reshape(2, 12)
    x = torch.zeros(2, 1, 4, 12)
    x[1, 0, 2, 5], x[0, 0, 0, 1] = -7.0, 6.0
    top = TopK(2, 4)
    top.add(x, None, LOGIT_DIMS, input_ids=ids, row_offset=10, pos_offset=4, pos_total=12)
    assert top.coords.tolist() == [[11, 0, 6, 5, int(ids[1, 6])], [10, 0, 4, 1, int(ids[0, 4])]]
