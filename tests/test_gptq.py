"""GPTQ against a column-by-column transcription of the paper's algorithm written here, and on a model."""

import pytest
import torch

from diffquant.quant.numerics import math as Q
from diffquant.quant.numerics.config import QuantConfig, int_config
from diffquant.quant.numerics.formats import Format
from diffquant.quant.algorithms.gptq import solve
from diffquant.quant.algorithms.gptq_config import GPTQ
from diffquant.quant.numerics.granularity import PerChannel, PerGroup


def reference_gptq(W, H, bits, group=None, act_order=False, damp=0.01):
    """Frantar et al. 2022, Algorithm 1 without lazy batches: symmetric absmax int grid; U = Cholesky of H⁻¹
    (upper); after rounding column j, the later columns absorb (w_j − q_j) / U_jj · U[j, j:]. Group scales
    from the group's columns when its first column is reached, or (act-order) from the original weight."""
    W, H = W.double().clone(), H.double().clone()
    rows, cols = W.shape
    qmax = 2 ** (bits - 1) - 1
    dead = torch.diagonal(H) == 0  # inputs that are always zero, as the reference code: H 1 there, weights 0
    H[dead, dead] = 1
    W[:, dead] = 0

    def absmax_scale(block):
        s = block.abs().amax(dim=1) / qmax
        return torch.where(s > 0, s, torch.ones_like(s))

    static = None
    if group is None:
        static = absmax_scale(W)[:, None].expand(rows, cols)
    elif act_order:
        static = torch.stack([absmax_scale(W[:, c - c % group: c - c % group + group]) for c in range(cols)], dim=1)
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(cols)
    W, H = W[:, perm], H[perm][:, perm]
    if static is not None:
        static = static[:, perm]
    H = H + damp * torch.diagonal(H).mean() * torch.eye(cols, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.linalg.inv(H)).T  # H⁻¹ = UᵀU
    out = torch.zeros_like(W)
    s = None
    for j in range(cols):
        if static is not None:
            s = static[:, j]
        elif j % group == 0:
            s = absmax_scale(W[:, j:j + group])
        q = torch.clamp(torch.round(W[:, j] / s), -qmax, qmax) * s
        err = (W[:, j] - q) / U[j, j]
        W[:, j:] -= torch.outer(err, U[j, j:])
        out[:, j] = q
    return out[:, torch.argsort(perm)]


