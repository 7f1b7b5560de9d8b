"""stats/metric_sets.py piece by piece: each accumulator fed by hand (several batches, padding, a sequence with no
valid token, query blocks, ties at ε) against loops written here; each set's figures from hand-made profiles,
every key it reports and every guard (a median of 0, no sequence seen, no site of a kind); the protocol
sentences word for word; the registry's edges (issue 50's mutants of the module)."""

import numpy as np
import pytest
import scipy.stats
import torch

from diffquant.profiler import ModelProfile
from diffquant.stats import metric_sets as M
from diffquant.stats.site_stats import SiteStats
from diffquant.taps.context import Batch, Block, TapContext
from diffquant.taps.sites import POINTS, TOKENS, Site


def _ctx(point="attn_probs", valid=None, block=None):
    return TapContext(Site(f"layers.0.{point}", 0, POINTS[point]), Batch(), valid, block)


def _first_key_by_loop(probs, valid):
    """Per sequence and head, the sum over query rows that see a key of the attention on that row's first visible
    key; per sequence, the rows that see one."""
    b, h, q, k = probs.shape
    mass, rows = torch.zeros(b, h, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
    for s in range(b):
        for r in range(q):
            keys = [c for c in range(k) if valid is None or bool(valid[s, 0, r, c])]
            if keys:
                rows[s] += 1
                for head in range(h):
                    mass[s, head] += float(probs[s, head, r, keys[0]])
    return mass, rows


def test_sequence_first_key_with_and_without_a_mask():
    """Three heads; left padding (sequence 1's first two keys), a query row that sees no key (sequence 2, row 0),
    the mask given once per head or once for all: the same sums. Both forms return float64 on the CPU."""
    g = torch.Generator().manual_seed(0)
    b, h, q, k = 3, 3, 5, 7
    probs = torch.rand(b, h, q, k, generator=g)
    s, n = M.sequence_first_key(probs, None)
    want, rows = _first_key_by_loop(probs, None)
    assert s.dtype == n.dtype == torch.float64 and s.shape == (b, h) and n.tolist() == [5.0, 5.0, 5.0]
    torch.testing.assert_close(s, want, rtol=1e-6, atol=0)
    valid = torch.ones(b, 1, q, k, dtype=torch.bool)
    valid[1, :, :, :2] = False
    valid[2, :, 0, :] = False
    want, rows = _first_key_by_loop(probs, valid)
    for mask in (valid, valid.expand(b, h, q, k)):
        s, n = M.sequence_first_key(probs, mask)
        assert s.dtype == n.dtype == torch.float64
        torch.testing.assert_close(s, want, rtol=1e-6, atol=0)
        assert n.tolist() == rows.tolist() == [5.0, 5.0, 4.0]


def _probs_with_alpha(alphas_rows):
    """[sequences, 1 head, rows, 4 keys] whose first key gets the given masses on each row."""
    rows = max(len(a) for a in alphas_rows)
    p = torch.zeros(len(alphas_rows), 1, rows, 4)
    for s, masses in enumerate(alphas_rows):
        for r, m in enumerate(masses):
            p[s, 0, r, 0], p[s, 0, r, 1] = m, 1 - m
    return p


def test_sequence_sinks_over_batches_with_padding_and_a_tie_at_epsilon():
    """Batch 1: α = 0.3 exactly (masses summing to 1.5 in float32 over 5 rows: a tie, not a sink: α > ε), a
    sequence whose one valid row puts 0.9 on its first key (a sink), a sequence with no valid token (not
    counted). Batch 2: α = 0.1 and 0.7. Sums over both batches, and the summary's rate and mean α."""
    acc = M.SequenceSinks()
    first = _probs_with_alpha([[0.5, 0.25, 0.25, 0.25, 0.25], [0.9, 0.2, 0.2, 0.2, 0.2], [0.8] * 5])
    valid = torch.ones(3, 1, 5, 4, dtype=torch.bool)
    valid[1, :, 1:] = False  # only row 0 of sequence 1 is a token
    valid[2] = False
    acc.add("attn_probs", first, _ctx(valid=valid))
    acc.add("attn_probs", _probs_with_alpha([[0.1] * 5, [0.7] * 5]), _ctx())
    assert 1.5 / 5 == M.EPSILON  # the tie is exact in float64
    assert acc.sequences == 4 and acc.sinks.tolist() == [2.0]
    assert acc.alpha.tolist() == pytest.approx([0.3 + 0.9 + 0.1 + 0.7], rel=1e-6)
    s = acc.summary()
    assert s == {"heads": 1, "sequences": 4, "sinks": [2.0], "rate": 0.5,
                 "alpha_mean": pytest.approx([2.0 / 4], rel=1e-6), "lambda": None}


def test_sequence_sinks_sum_query_blocks_before_alpha():
    """One call cut into query blocks of rows 0–2 and 3–5 over 8 keys (two of them past keys): α is taken once,
    from the rows of both blocks, as from the uncut call."""
    g = torch.Generator().manual_seed(2)
    probs = torch.rand(2, 3, 6, 8, generator=g)
    whole = M.SequenceSinks()
    whole.add("attn_probs", probs, _ctx())
    cut = M.SequenceSinks()
    cut.add("attn_probs", probs[:, :, :3], _ctx(block=Block(0, 3, 6, 8)))
    assert cut.sinks is None and cut.sequences == 0  # waits for the call's last block
    cut.add("attn_probs", probs[:, :, 3:], _ctx(block=Block(3, 6, 6, 8)))
    assert cut.sequences == whole.sequences == 2
    torch.testing.assert_close(cut.alpha, whole.alpha, rtol=1e-6, atol=0)  # float32 sums in another order
    assert torch.equal(cut.sinks, whole.sinks)
    mass, rows = _first_key_by_loop(probs, None)
    torch.testing.assert_close(whole.alpha, (mass / rows[:, None]).sum(0), rtol=1e-6, atol=0)


def test_sequence_sinks_of_a_differential_head_and_where_they_are_undefined():
    """DIFF: the share (A1 − λ·A2)[q, 0] / (1 − λ); with |1 − λ| ≤ 0.05 the layer is undefined, said with the
    value; before any sequence, "no sequence seen"."""
    acc = M.SequenceSinks()
    acc.add("lambda", torch.tensor(0.6), _ctx("lambda"))
    diff_map = _probs_with_alpha([[0.2] * 4, [0.1] * 4])  # (A1 − λ·A2) on key 0: 0.2 and 0.1
    acc.add("attn_map", diff_map, _ctx("attn_map"))
    s = acc.summary()
    assert s["lambda"] == pytest.approx(0.6) and s["sinks"] == [1.0]  # 0.2 / 0.4 = 0.5 > ε; 0.1 / 0.4 = 0.25
    assert s["alpha_mean"] == pytest.approx([(0.5 + 0.25) / 2], rel=1e-6) and s["rate"] == 0.5
    near = M.SequenceSinks()
    near.add("lambda", torch.tensor(0.97), _ctx("lambda"))
    near.add("attn_map", diff_map, _ctx("attn_map"))
    assert near.sinks is None
    assert near.summary() == {"lambda": pytest.approx(0.97), "undefined": "|1 − λ| = 0.03 ≤ 0.05"}
    assert M.SequenceSinks().summary() == {"lambda": None, "undefined": "no sequence seen"}
    empty = M.SequenceSinks()  # a call whose sequences are all padding: counts exist, no sequence
    empty.add("attn_probs", _probs_with_alpha([[0.5] * 3]), _ctx(valid=torch.zeros(1, 1, 3, 4, dtype=torch.bool)))
    assert empty.sinks is not None and empty.summary() == {"lambda": None, "undefined": "no sequence seen"}


def test_sequence_sinks_merge_keeps_whichever_lambda_is_known():
    def acc(lam, alpha):
        a = M.SequenceSinks()
        if lam is not None:
            a.add("lambda", torch.tensor(lam), _ctx("lambda"))
        a.add("attn_probs", _probs_with_alpha([[alpha] * 3]), _ctx())
        return a

    assert acc(None, 0.5).merge(acc(0.25, 0.1)).lam == 0.25
    assert acc(0.25, 0.5).merge(acc(None, 0.1)).lam == 0.25
    assert acc(0.25, 0.5).merge(acc(0.5, 0.1)).lam == 0.25  # the first rank's
    merged = acc(None, 0.5).merge(acc(None, 0.1))
    assert merged.sequences == 2 and merged.sinks.tolist() == [1.0]
    assert merged.alpha.tolist() == pytest.approx([0.6], rel=1e-6)
    assert M.SequenceSinks().merge(M.SequenceSinks()).sinks is None


def _kurtosis(v):
    return float(scipy.stats.kurtosis(v, fisher=False, bias=True))


def test_sequence_norms_over_batches_with_padding_a_constant_and_one_value():
    """Batch 1 (8 channels): a sequence with 3 padded positions, one all padding (not a sequence), one constant
    (an ∞-norm but no kurtosis); batch 2 (unmasked). A one-channel site whose sequence has one valid token: its
    ∞-norm counts, its kurtosis does not (no spread)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, 8, generator=g)
    x[2] = -2.5
    valid = torch.ones(3, 6, 1, dtype=torch.bool)
    valid[0, :3] = False
    valid[1] = False
    y = torch.randn(2, 6, 8, generator=g) * 3
    acc = M.SequenceNorms()
    acc.add("hidden", x, _ctx("hidden", valid))
    acc.add("hidden", y, _ctx("hidden"))
    seqs = [x[0, 3:].numpy().ravel(), x[2].numpy().ravel(), y[0].numpy().ravel(), y[1].numpy().ravel()]
    assert acc.sequences == 4 and acc.kurtosis_sequences == 3
    assert acc.inf == pytest.approx(sum(np.abs(v).max() for v in seqs), rel=1e-6)
    kurts = [_kurtosis(v) for v in (seqs[0], seqs[2], seqs[3])]
    assert acc.kurtosis == pytest.approx(sum(kurts), rel=1e-5)
    assert acc.summary() == {"inf_norm_mean": pytest.approx(acc.inf / 4), "kurtosis_mean": pytest.approx(sum(kurts) / 3),
                             "sequences": 4}
    one = M.SequenceNorms()
    single = torch.tensor([[[3.0], [7.0]]])  # [1 sequence, 2 positions, 1 channel], position 1 padding
    one.add("hidden", single, _ctx("hidden", torch.tensor([[[True], [False]]])))
    assert (one.inf, one.sequences, one.kurtosis, one.kurtosis_sequences) == (3.0, 1, 0.0, 0)
    assert one.summary() == {"inf_norm_mean": 3.0, "kurtosis_mean": None, "sequences": 1}
    assert M.SequenceNorms().summary() == {"inf_norm_mean": None, "kurtosis_mean": None, "sequences": 0}


def _stats(values, k=3):
    s = SiteStats(TOKENS, k=k)
    s.update(torch.as_tensor(values, dtype=torch.float32).reshape(1, -1, 1))
    return s


def test_massive_count_at_its_edges():
    """No median known: the threshold is 100 (not 1000). A kept value exactly at the threshold is not massive and
    the top-k still decides (the histogram is not asked). From the histogram: a value just above the threshold's bin
    counts, the threshold's own bin is undecided."""
    assert M.massive_count(_stats([500.0, 0.5, 0.25, 0.1]), None) == (1, 0)
    assert M.massive_count(_stats([500.0, 200.0, 100.0, 0.5, 0.25]), None) == (2, 0)  # kept: 500, 200, 100
    assert M.massive_count(_stats([500.0, 200.0, 100.0, 0.5, 0.25]), 0.3) == (1, 0)  # 1000 × 0.3: threshold 300


def test_massive_count_from_the_histogram():
    from diffquant.stats.histogram import magnitude_bins

    values = [300.0, 250.0, 100.4, 100.2, 3.0, 2.0]
    at = int(magnitude_bins(torch.tensor([100.0])))
    assert int(magnitude_bins(torch.tensor([100.4]))) == at + 1 and int(magnitude_bins(torch.tensor([100.2]))) == at
    assert M.massive_count(_stats(values, k=2), None) == (3, 1)  # 300, 250, 100.4 above; 100.2 in 100's bin


def _profile(sites: dict, kinds: dict, state=None, info=None, provenance=None):
    stats = {name: _stats(v, k=3) for name, v in sites.items()}
    layer_of = {n: (int(n.split(".")[1]) if n.startswith("layers.") else None) for n in sites}
    return ModelProfile("m", info or {}, stats, layer_of, kinds, provenance or {}, metric_state=state or {})


def test_diff_table5_reports_each_kind_pooled_and_a_ratio_only_where_the_median_is_not_zero():
    """Logits pooled over two layers; a hidden site whose values are mostly 0 (median 0: no ratio)."""
    logits0, logits1 = [4.0, -9.0, 2.0, 1.0, 0.5], [3.0, -1.5, 2.5, 0.25]
    prof = _profile({"layers.0.attn_logits": logits0, "layers.1.attn_logits": logits1,
                     "layers.0.hidden": [0.0, 0.0, 0.0, 7.0, 0.0]},
                    {"layers.0.attn_logits": "attn_logits", "layers.1.attn_logits": "attn_logits",
                     "layers.0.hidden": "hidden"})
    got = M.REGISTRY["diff-table5"].compute(prof)
    pooled = np.abs(logits0 + logits1)
    assert set(got) == {"attn_logits", "hidden"}
    assert got["attn_logits"]["top1"] == 9.0 and got["attn_logits"]["values"] == 9
    assert got["attn_logits"]["median"] == pytest.approx(np.median(pooled), rel=1e-2)
    assert got["attn_logits"]["top1_over_median"] == pytest.approx(9.0 / got["attn_logits"]["median"], rel=1e-12)
    assert got["hidden"] == {"top1": 7.0, "median": 0.0, "top1_over_median": None, "values": 5}


def test_sun2024_per_layer_ratio_totals_and_a_layer_with_median_zero():
    prof = _profile({"layers.0.hidden": [1.5, -2.0, 0.5, 3.0, 0.25], "layers.1.hidden": [0.0, 0.0, 0.0, 150.0, 0.0],
                     "final_norm": [9.0, 1.0]},
                    {"layers.0.hidden": "hidden", "layers.1.hidden": "hidden", "final_norm": "hidden"})
    got = M.REGISTRY["sun2024"].compute(prof)
    assert set(got["layers"]) == {"0", "1"}  # the final norm has no layer
    first = got["layers"]["0"]
    assert (first["top1"], first["top2"], first["top3"]) == (3.0, 2.0, 1.5)
    assert first["top1_over_median"] == pytest.approx(3.0 / first["median"], rel=1e-12)
    assert first["median"] == pytest.approx(1.5, rel=1e-2)
    assert got["layers"]["1"]["median"] == 0.0 and got["layers"]["1"]["top1_over_median"] is None
    assert got["layers"]["1"]["massive"] == 1  # 150 > max(100, 1000 × 0)
    assert got["massive_total"] == 1 and got["layers_with_massive"] == [1]
    assert got["top1_over_median_max"] == first["top1_over_median"]
    flat = M.REGISTRY["sun2024"].compute(_profile({"layers.0.hidden": [0.0, 0.0, 0.0, 4.0, 0.0]},
                                                  {"layers.0.hidden": "hidden"}))
    assert flat["top1_over_median_max"] is None and flat["massive_total"] == 0 and flat["layers_with_massive"] == []


def _sinks(lam, alphas):
    acc = M.SequenceSinks()
    if lam is not None:
        acc.add("lambda", torch.tensor(lam), _ctx("lambda"))
    acc.add("attn_map" if lam is not None else "attn_probs", _probs_with_alpha([[a] * 3 for a in alphas]),
            _ctx("attn_map" if lam is not None else "attn_probs"))
    return acc


def test_gu2024_reports_its_epsilon_its_unit_and_no_rate_without_cells():
    got = M.REGISTRY["gu2024"].compute(_profile({}, {}, {"gu2024": {0: _sinks(None, [0.5, 0.1]),
                                                                     1: _sinks(None, [0.6, 0.7, 0.2])}}))
    assert got["epsilon"] == 0.3 and got["unit"] == "attention head"
    assert got["sink1"] == pytest.approx(3 / 5) and got["layers_undefined"] == []
    assert set(got["layers"]) == {"0", "1"}
    diff = M.REGISTRY["gu2024"].compute(_profile({}, {}, {"gu2024": {0: _sinks(0.98, [0.5])}},
                                                 info={"model_type": "diffllama"}))
    assert diff["unit"] == "differential head (share)" and diff["sink1"] is None and diff["layers_undefined"] == [0]


def _norms(*sequences):
    acc = M.SequenceNorms()
    for v in sequences:
        acc.add("hidden", torch.as_tensor(v, dtype=torch.float32).reshape(1, -1, 1), _ctx("hidden"))
    return acc


def test_bondarenko2023_picks_the_largest_by_value_and_reports_none_without_values():
    """The site of the largest ∞-norm is found by value (here not the last name in order); a site that saw no
    sequence leaves no figure; with no figure at all every field is None."""
    state = {"bondarenko2023": {"layers.0.attn_in": _norms([1.0, -9.0, 2.0, 0.5]),
                                "layers.0.hidden": _norms([3.0, 1.0, -2.0, 0.0]),
                                "layers.1.mlp_in": _norms([4.0, 4.0, 4.0]),  # constant: no kurtosis
                                "layers.2.hidden": M.SequenceNorms()}}
    got = M.REGISTRY["bondarenko2023"].compute(_profile({}, {}, state))
    assert got["max_inf_norm"] == 9.0 and got["max_inf_norm_site"] == "layers.0.attn_in"
    assert got["max_layer_inf_norm"] == 3.0
    kurts = [_kurtosis(np.array([1.0, -9.0, 2.0, 0.5])), _kurtosis(np.array([3.0, 1.0, -2.0, 0.0]))]
    assert got["avg_kurtosis"] == pytest.approx(sum(kurts) / 2, rel=1e-6)
    assert got["max_kurtosis"] == pytest.approx(max(kurts), rel=1e-6)
    assert set(got["sites"]) == set(state["bondarenko2023"])
    empty = M.REGISTRY["bondarenko2023"].compute(_profile({}, {}, {"bondarenko2023": {"layers.0.hidden":
                                                                                       M.SequenceNorms()}}))
    assert {k: v for k, v in empty.items() if k != "sites"} == {
        "max_inf_norm": None, "max_inf_norm_site": None, "max_layer_inf_norm": None, "avg_kurtosis": None,
        "max_kurtosis": None}


def test_bondarenko2023_linear_per_kind():
    """Two attn_in layers (the larger ∞-norm in the first name), a down_in site whose median is 0, an mlp_in site
    that saw nothing: per kind its figures, and each site's top-1 / median."""
    values = {"layers.0.attn_in": [1.0, -9.0, 2.0, 0.5], "layers.1.attn_in": [3.0, 1.0, -2.0, 0.25],
              "layers.0.down_in": [0.0, 0.0, 0.0, 5.0, 0.0], "layers.0.mlp_in": [1.0]}
    kinds = {n: n.split(".")[-1] for n in values}
    state = {"bondarenko2023-linear": {n: (_norms(v) if n != "layers.0.mlp_in" else M.SequenceNorms())
                                       for n, v in values.items()}}
    got = M.REGISTRY["bondarenko2023-linear"].compute(_profile(values, kinds, state))
    attn = got["kinds"]["attn_in"]
    kurts = [_kurtosis(np.array(values[n])) for n in ("layers.0.attn_in", "layers.1.attn_in")]
    assert attn["max_inf_norm"] == 9.0 and attn["max_inf_norm_site"] == "layers.0.attn_in" and attn["layers"] == 2
    assert attn["avg_kurtosis"] == pytest.approx(sum(kurts) / 2, rel=1e-6)
    assert attn["max_kurtosis"] == pytest.approx(max(kurts), rel=1e-6)
    site = got["sites"]["layers.0.attn_in"]
    assert site["top1"] == 9.0 and site["top1_over_median"] == pytest.approx(9.0 / site["median"], rel=1e-12)
    assert site["median"] == pytest.approx(1.5, rel=1e-2)
    assert attn["max_top1_over_median"] == max(got["sites"][n]["top1_over_median"]
                                               for n in ("layers.0.attn_in", "layers.1.attn_in"))
    down = got["sites"]["layers.0.down_in"]
    assert down["median"] == 0.0 and down["top1_over_median"] is None
    assert got["kinds"]["down_in"]["max_top1_over_median"] is None
    assert got["kinds"]["mlp_in"] == {"max_inf_norm": None, "max_inf_norm_site": None, "avg_kurtosis": None,
                                      "max_kurtosis": None, "max_top1_over_median": 1.0 / got["sites"][
                                          "layers.0.mlp_in"]["median"], "layers": 1}
    assert "attn_out" not in got["kinds"]  # no site of that kind


def test_compute_names_each_set_with_its_citation_and_conventions():
    prof = _profile({"layers.0.hidden": [1.0, 2.0]}, {"layers.0.hidden": "hidden"},
                    provenance={"sequences": 10, "seq_len": 64})
    prof.metric_sets = ("sun2024",)
    got = prof.metric_results()
    assert list(got) == ["sun2024"] and got["sun2024"]["citation"] == M.REGISTRY["sun2024"].citation
    assert got["sun2024"]["conventions"] == M.conventions(M.REGISTRY["sun2024"], prof.provenance)


def test_conventions_word_for_word():
    one = M.MetricSet("x", "c", "d", "e", {"tokens": 400_000, "sequences": 100, "seq_len": 64, "bos": "no BOS added"},
                      lambda prof: {})
    assert M.conventions(one, {"tokens": 400_000, "sequences": 100, "seq_len": 64, "bos_first_sequences": 0}) == [
        "the paper: no BOS added; here no sequence starts with the model's BOS token"]
    assert M.conventions(one, {"tokens": 2_048, "sequences": 32, "seq_len": 128, "bos_first_sequences": 32}) == [
        "the paper profiled 400,000 tokens; here 2,048", "the paper used 100 sequences; here 32",
        "the paper used windows of 64 tokens; here 128",
        "the paper: no BOS added; here every sequence starts with the model's BOS token"]
    assert M.conventions(one, {"tokens": 400_000, "sequences": 100, "seq_len": 64, "bos_first_sequences": 1})[-1] == \
        "the paper: no BOS added; here 1 of 100 sequences start with the model's BOS token"
    assert M.conventions(one, {"tokens": 400_000, "sequences": 100, "seq_len": 64}) == [
        "the paper: no BOS added; here the model declares no single BOS token id, so whether sequences start with "
        "one was not checked"]
    lens = M.MetricSet("y", "c", "d", "e", {"seq_len": {"LLaMA": 4096, "GPT-2": 1024}}, lambda prof: {})
    assert M.conventions(lens, {"seq_len": 4096}) == ["the paper used windows of 4,096 (LLaMA), 1,024 (GPT-2); "
                                                      "here 4096"]
    assert M.conventions(M.MetricSet("z", "c", "d", "e", {}, lambda prof: {}), {"tokens": 5}) == []


def test_registry_edges(monkeypatch):
    assert M.parse(None) == () and M.parse("") == () and M.parse(" ,, ") == ()
    assert M.parse(" sun2024 , gu2024,sun2024") == ("sun2024", "gu2024")
    assert M.required_sites(()) == ([], 1)
    assert M.required_sites(("sun2024", "diff-table5", "gu2024")) == (["*.hidden", "*.attn_logits"], 100)
    monkeypatch.setattr(M, "REGISTRY", {})
    new = M.MetricSet("new", "c", "d", "e", {}, lambda prof: {})
    M.register(new)
    assert M.REGISTRY == {"new": new}
    with pytest.raises(ValueError, match="metric set 'new' is registered twice"):
        M.register(new)
