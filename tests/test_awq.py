"""AWQ: the scale and clip searches against brute force written here; scales fold exactly into the model."""

import torch

from diffquant.quant.algorithms.awq import search_clip, search_scale
from diffquant.quant.numerics.config import int_config
from diffquant.quant.numerics.granularity import PerChannel, PerGroup


def rtn_rows(w, bits=4, group=None):
    """Symmetric absmax round to nearest per row (or per group of `group` columns)."""
    qmax = 2 ** (bits - 1) - 1
    cols = w.shape[1]
    out = torch.empty_like(w)
    for g0 in range(0, cols, group or cols):
        blk = w[:, g0:g0 + (group or cols)]
        s = blk.abs().amax(dim=1, keepdim=True) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        out[:, g0:g0 + (group or cols)] = torch.clamp(torch.round(blk / s), -qmax, qmax) * s
    return out


def test_scale_search_picks_the_alpha_of_least_output_error():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 8, generator=g, dtype=torch.float64)
    X[:, 0] *= 50  # a salient channel
    W = torch.randn(6, 8, generator=g, dtype=torch.float64)
    W[:, 0] *= 0.02  # ... whose small weights RTN rounds to zero
    H = 2 * X.T @ X / X.shape[0]
    mean_abs = X.abs().mean(dim=0)
    s, alpha, errors = search_scale([(W, int_config(4, PerChannel(0)))], H, mean_abs)
    want = []
    for i in range(20):  # brute force: the output error of each α, from the tokens themselves
        sc = mean_abs.pow(i / 20).clamp_min(1e-4)
        sc = sc / (sc.max() * sc.min()).sqrt()
        wq = rtn_rows(W * sc) / sc
        want.append((2 * ((X @ (W - wq).T) ** 2).sum(dim=1).mean()).item())
    torch.testing.assert_close(torch.tensor(errors, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=0)
    best = min(range(20), key=want.__getitem__)
    assert alpha == best / 20 and best > 0  # the salient channel is worth protecting
    assert want[best] < 0.5 * want[0]  # α = 0 is plain RTN


def test_clip_search_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 12, generator=g, dtype=torch.float64)
    W = torch.randn(5, 12, generator=g, dtype=torch.float64)
    W[0, 3] = 6.0  # an outlier weight that widens its group's range
    H = 2 * X.T @ X / X.shape[0]
    got = search_clip(W, H, int_config(3, PerGroup(5)))  # groups of 5, 5 and a ragged 2
    want = W.clone()
    for r in range(5):
        for g0 in range(0, 12, 5):
            w = W[r, g0:g0 + 5]
            best = None
            for i in range(10):
                m = w.abs().max() * (1 - i / 20)
                c = w.clamp(-m, m)
                err = ((X[:, g0:g0 + 5] @ (w - rtn_rows(c[None], 3)[0])) ** 2).mean().item()
                if best is None or err < best[0]:
                    best = (err, c)
            want[r, g0:g0 + 5] = best[1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_awq_scales_fold_exactly(micro_pair):
    from diffquant.quant.numerics.scheme import get_scheme
    from diffquant.quant.algorithms.solvers import parse, solve_weights_

    for model in micro_pair:  # Llama and DiffLlama
        ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            ref = model(ids).logits
        solved = solve_weights_(model, parse("awq:no-clip"), get_scheme("w4a16-g32"), ids, progress=False)
        assert solved.changed and set(solved.record["alphas"]) == {"attn_in", "mlp_in", "down_in"}
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref, atol=1e-5, rtol=0)
        solved.remove()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_protected_super_weight_is_never_clipped():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(300, 16, generator=g, dtype=torch.float64)
    X[:, 2] *= 0.001  # the outlier weight's input is small on these tokens: clipping it looks cheap
    W = torch.randn(4, 16, generator=g, dtype=torch.float64) * 0.5
    W[1, 2] = 5.0
    H = 2 * X.T @ X / X.shape[0]
    config = int_config(4, PerGroup(8))
    assert search_clip(W, H, config)[1, 2] < 5.0  # the output-error search clips it...
    kept = search_clip(W, H, config, protect=((1, 2),))
    assert kept[1, 2] == 5.0 and torch.equal(kept[1, :8], W[1, :8])  # ... unless it is protected
    assert torch.equal(kept[0], search_clip(W, H, config)[0])  # other groups are searched as before


def test_super_weight_found_and_kept_by_clip_output(micro_pair):
    from diffquant.quant.algorithms import superweights
    from diffquant.quant.numerics.scheme import get_scheme
    from diffquant.quant.algorithms.solvers import parse, solve_weights_

    model = micro_pair[0]
    down = model.model.layers[0].mlp.down_proj
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5))
    original = down.weight.data.clone()
    down.weight.data[5, 7] = 40.0  # a planted super-weight: output channel 5 spikes wherever input 7 is large
    try:
        found = superweights.find(model, ids)
        supers = [(o["layer"], o["row"], o["col"]) for o in found if o["super"]]
        assert supers == [(0, 5, 7)]
        with torch.no_grad():  # independent check of the spike: the largest |output| of layer 0's down_proj
            seen = []
            h = down.register_forward_hook(lambda m, a, out: seen.append(out.abs().amax().item()))
            model(ids)
            h.remove()
        assert found[0]["peak"] == max(seen)
        assert "layer 0 down_proj [5, 7]" in superweights.text(found)
        assert superweights.profile_entry(model, ids, "m") == found  # what `diffquant profile` records
        solved = solve_weights_(model, parse("clip:output"), get_scheme("w4a16-g32"), ids, progress=False)
        try:
            assert down.weight[5, 7] == 40.0 and solved.record["super_weights"][0]["col"] == 7
            assert not torch.equal(down.weight.data, original)  # the others were searched (and some clipped)
        finally:
            solved.remove()
        assert down.weight[5, 7] == 40.0
    finally:
        down.weight.data = original