def lazy_reference(W, H, bits, group=None, act_order=False, block=128, damp=0.01):
    """`solve` transcribed plainly in W's own layout, the float operations in the same order: lazy blocks of
    `block` columns (aligned to groups), rank-1 updates within a block, one product for the later blocks; group
    scales from the group's columns as updated (or, act-order, from the original weight); then the float64
    solution rounded once more, in float32 and the scales' dtype (W's). Returns (weight, scale [rows, scales]),
    both in W's dtype."""
    dtype, W, H = W.dtype, W.double().clone(), H.double().clone()
    rows, cols = W.shape
    qmax = 2 ** (bits - 1) - 1

    def absmax_scale(cols_):
        s = cols_.abs().amax(dim=1) / qmax
        return torch.where(s > 0, s, torch.ones_like(s))

    width = group or cols
    original = torch.stack([absmax_scale(W[:, g:g + width]) for g in range(0, cols, width)], dim=1)
    static = None if group is not None and not act_order else original.repeat_interleave(width, dim=1)[:, :cols]
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(cols)
    W, H = W[:, perm], H[perm][:, perm]
    if static is not None:
        static = static[:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    out, found = torch.zeros_like(W), []
    if group is not None and not act_order:
        block = group * max(1, block // group)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, E1 = W[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, dtype=W.dtype)
        for i in range(i2 - i1):
            j = i1 + i
            if static is not None:
                s = static[:, j]
            elif j % group == 0:
                s = absmax_scale(W1[:, i:i + group])
                found.append(s)
            q = torch.clamp(torch.round(W1[:, i] / s), -qmax, qmax) * s
            err = (W1[:, i] - q) / U[j, j]
            W1[:, i:] -= err[:, None] * U[j, j:i2][None, :]
            out[:, j], E1[:, i] = q, err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    out = out[:, torch.argsort(perm)]
    scale = (torch.stack(found, dim=1) if found else original).to(dtype)
    s = scale.repeat_interleave(width, dim=1)[:, :cols]  # out in float32, the scales in W's dtype (promoted)
    return (torch.clamp(torch.round(out.float() / s), -qmax, qmax) * s).to(dtype), scale


@pytest.mark.parametrize("group,act_order,block", [(16, False, 32), (16, False, 16), (16, True, 16),
                                                   (None, False, 16), (None, True, 32)])
def test_gptq_is_bit_identical_to_its_plain_transcription(group, act_order, block):
    """The solver's loop (a transposed block, no permutation without act-order) gives exactly the weights and
    scales of the plain lazy-batch form, on a layer with rounding ties (weights on half steps, scales 1) and
    act-order ties (two inputs with the same energy), groups of 16 ending with a ragged one of 8. A float64
    weight keeps its float64 group scales, which are taken from updated columns: any change in the arithmetic
    of the updates shows in their last bits."""
    g = torch.Generator().manual_seed(3)
    rows, cols = 48, 72
    W = torch.randint(-13, 14, (rows, cols), generator=g).float() / 2  # k/2: every odd k is a tie at scale 1
    W[:, ::8] = 7.0  # every group's (and row's) absmax: scales of exactly 1
    X = torch.randn(300, cols, generator=g, dtype=torch.float64)
    X[:, 9] = X[:, 5]  # equal diagonal entries: act-order keeps their order
    X[:, 30] *= 10
    H = 2 * X.T @ X / X.shape[0]
    config = int_config(4, PerGroup(group) if group else PerChannel(0))
    assert (W.frac().abs() == 0.5).any()  # the ties are there
    for w in (W, W.double()):
        got, scale, _ = solve(w, H, config, GPTQ(block=block, act_order=act_order))
        want, want_scale = lazy_reference(w, H, 4, group, act_order, block)
        assert got.dtype == scale.dtype == w.dtype
        assert torch.equal(got, want) and torch.equal(scale.reshape(rows, -1), want_scale)


def _data(rows=24, cols=44, tokens=400, outliers=(3, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, cols // 2, generator=g) @ torch.randn(cols // 2, cols, generator=g)  # correlated inputs
    X[:, list(outliers)] *= 20  # outlier input channels, as LLM activations have
    W = torch.randn(rows, cols, generator=g) * 0.1
    return W, X, 2 * X.double().T @ X.double() / tokens


@pytest.mark.parametrize("gran,act_order", [(PerChannel(0), False), (PerGroup(16), False), (PerChannel(0), True),
                                            (PerGroup(16), True), (PerGroup(8), False), (PerGroup(12), False)])
def test_gptq_equals_the_papers_algorithm(gran, act_order):
    """Blocks of 16 columns: groups of 12 do not divide them, so the blocks are aligned to the groups (a group's
    scale is taken from its columns after every earlier column's update, as column by column)."""
    W, _, H = _data()  # 44 inputs: groups of 16 end with a ragged group of 12
    got, _, _ = solve(W, H, int_config(4, gran), GPTQ(block=16, act_order=act_order))  # several lazy blocks
    want = reference_gptq(W, H, 4, gran.size if isinstance(gran, PerGroup) else None, act_order)
    assert got.dtype == W.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [int_config(4, PerChannel(0)), int_config(3, PerGroup(16)),
                                    QuantConfig(Format("int", 4, symmetric=False), PerGroup(16)),
                                    QuantConfig(Format("nf4"), PerGroup(16)),
                                    QuantConfig(Format("fp4_e2m1"), PerChannel(0)),
                                    QuantConfig(Format("fp8_e4m3"), PerChannel(0))])
def test_gptq_result_lies_on_the_grid(config):
    W, _, H = _data()
    for act_order in (True, False):  # static scales, and (groups) scales found as the columns are reached
        wq, scale, zero = solve(W, H, config, GPTQ(act_order=act_order))
        assert scale.shape == zero.shape and scale.dtype == zero.dtype == W.dtype
        again = Q.fake_quantize(wq, scale, zero, config.format, config.granularity)
        assert torch.equal(again, wq)  # a static fake quantizer with these scales keeps it bit-exactly
    if not config.format.symmetric:  # the codes q = w/s + z written out: integers on [0, 15], one (s, z) a group
        s = scale.squeeze(-1).repeat_interleave(16, dim=1)[:, :W.shape[1]]
        z = zero.squeeze(-1).repeat_interleave(16, dim=1)[:, :W.shape[1]]
        c = wq / s + z
        assert torch.allclose(c, c.round(), atol=1e-4) and c.min() >= -1e-4 and c.max() <= 15 + 1e-4
        assert (zero != 0).any() and (zero != zero.flatten()[0]).any()  # zeros that a swap of groups would move
    if config.format.name == "int" and config.format.symmetric and isinstance(config.granularity, PerGroup):
        s = scale.squeeze(-1).repeat_interleave(16, dim=1)[:, :W.shape[1]]
        c = wq / s
        assert torch.allclose(c, c.round(), atol=1e-4) and c.abs().max() <= config.format.qmax + 1e-4


def test_gptq_beats_rtn_on_outlier_columns():
    W, X, H = _data(rows=32, cols=64, tokens=800)
    qmax = 7
    s = W.abs().amax(dim=1, keepdim=True) / qmax
    rtn = torch.clamp(torch.round(W / s), -qmax, qmax) * s
    wq, _, _ = solve(W, H, int_config(4, PerChannel(0)), GPTQ())
    err = lambda w: ((X @ (W - w).T) ** 2).mean().item()  # noqa: E731
    assert err(wq) < 0.5 * err(rtn)


def test_act_order_is_gptq_on_the_permuted_columns():
    W, _, H = _data()
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    assert perm[:2].tolist() == [3, 17] or perm[:2].tolist() == [17, 3]  # the outlier columns go first
    config = int_config(4, PerChannel(0))
    got, _, _ = solve(W, H, config, GPTQ(act_order=True))
    plain, _, _ = solve(W[:, perm], H[perm][:, perm], config, GPTQ())
    torch.testing.assert_close(got, plain[:, torch.argsort(perm)], atol=0, rtol=0)


def test_gptq_on_a_model_installs_reversibly(micro_pair):
    from diffquant.quant.numerics.scheme import get_scheme, attach_scheme
    from diffquant.quant.algorithms.solvers import parse, solve_weights_

    for model in micro_pair:  # Llama and DiffLlama
        before = {k: v.clone() for k, v in model.state_dict().items()}
        calib = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
        scheme = get_scheme("w4a16-g32")
        solved = solve_weights_(model, parse("gptq"), scheme, calib, progress=False)
        solved_weights = {k: v.clone() for k, v in model.state_dict().items()}
        assert any(not torch.equal(solved_weights[k], before[k]) for k in before)
        attachment = attach_scheme(model, solved.scheme(scheme))
        solved.install(attachment)
        for name, q in attachment.quantizers.items():
            module = attachment.table.modules[name]
            assert torch.equal(module.weight, solved_weights[module_key(model, module)]), name  # on the grid
        attachment.remove()
        solved.remove()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def module_key(model, module) -> str:
    return next(f"{n}.weight" for n, m in model.named_modules() if m is module)


def input_hessian(model, producer, calib) -> torch.Tensor:
    """H = 2·XᵀX / tokens of what `producer` outputs on the calibration ids, read by a plain forward hook."""
    seen = []
    h = producer.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        model(calib, use_cache=False)
    h.remove()
    x = torch.cat(seen).double().flatten(0, -2)
    return 2 * x.T @ x / x.shape[0]


def test_gptq_layer_zero_solves_its_own_inputs(micro_pair):
    """Layer 0's q_proj is solved on the Hessian of its real input (the first norm's output)."""
    from diffquant.quant.numerics.scheme import get_scheme
    from diffquant.quant.algorithms.solvers import parse, solve_weights_

    model = micro_pair[0]
    calib = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    layer = model.model.layers[0]
    H = input_hessian(model, layer.input_layernorm, calib)
    w = layer.self_attn.q_proj.weight.detach().clone()
    want = reference_gptq(w, H, 4, 32)
    solved = solve_weights_(model, parse("gptq"), get_scheme("w4a16-g32"), calib, progress=False)
    try:
        torch.testing.assert_close(layer.self_attn.q_proj.weight.detach().double(), want, atol=1e-5, rtol=0)
    finally:
        solved.remove()


def test_quantize_cli_with_gptq_round_trip(micro_pair, tmp_path):
    """`quantize --solver awq+gptq` on a DiffLlama with rotate: the saved folder (AWQ's folded norms, GPTQ's
    weights and scales) reloads to the same loss, and `remove()` gives back the float model."""
    import json

    from diffquant.cli import main
    from diffquant.data.corpora import split
    from diffquant.data.tokens import byte_tokenizer, encode, sequences
    from diffquant.evaluate import language_modeling
    from diffquant.models.load import load_model

    micro_pair[1].save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "c.txt").write_text("\n".join(f"line {i}: and the lord spake unto moses" for i in range(2000)))
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tmp_path / "m"), "--scheme", "w4a8", "--fix", "rotate",
                 "--solver", "awq+gptq", "--data", str(tmp_path / "c.txt"), "--eval-tokens", "256", "--seq-len", "32",
                 "--calib-tokens", "128", "--out", str(out)]) == 0
    result = json.loads((out / "quantize.json").read_text())
    assert result["solver_record"]["weights"] == "awq+gptq" and result["calibration"]["tokens"] == 4 * 32
    loaded, tok = load_model(str(out))
    evalset = sequences(encode(tok, split((tmp_path / "c.txt").read_text())[1]), 32, 256)
    assert language_modeling(loaded, evalset)["loss"] == pytest.approx(result["simulated"]["loss"], rel=1e-6)
    loaded._diffquant_quant.remove()  # the scheme, the solved weights and the rotation, all at once
    float_model, _ = load_model(str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), float_model.state_dict().values()))


