"""The papers' metric sets against hand computations: attention logits and softmax maps recomputed in
plain torch from q/k projections and RoPE, module outputs read with the test's own forward hooks, numpy and
scipy for medians and kurtosis, and hand-planted massive activations."""

import copy
import json

import numpy as np
import pytest
import scipy.stats
import torch

from diffquant import DiffquantError
from diffquant.profiler import ModelProfile, profile_model
from diffquant.stats import metric_sets
from diffquant.stats.site_stats import SiteStats
from diffquant.taps.sites import TOKENS
from test_diff_sinks import _steer, paper_lambda, softmax_maps

ALL = ["diff-table5", "sun2024", "gu2024", "bondarenko2023", "bondarenko2023-linear"]


def module_outputs(model, ids) -> dict[str, list[np.ndarray]]:
    """Per sequence, what each Bondarenko module outputs: decoder layers, the attention and MLP input norms,
    the final norm (plain forward hooks, one run)."""
    got: dict[str, np.ndarray] = {}
    handles = []
    named = {"final_norm": model.model.norm}
    for i, layer in enumerate(model.model.layers):
        named.update({f"layers.{i}.hidden": layer, f"layers.{i}.attn_in": layer.input_layernorm,
                      f"layers.{i}.mlp_in": layer.post_attention_layernorm})
    for name, module in named.items():
        def hook(mod, args, out, name=name):
            got[name] = (out[0] if isinstance(out, tuple) else out).detach().double().numpy()
        handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return got


@pytest.fixture(params=["baseline", "diff"])
def model(request, micro_pair):
    return micro_pair[request.param == "diff"]


def test_diff_table5_and_sun2024_match_hand_computation(model):
    ids = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(6))
    _, logits = softmax_maps(model, ids)
    outs = module_outputs(model, ids)
    prof = profile_model(model, ids, [], sinks=False, progress=False, metrics=["diff-table5", "sun2024"])
    r = prof.metric_results()
    lg = torch.cat(logits).abs().numpy()  # every head of every layer (DIFF: both maps), causal positions
    assert r["diff-table5"]["attn_logits"]["top1"] == pytest.approx(lg.max(), rel=1e-5)
    assert r["diff-table5"]["attn_logits"]["median"] == pytest.approx(np.median(lg), rel=5e-3)  # histogram: 0.4%
    hidden = np.abs(np.concatenate([outs[f"layers.{i}.hidden"].ravel() for i in range(2)]))
    assert r["diff-table5"]["hidden"]["top1"] == pytest.approx(hidden.max(), rel=1e-6)
    assert r["diff-table5"]["hidden"]["median"] == pytest.approx(np.median(hidden), rel=5e-3)
    for i in range(2):
        h = np.sort(np.abs(outs[f"layers.{i}.hidden"].ravel()))[::-1]
        got = r["sun2024"]["layers"][str(i)]
        assert [got["top1"], got["top2"], got["top3"]] == pytest.approx(h[:3], rel=1e-6)
        assert got["median"] == pytest.approx(np.median(h), rel=5e-3)
        assert got["massive"] == 0  # a micro model at initialisation: nothing near 100
    assert "the paper used 10 sequences; here 3" in r["sun2024"]["conventions"]