def _brute_clip(W, X, bits, group):
    """The clip search from the tokens: per row and group, the shrink of least mean squared output error, the first
    of equal errors."""
    want = W.clone()
    for r in range(W.shape[0]):
        for g0 in range(0, W.shape[1], group):
            w = W[r, g0:g0 + group]
            best = None
            for i in range(10):
                m = w.abs().max() * (1 - i / 20)
                c = w.clamp(-m, m)
                err = ((X[:, g0:g0 + group] @ (w - rtn_rows(c[None], bits)[0])) ** 2).mean().item()
                if best is None or err < best[0]:
                    best = (err, c)
            want[r, g0:g0 + group] = best[1]
    return want


def test_scale_search_sums_every_reader_and_normalises_its_scales():
    """Two Linears read one input (as q/k/v do): the error of an α is the sum of both readers' output errors, and
    the second reader alone would pick another α. s = mean|x|^α over √(max s · min s) (the reference's)."""
    from diffquant.quant.algorithms.awq import GRID

    g = torch.Generator().manual_seed(4)
    X = torch.randn(256, 8, generator=g, dtype=torch.float64)
    X[:, 0] *= 50
    X[:, 5] *= 3
    A = torch.randn(6, 8, generator=g, dtype=torch.float64)
    A[:, 0] *= 0.02
    B = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    H = 2 * X.T @ X / X.shape[0]
    mean_abs = X.abs().mean(dim=0)
    config = int_config(4, PerChannel(0))

    def error(W, alpha):
        sc = mean_abs.pow(alpha).clamp_min(1e-4)
        sc = sc / (sc.max() * sc.min()).sqrt()
        return (2 * ((X @ (W - rtn_rows(W * sc) / sc).T) ** 2).sum(dim=1).mean()).item()

    want = [error(A, i / GRID) + error(B, i / GRID) for i in range(GRID)]
    s, alpha, errors = search_scale([(A, config), (B, config)], H, mean_abs)
    torch.testing.assert_close(torch.tensor(errors, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    best = min(range(GRID), key=want.__getitem__)
    assert alpha == best / GRID
    for W in (A, B):  # either reader alone would choose another α: the sum is what is searched
        assert min(range(GRID), key=lambda i: error(W, i / GRID)) != best
    sc = mean_abs.pow(alpha)
    torch.testing.assert_close(s, sc / (sc.max() * sc.min()).sqrt(), rtol=1e-12, atol=0)
    assert abs(float(s.max() * s.min()) - 1) < 1e-12


def test_scale_search_with_no_salient_channel_keeps_alpha_zero():
    """Every channel with the same mean |x|: every α gives s = 1 and the same error; the first (α = 0, RTN) wins."""
    g = torch.Generator().manual_seed(6)
    X = torch.randn(64, 8, generator=g, dtype=torch.float64)
    W = torch.randn(4, 8, generator=g, dtype=torch.float64)
    s, alpha, errors = search_scale([(W, int_config(4, PerChannel(0)))], 2 * X.T @ X / 64, torch.full((8,), 0.7))
    assert alpha == 0.0 and len(set(errors)) == 1 and torch.equal(s, torch.ones(8, dtype=torch.float64))


def test_clip_search_per_output_channel_and_per_tensor():
    """Per output channel, each row is one group (brute force); per tensor there is no row range to clip (the
    weight comes back as it was); a float32 weight comes back in float32."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(300, 12, generator=g, dtype=torch.float64)
    W = torch.randn(5, 12, generator=g, dtype=torch.float64)
    W[1, 7] = 5.0
    H = 2 * X.T @ X / X.shape[0]
    got = search_clip(W, H, int_config(3, PerChannel(0)))
    want = _brute_clip(W, X, 3, 12)
    assert not torch.equal(want, W)  # the outlier's row is clipped
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    from diffquant.quant.numerics.granularity import PerTensor

    assert search_clip(W, H, int_config(3, PerTensor())) is W
    single = search_clip(W.float(), H, int_config(3, PerChannel(0)))
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), want, rtol=0, atol=1e-6)


def test_clip_search_keeps_the_full_range_where_every_shrink_ties():
    """A group whose inputs are zero on every token has output error 0 at every shrink: the first (no clip) is
    kept, the weights untouched; the other group is searched as before."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(200, 10, generator=g, dtype=torch.float64)
    X[:, :5] = 0
    W = torch.randn(3, 10, generator=g, dtype=torch.float64)
    W[:, 2] = 4.0
    got = search_clip(W, 2 * X.T @ X / X.shape[0], int_config(3, PerGroup(5)))
    assert torch.equal(got[:, :5], W[:, :5])
    torch.testing.assert_close(got, _brute_clip(W, X, 3, 5), rtol=0, atol=1e-12)