def test_sweep_weights_axis(micro_pair, tmp_path):
    from diffquant.sweeps import Cell, build_cells, run_cells

    cells = build_cells(["m"], [], [16], ["tensor"], [4], None, {"m": 2}, ["none"], solvers=["rtn", "gptq"])
    assert [c.weights for c in cells if c.kind == "wa"] == ["rtn", "gptq"]
    assert Cell("m", "wa").key() == "m|wa|attn_logits|16|tensor|16|None|none"  # keys of older sweeps still resume
    model = micro_pair[0]
    seqs = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(2))

    def evaluator(m):
        with torch.no_grad():
            return {"loss": m(seqs, labels=seqs).loss.item()}

    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = run_cells({"m": (model, None)}, cells, {"m": evaluator}, tmp_path, progress=False,
                     calibration={"m": seqs})
    by = {r["weights"]: r for r in rows if r["kind"] == "wa"}
    assert by["gptq"]["scheme"] == "w4a4+gptq" and by["gptq"]["loss"] != by["rtn"]["loss"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_layer_input_hessians_match_each_modules_own_input(micro_pair):
    """Every Linear's Hessian and mean |x| equal 2·XᵀX / n of its own input, computed here in float64 from
    hooks on each module, though modules that read one tensor (q/k/v, gate/up) share a product."""
    from diffquant.quant.algorithms.solvers import _first_layer_inputs, _input_stats

    model = micro_pair[0]
    calib = torch.randint(0, model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(2))
    layer = model.model.layers[0]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    mods = {n: layer.get_submodule(n) for n in names}
    with torch.no_grad():
        inputs = _first_layer_inputs(model, layer, calib)
        assert len(inputs) == 2  # two chunks: the sums run over both
        got = _input_stats(layer, inputs, mods)
        seen = {n: [] for n in names}
        hs = [m.register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0].detach().clone())) for n, m in mods.items()]
        for args, kwargs in inputs:
            layer(*args, **kwargs)
        for h in hs:
            h.remove()
    for n in names:
        x = torch.cat(seen[n]).reshape(-1, seen[n][0].shape[-1]).double()
        torch.testing.assert_close(got[n][0], 2 * x.T @ x / x.shape[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[n][1], x.abs().mean(dim=0), rtol=1e-6, atol=1e-7)
    # the pass stops at the last input it needs: down_proj itself never runs; the Hessians are the same
    ran = []
    h = mods["mlp.down_proj"].register_forward_hook(lambda *a: ran.append(1))
    with torch.no_grad():
        again = _input_stats(layer, inputs, mods, mean_abs=False)
    h.remove()
    assert not ran and all(torch.equal(again[n][0], got[n][0]) and again[n][1] is None for n in names)


def test_quantize_cli_quarot_is_rotation_plus_gptq(micro_pair, tmp_path):
    """`--fix quarot` rotates (record: residual, V/O and down_proj matrices) and solves the weights by GPTQ
    (the scheme named +gptq, solver_record gptq), where `--fix rotate` leaves them to RTN."""
    import json

    from diffquant.cli import main
    from diffquant.data.tokens import byte_tokenizer

    micro_pair[0].save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "c.txt").write_text("\n".join(f"line {i}: and the lord spake unto moses" for i in range(2000)))
    results = {}
    for fix in ("quarot", "rotate"):
        out = tmp_path / fix
        assert main(["quantize", "--model", str(tmp_path / "m"), "--scheme", "w4a8", "--fix", fix,
                     "--data", str(tmp_path / "c.txt"), "--eval-tokens", "256", "--seq-len", "32", "--calib-tokens", "128",
                     "--out", str(out)]) == 0
        results[fix] = json.loads((out / "quantize.json").read_text())
    q, r = results["quarot"], results["rotate"]
    assert q["solver"] == "gptq" and q["solver_record"]["weights"] == "gptq" and q["scheme"]["name"] == "w4a8"
    assert r["solver"] == "rtn" and r["solver_record"]["weights"] == "rtn"
    assert set(q["fix_records"][0]["matrices"]) == {"residual", "down_in", "v_o"}
    assert q["fix_records"][0]["mitigation"] == "rotate"  # the recipe: the rotation, then GPTQ
    assert q["recipe"] == {"fixes": ["rotate"], "solver": "gptq", "scheme": "w4a8"}
    assert q["simulated"]["loss"] != r["simulated"]["loss"]