def test_sun2024_counts_planted_massive_activations():
    g = torch.Generator().manual_seed(7)
    small = torch.randn(2, 50, 64, generator=g) * 0.01  # median |x| ≈ 0.0067: 1000× it is below 100
    small[0, 3, 5], small[1, 0, 9], small[1, 7, 2], small[0, 9, 9] = 500.0, -250.0, 150.0, 90.0
    large = torch.randn(2, 50, 64, generator=g)  # median |x| ≈ 0.67: only |x| > 670 is massive
    large[0, 0, 0], large[1, 1, 1] = 800.0, 500.0
    edge = small.clone()
    edge[1, 2, 3] = 100.2  # in the histogram bin of the threshold 100 ([100, 100.78))
    sites = {}
    for name, x, k in (("layers.0.hidden", small, 100), ("layers.1.hidden", large, 100), ("layers.2.hidden", small, 2),
                       ("layers.3.hidden", edge, 2), ("layers.4.hidden", edge, 10)):
        sites[name] = SiteStats(TOKENS, k=k)
        sites[name].update(x)
    prof = ModelProfile("m", {}, sites, {n: int(n.split(".")[1]) for n in sites}, {n: "hidden" for n in sites})
    r = metric_sets.REGISTRY["sun2024"].compute(prof)
    for layer, x in (("0", small), ("1", large), ("2", small), ("4", edge)):
        a = x.abs().numpy().ravel()
        want = int(((a > 100) & (a > 1000 * np.median(a))).sum())
        assert (r["layers"][layer]["massive"], r["layers"][layer]["massive_undecided"]) == (want, 0), layer
    assert [r["layers"][i]["massive"] for i in "0124"] == [3, 1, 3, 4]  # layer 2 keeps 2 values: the histogram counts
    assert (r["layers"]["3"]["massive"], r["layers"]["3"]["massive_undecided"]) == (3, 1)  # 100.2: its bin holds 100
    assert r["layers_with_massive"] == [0, 1, 2, 3, 4]


def _sharpen(model):
    """A copy with 12× larger queries: peaked attention, so α spreads on both sides of ε (near-uniform
    attention over 10 tokens gives α ≈ H₁₀/10 ≈ 0.29 in every head)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
    return m


def _alpha(p: torch.Tensor) -> torch.Tensor:
    """Gu et al.'s α per sequence and head: the mean over all queries (the first included) of column 0."""
    return p[..., 0].mean(dim=-1)


@pytest.mark.parametrize("block", [None, 4])
@pytest.mark.parametrize("arch,steered", [("baseline", False), ("diff", False), ("diff", True)])
def test_gu2024_sink1_matches_hand_computation(micro_pair, arch, steered, block, monkeypatch):
    from diffquant.taps import attention

    model = micro_pair[arch == "diff"]
    diff = arch == "diff"
    if block:
        monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", str(block))  # query blocks of 4: α summed across blocks first
    model = _sharpen(_steer(model) if steered else model)
    ids = torch.randint(0, 512, (4, 10), generator=torch.Generator().manual_seed(8))
    probs, _ = softmax_maps(model, ids)
    r = profile_model(model, ids, [], progress=False, metrics=["gu2024"]).metric_results()["gu2024"]
    sinks = cells = 0
    undefined = []
    for i, p in enumerate(probs):
        if diff:
            lam = paper_lambda(model.model.layers[i].self_attn, i)
            if abs(1 - lam) <= 0.05:
                undefined.append(i)
                continue
            h = p.shape[1] // 2
            p = (p[:, :h] - lam * p[:, h:]) / (1 - lam)
        alpha = _alpha(p)  # [sequence, head]
        got = r["layers"][str(i)]
        np.testing.assert_allclose(got["alpha_mean"], alpha.mean(0).numpy(), rtol=1e-5)
        assert got["sinks"] == (alpha > 0.3).sum(0).tolist()
        sinks, cells = sinks + int((alpha > 0.3).sum()), cells + alpha.numel()
    assert r["layers_undefined"] == undefined
    assert r["sink1"] == pytest.approx(sinks / cells)
    assert 0 < sinks < cells  # short windows: the threshold splits the cells, so the test means something