def test_gptq_breakdown_runs(capsys):
    """benchmarks/gptq_breakdown.py's stages on the micro model: one line per layer, every stage timed."""
    import json

    from benchmarks.gptq_breakdown import main

    main(["--quick", "--layers", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["layer"] for r in rows] == [0, 1]
    assert all(r[k] >= 0 for r in rows for k in ("statistics", "XᵀX alone", "solve", "Cholesky alone", "propagate"))


@pytest.mark.parametrize("gran,act_order", [(PerChannel(0), False), (PerChannel(0), True), (PerGroup(16), False),
                                            (PerGroup(16), True)])
def test_inputs_that_are_always_zero(gran, act_order):
    """Two inputs that are zero on every calibration token (diag H = 0): as the reference code, H is 1 there (which
    enters the damping's mean: the Hessian is small here, so it moves every column) and their weights are 0. Unlike
    the reference code, whose per-channel scales still see those weights, the scales here leave them out: weights
    below 1 and a row whose largest is on a dead input show it."""
    W, X, _ = _data()
    X = X * 0.01
    X[:, [5, 30]] = 0
    W[2, 30] = 0.9  # row 2's largest weight, on a dead input
    H = 2 * X.double().T @ X.double() / X.shape[0]
    assert (torch.diagonal(H) == 0).sum() == 2 and torch.diagonal(H).mean() < 0.5
    group = gran.size if isinstance(gran, PerGroup) else None
    got, scale, _ = solve(W, H, int_config(4, gran), GPTQ(block=16, act_order=act_order))
    want = reference_gptq(W, H, 4, group, act_order)
    assert torch.equal(got[:, [5, 30]], torch.zeros(W.shape[0], 2))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    if group is None:
        live = W.clone()
        live[:, [5, 30]] = 0
        torch.testing.assert_close(scale.flatten(), live.abs().amax(dim=1) / 7, atol=1e-7, rtol=0)


def test_act_order_keeps_tied_inputs_in_their_order():
    """72 inputs of ±1 on every token: every diag H is exactly 2, so act-order's order is the ties' (a sort that is
    not stable scrambles them past 16 elements, and the order moves every error's path)."""
    g = torch.Generator().manual_seed(5)
    X = torch.randint(0, 2, (200, 72), generator=g).double() * 2 - 1
    H = 2 * X.T @ X / X.shape[0]
    assert bool((torch.diagonal(H) == 2).all())
    W = torch.randn(16, 72, generator=g) * 0.1
    got, scale, _ = solve(W, H, int_config(4, PerChannel(0)), GPTQ(block=32, act_order=True))
    want, want_scale = lazy_reference(W, H, 4, None, True, block=32)
    assert torch.equal(got, want) and torch.equal(scale.reshape(16, -1), want_scale)


def test_gptq_scales_refuse_a_granularity_weights_do_not_have():
    from diffquant.errors import DiffquantError
    from diffquant.quant.algorithms.gptq import scales
    from diffquant.quant.numerics.granularity import PerHead

    with pytest.raises(DiffquantError, match=r"per-head granularity needs a site with a head dimension, not "
                                             r"\[out_channel, in_channel\]"):
        scales(torch.ones(4, 8), int_config(4, PerHead()))


def test_gptq_on_conv1d_weights_solves_them_as_out_by_in():
    """GPT-2 stores its projections transposed ([in, out], Conv1D): layer 0's c_attn is solved as the paper's
    [out, in] weight on the Hessian of its real input (ln_1's output), and stored back transposed."""
    from diffquant.models.matrix import FAMILIES
    from diffquant.quant.algorithms.solvers import parse, solve_weights_
    from diffquant.quant.numerics.scheme import get_scheme

    model = FAMILIES["gpt2"].build()
    calib = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(2))
    block = model.transformer.h[0]
    H = input_hessian(model, block.ln_1, calib)
    stored = block.attn.c_attn.weight.detach().clone()  # [in, out]
    assert stored.shape[0] != stored.shape[1]
    want = reference_gptq(stored.t(), H, 4, 32)
    solved = solve_weights_(model, parse("gptq"), get_scheme("w4a16-g32"), calib, progress=False)
    try:
        got = block.attn.c_attn.weight.detach()
        assert got.shape == stored.shape
        torch.testing.assert_close(got.t().double(), want, atol=1e-5, rtol=0)
    finally:
        solved.remove()
    assert torch.equal(block.attn.c_attn.weight, stored)


def test_gptq_refuses_fused_expert_weights_in_one_line():
    """A fused MoE weight holds every expert's matrix; each expert sees only its routed tokens, which one
    Hessian of the module's input does not describe."""
    from diffquant.errors import DiffquantError
    from diffquant.models.matrix import FAMILIES
    from diffquant.quant.algorithms.solvers import parse, solve_weights_
    from diffquant.quant.numerics.scheme import get_scheme

    model = FAMILIES["mixtral"].build()
    calib = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(DiffquantError, match=r"^gptq does not support fused MoE expert weights \(layers\.0\.mlp\."
                                             r"experts\.gate_up_proj\.weight\).*use --solver rtn$"):
        solve_weights_(model, parse("gptq"), get_scheme("w4a16-g32"), calib, progress=False)