def test_bondarenko2023_matches_hand_computation(model):
    ids = torch.randint(0, 512, (3, 12), generator=torch.Generator().manual_seed(9))
    outs = module_outputs(model, ids)
    r = profile_model(model, ids, [], progress=False, metrics=["bondarenko2023"]).metric_results()["bondarenko2023"]
    assert set(r["sites"]) == set(outs)
    infs, kurts = {}, {}
    for name, x in outs.items():
        per = x.reshape(x.shape[0], -1)
        infs[name] = np.abs(per).max(axis=1).mean()
        kurts[name] = np.mean([scipy.stats.kurtosis(row, fisher=False) for row in per])  # Pearson: Gaussian = 3
        assert r["sites"][name]["inf_norm_mean"] == pytest.approx(infs[name], rel=1e-6)
        assert r["sites"][name]["kurtosis_mean"] == pytest.approx(kurts[name], rel=1e-4)
    assert r["max_inf_norm"] == pytest.approx(max(infs.values()), rel=1e-6)
    assert r["avg_kurtosis"] == pytest.approx(np.mean(list(kurts.values())), rel=1e-4)
    assert r["max_layer_inf_norm"] == pytest.approx(max(v for n, v in infs.items() if n.endswith("hidden")), rel=1e-6)


def linear_inputs(model, ids) -> dict[str, np.ndarray]:
    """What q_proj, o_proj, gate_proj and down_proj of every layer read (plain forward pre-hooks, one run)."""
    got, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        for kind, module in (("attn_in", layer.self_attn.q_proj), ("attn_out", layer.self_attn.o_proj),
                             ("mlp_in", layer.mlp.gate_proj), ("down_in", layer.mlp.down_proj)):
            def hook(mod, args, name=f"layers.{i}.{kind}"):
                got[name] = args[0].detach().double().numpy()
            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return got


def test_bondarenko2023_linear_matches_hand_computation(model):
    ids = torch.randint(0, 512, (3, 12), generator=torch.Generator().manual_seed(9))
    ins = linear_inputs(model, ids)
    r = profile_model(model, ids, [], progress=False,
                      metrics=["bondarenko2023-linear"]).metric_results()["bondarenko2023-linear"]
    assert set(r["sites"]) == set(ins)
    by_kind: dict[str, dict] = {}
    for name, x in ins.items():
        per = x.reshape(x.shape[0], -1)
        inf = np.abs(per).max(axis=1).mean()
        kurt = np.mean([scipy.stats.kurtosis(row, fisher=False) for row in per])
        ratio = np.abs(x).max() / np.median(np.abs(x))
        got = r["sites"][name]
        assert got["inf_norm_mean"] == pytest.approx(inf, rel=1e-6)
        assert got["kurtosis_mean"] == pytest.approx(kurt, rel=1e-4)
        assert got["top1"] == pytest.approx(np.abs(x).max(), rel=1e-6)
        assert got["top1_over_median"] == pytest.approx(ratio, rel=0.01)  # the median: a 0.8%-wide histogram bin
        k = by_kind.setdefault(name.rsplit(".", 1)[1], {"inf": [], "kurt": [], "ratio": []})
        k["inf"].append(inf), k["kurt"].append(kurt), k["ratio"].append(got["top1_over_median"])
    assert set(r["kinds"]) == set(by_kind) == {"attn_in", "attn_out", "mlp_in", "down_in"}
    for kind, k in by_kind.items():
        assert r["kinds"][kind]["max_inf_norm"] == pytest.approx(max(k["inf"]), rel=1e-6)
        assert r["kinds"][kind]["avg_kurtosis"] == pytest.approx(np.mean(k["kurt"]), rel=1e-4)
        assert r["kinds"][kind]["max_kurtosis"] == pytest.approx(max(k["kurt"]), rel=1e-4)
        assert r["kinds"][kind]["max_top1_over_median"] == max(k["ratio"])


def test_bondarenko_skips_padding():
    """Valid-token masks (padding) leave padded positions out of the ∞-norm and the kurtosis."""
    from diffquant.taps.tap import Batch, TapContext
    from diffquant.taps.sites import POINTS, Site

    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(10))
    x[1, :3] = 1000.0  # padding, never seen
    valid = torch.ones(2, 9, 1, dtype=torch.bool)
    valid[1, :3] = False
    acc = metric_sets.SequenceNorms()
    acc.add("hidden", x, TapContext(Site("layers.0.hidden", 0, POINTS["hidden"]), Batch(), valid))
    rows = [x[0].numpy().ravel(), x[1, 3:].numpy().ravel()]
    s = acc.summary()
    assert s["inf_norm_mean"] == pytest.approx(np.mean([np.abs(r).max() for r in rows]), rel=1e-6)
    assert s["kurtosis_mean"] == pytest.approx(np.mean([scipy.stats.kurtosis(r, fisher=False) for r in rows]), rel=1e-5)


def test_unknown_metric_set_is_one_clear_error(micro_pair):
    with pytest.raises(DiffquantError, match="choose from diff-table5, sun2024, gu2024, bondarenko2023"):
        metric_sets.parse("sun2024,gu2025")
    with pytest.raises(DiffquantError, match="unknown metric set"):
        profile_model(micro_pair[0], torch.zeros(1, 4, dtype=torch.long), progress=False, metrics=["nope"])


def test_profile_cli_writes_metric_sets(tmp_path):
    from diffquant.cli import main

    (tmp_path / "t.txt").write_text("In the beginning was the word, and the word was with God.\n" * 200)
    assert main(["profile", "--model", "micro:diff", "--data", str(tmp_path / "t.txt"), "--tokens", "256",
                 "--seq-len", "32", "--out", str(tmp_path / "p"), "--no-plots", "--metrics", ",".join(ALL)]) == 0
    model = json.loads((tmp_path / "p" / "stats.json").read_text())["models"][0]
    assert list(model["metric_sets"]) == ALL
    assert model["metric_sets"]["gu2024"]["unit"] == "differential head (share)"
    table = (tmp_path / "p" / "table5.md").read_text()
    for name in ALL:
        assert f"**{name}**" in table
    assert "the paper used windows of 64 tokens; here 32" in table
    assert main(["profile", "--model", "micro:diff", "--data", str(tmp_path / "t.txt"), "--out",
                 str(tmp_path / "q"), "--metrics", "sun2025"]) != 0


def test_accumulators_merge_exactly(micro_pair):
    """Two halves merged (as torchrun ranks are) equal the whole."""
    model = micro_pair[1]
    ids = torch.randint(0, 512, (4, 12), generator=torch.Generator().manual_seed(11))
    names = ["gu2024", "bondarenko2023"]
    whole = profile_model(model, ids, [], progress=False, metrics=names)
    a, b = (profile_model(model, part, [], progress=False, metrics=names) for part in (ids[:1], ids[1:]))
    for name in names:
        for key, acc in whole.metric_state[name].items():
            merged = a.metric_state[name][key].merge(b.metric_state[name][key]).summary()
            for field, value in acc.summary().items():
                assert merged[field] == pytest.approx(value, rel=1e-9), (name, key, field)


def test_tracking_snapshots_carry_lambda_shares_and_metric_sets(micro_pair):
    from diffquant.track import snapshot
    from diffquant.training import TrainConfig

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(12))
    point = snapshot(micro_pair[1], ids, 0, 0, ("gu2024", "sun2024"))
    assert set(point["metric_sets"]) == {"gu2024", "sun2024"}
    layer = point["layers"]["1"]
    assert layer["lambda"] == pytest.approx(paper_lambda(micro_pair[1].model.layers[1].self_attn, 1), rel=1e-6)
    assert {"first_share", "first_mass_A1", "first_mass_A2", "sink_fraction"} <= set(layer)
    assert point["model"]["sink_unit"].startswith("differential head")
    with pytest.raises(ValueError, match="needs track"):
        TrainConfig(track_metrics="gu2024")
    with pytest.raises(ValueError, match="unknown metric set"):
        TrainConfig(track=True, track_metrics="gu2025")
