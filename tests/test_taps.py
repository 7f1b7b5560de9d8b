import pytest
import torch

from diffquant import DiffquantError
from diffquant.taps import site_table, tapped
from diffquant.taps import attention as tapped_attention_module


def _observer(log=None):
    def tap(x, ctx):
        if log is not None:
            log.append(ctx.site.name)
    return tap


def _reference(model, impl, ids, mask=None):
    original = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits
    finally:
        model.set_attn_implementation(original)


def _tapped(model, ids, mask=None, sites=("*.attn_logits",)):
    with tapped(model, {s: _observer() for s in sites}), torch.no_grad():
        assert model.config._attn_implementation == "diffquant"
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tapped_equals_own_attention(any_model, impl):
    ids = torch.randint(0, 512, (2, 24))
    ref = _reference(any_model, impl, ids)
    out = _tapped(any_model, ids, sites=("*.attn_logits", "*.attn_probs"))
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tapped_equals_own_attention_with_padding(any_model, impl):
    ids = torch.randint(0, 512, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    mask[2, 15:] = 0  # right padding
    ref = _reference(any_model, impl, ids, mask)
    out = _tapped(any_model, ids, mask)
    valid = mask.bool()
    assert (out - ref)[valid].abs().max().item() <= 1e-5
    assert torch.isfinite(out).all()


def test_generation_with_kv_cache(any_model):
    ids = torch.randint(0, 512, (2, 8))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
    original = any_model.config._attn_implementation
    with torch.no_grad():
        ref = any_model.generate(ids, **kwargs)
        with tapped(any_model, {"*.attn_logits": _observer()}):
            out = any_model.generate(ids, **kwargs)
    assert any_model.config._attn_implementation == original
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max().item() <= 1e-5


def test_causality(any_model):
    ids = torch.randint(0, 512, (1, 16))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 512
    a = _tapped(any_model, ids)
    b = _tapped(any_model, changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.equal(a[0, 10:], b[0, 10:])


def test_diff_logits_pass_once_per_causal_position(micro_pair):
    model = micro_pair[1]
    cfg = model.config
    T, B = 13, 2
    seen = {"n": 0, "masked_seen": 0}

    def count(x, ctx):
        valid = ctx.valid.expand_as(x)
        seen["n"] += int(valid.sum())

    with tapped(model, {"*.attn_logits": count}), torch.no_grad():
        model(torch.randint(0, 512, (B, T)))
    assert seen["n"] == B * cfg.num_hidden_layers * cfg.num_attention_heads * T * (T + 1) // 2


def test_masked_positions_never_valid(micro_pair):
    """With padding, exactly the causal positions between real tokens are valid."""
    model = micro_pair[1]
    cfg = model.config
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0
    counts = []
    with tapped(model, {"*.attn_logits": lambda x, ctx: counts.append(int(ctx.valid.expand_as(x).sum()))}):
        with torch.no_grad():
            model(torch.randint(0, 512, (2, 10)), attention_mask=mask)
    per_layer = cfg.num_attention_heads * (6 * 7 // 2 + 10 * 11 // 2)
    assert counts == [per_layer] * cfg.num_hidden_layers


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
@pytest.mark.parametrize("ours", [True, False])
def test_masked_scores_match_masked_fill(poison, ours):
    """The additive-bias mask equals masked_fill, also with non-finite logits at masked positions; it
    writes into the logits only when they are the attention's own tensor."""
    logits = torch.randn(2, 3, 7, 7)
    valid = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    if poison is not None:
        logits[0, 0, 0, 5] = poison  # masked: it must not reach the softmax
    ref = logits.masked_fill(~valid, float("-inf"))
    tapped_logits = logits if ours else logits.clone()
    before = tapped_logits.clone()
    out = tapped_attention_module.masked_scores(tapped_logits, logits, valid)
    assert torch.equal(out, ref) and bool(torch.softmax(out, -1).isfinite().all())
    assert (out.data_ptr() == tapped_logits.data_ptr()) == ours
    if not ours:
        assert torch.equal(tapped_logits.nan_to_num(), before.nan_to_num())  # a tap's tensor is never written


def test_fast_path_without_attention_taps(micro_pair, monkeypatch):
    model = micro_pair[0]
    calls = []
    monkeypatch.setattr(tapped_attention_module, "_probabilities", lambda *a, **k: calls.append(1))
    with tapped(model, {"*.hidden": _observer()}), torch.no_grad():
        assert model.config._attn_implementation == "sdpa"
        model(torch.randint(0, 512, (1, 8)))
    assert calls == []


def test_every_site_fires(any_model):
    table = site_table(any_model)
    log = []
    activation_sites = [s.name for s in table if not s.is_weight]
    with tapped(any_model, {name: _observer(log) for name in activation_sites}), torch.no_grad():
        any_model(torch.randint(0, 512, (1, 8)))
    assert sorted(set(log)) == sorted(activation_sites)
    assert len(log) == len(activation_sites)  # each fires exactly once per forward


def test_writing_to_a_site_changes_the_output(any_model):
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        ref = any_model(ids).logits
    table = site_table(any_model)
    points = {s.kind for s in table if s.layer == 0} - {"attn_map", "lambda"}

    def scale(x, ctx):
        return x * 0.5

    scale.transforms = True
    for point in sorted(points):
        pattern = "layers.0.self_attn.q_proj.weight" if point == "weight" else f"layers.0.{point}"
        with tapped(any_model, {pattern: scale}), torch.no_grad():
            out = any_model(ids).logits
        assert not torch.allclose(out, ref), point
    with torch.no_grad():
        assert torch.equal(any_model(ids).logits, ref)


def test_weight_transform_is_reversible(micro_pair):
    model = micro_pair[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def zero(w, ctx):
        return torch.zeros_like(w)

    zero.transforms = True
    with tapped(model, {"*.weight": zero}):
        assert all(float(m.weight.abs().sum()) == 0 for m in model.modules() if isinstance(m, torch.nn.Linear))
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hooks_removed_exactly(micro_pair):
    model = micro_pair[0]
    user_log = []
    before = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()}
    handle = model.model.layers[0].register_forward_hook(lambda *a: user_log.append(1))
    ids = torch.randint(0, 512, (1, 8))
    try:
        log = []
        with tapped(model, {"*.hidden": _observer(log)}):
            with tapped(model, {"*.attn_logits": _observer(log)}):
                with pytest.raises(RuntimeError):
                    with tapped(model, {"*.mlp_in": _observer(log)}):
                        raise RuntimeError("boom")
                model(ids)
                assert model.config._attn_implementation == "diffquant"
            assert model.config._attn_implementation == "sdpa"
            model(ids)
        model(ids)
        assert log.count("layers.0.hidden") == 2 and log.count("layers.0.attn_logits") == 1
        assert "layers.0.mlp_in" not in log
        assert len(user_log) == 3
    finally:
        handle.remove()
    # exactly the hooks there were before (the model is a session fixture other tests may have hooked)
    assert {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()} == before


def test_unknown_site_lists_choices(micro_pair):
    with pytest.raises(DiffquantError, match="points: .*attn_logits"):
        site_table(micro_pair[0]).match("layers.0.attn_logit")
    with pytest.raises(DiffquantError, match="only in DIFF"):
        site_table(micro_pair[0]).match("*.attn_map")


def test_model_without_attention_interface(bloom):
    log = []
    with tapped(bloom, {"*.hidden": _observer(log)}), torch.no_grad():
        bloom(torch.randint(0, 512, (1, 6)))
    assert log == ["layers.0.hidden", "layers.1.hidden"]
    with pytest.raises(DiffquantError, match="not through transformers' AttentionInterface.*points: attn_in, attn_out, mlp_in, down_in, hidden"):
        tapped(bloom, {"*.attn_logits": _observer()}).__enter__()


def test_diff_map_and_lambda(micro_pair):
    model = micro_pair[1]
    got = {}

    def grab(x, ctx):
        got[ctx.site.name] = x.detach().clone()

    with tapped(model, {"layers.1.attn_probs": grab, "layers.1.attn_map": grab, "layers.1.lambda": grab}):
        with torch.no_grad():
            model(torch.randint(0, 512, (1, 9)))
    attn = model.model.layers[1].self_attn
    lam = torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum()) + attn.lambda_init
    assert torch.allclose(got["layers.1.lambda"], lam.detach())
    p = got["layers.1.attn_probs"]
    h = p.shape[1] // 2
    torch.testing.assert_close(got["layers.1.attn_map"], p[:, :h] - lam.detach() * p[:, h:])
    assert abs(attn.lambda_init - (0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * 1)).item())) < 1e-6


def _explicit_layers(monkeypatch) -> list:
    """The layer of every explicit (T × T) attention computation from now on."""
    seen = []
    real = tapped_attention_module._probabilities
    monkeypatch.setattr(tapped_attention_module, "_probabilities",
                        lambda module, *a, **k: seen.append(module.layer_idx) or real(module, *a, **k))
    return seen


def test_untapped_layers_run_their_own_attention(any_model, monkeypatch):
    """A tap on the last layer's logits: only that layer computes explicitly; the layers before it run the
    model's own SDPA call, on the mask SDPA gets (none where the input is plainly causal: its is_causal
    path), so their outputs are the untapped model's bit for bit, with and without padding."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    last = any_model.config.num_hidden_layers - 1
    explicit = _explicit_layers(monkeypatch)
    masks = []
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda m, q, k, v, mask, **kw: masks.append(mask is None) or real(m, q, k, v, mask, **kw)
    try:
        ids = torch.randint(0, 512, (2, 12))
        padded = torch.ones(2, 12, dtype=torch.long)
        padded[0, :3] = 0
        for mask in (None, padded):
            explicit.clear()
            h_ref, h_tapped = [], []
            hook = any_model.model.layers[last - 1].register_forward_hook(lambda m, a, o: h_ref.append(o))
            with torch.no_grad():
                ref = any_model(ids, attention_mask=mask).logits
            hook.remove()
            masks.clear()
            hook = any_model.model.layers[last - 1].register_forward_hook(lambda m, a, o: h_tapped.append(o))
            try:
                out = _tapped(any_model, ids, mask, sites=(f"layers.{last}.attn_logits",))
            finally:
                hook.remove()
            assert explicit == [last]
            assert torch.equal(h_tapped[0], h_ref[0])
            calls = last * (2 if any_model.config.model_type == "diffllama" and mask is not None else 1)
            diff_unpadded = any_model.config.model_type == "diffllama" and mask is None  # one padded SDPA call of its own
            assert masks == ([] if diff_unpadded else [mask is None] * calls)
            assert (out - ref).abs().max().item() <= 1e-5
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def test_a_tapped_layer_sees_the_same_whatever_else_is_tapped(micro_pair):
    """Layer 0's logit statistics are the same bit for bit when every layer is tapped and when it alone is."""
    from diffquant.profiler import profile_model

    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    for model in micro_pair:
        alone = profile_model(model, ids, ["layers.0.attn_logits"], progress=False).sites["layers.0.attn_logits"]
        every = profile_model(model, ids, ["*.attn_logits"], progress=False).sites["layers.0.attn_logits"]
        assert alone.summary() == every.summary()


def test_sinks_alone_keep_every_layer_on_its_kernel(micro_pair, monkeypatch):
    """The sink metrics with hidden-state sites (the default profile's sinks beside `--sites '*.hidden'`): no
    layer computes its T × T map; the first-key masses come from the layers' own kernel and equal the
    explicit computation's."""
    from diffquant.profiler import profile_model

    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(2))
    for model in micro_pair:
        ref = profile_model(model, ids, ["*.attn_logits"], sinks=True, progress=False).sink_summary()
        explicit = _explicit_layers(monkeypatch)
        got = profile_model(model, ids, ["*.hidden"], sinks=True, progress=False).sink_summary()
        assert explicit == []
        for layer, want in ref["layers"].items():
            for key in ("first_mass", "first_mass_map", "share", "value_ratio", "massive_ratio"):
                if want.get(key) is not None:
                    assert got["layers"][layer][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (layer, key)
        monkeypatch.undo()


def test_masks_are_built_per_query_block(micro_pair, monkeypatch):
    """With blocks of 8 query rows on 40 tokens, every mask the tapped attention builds covers one block (never
    40 × 40), transformers passes it no mask (plainly causal input), and nothing stays behind in a global."""
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "8")
    shapes, given = [], []
    rows = tapped_attention_module.Visible.rows

    def spy(self, device, r=None, end=None):
        given.append(self.mask)
        out = rows(self, device, r, end)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(tapped_attention_module.Visible, "rows", spy)
    for model in micro_pair:
        _tapped(model, torch.randint(0, 512, (2, 40)), sites=("*.attn_logits", "*.attn_probs"))
    assert shapes and all(s[-2] <= 8 and s[-1] == 40 for s in shapes)
    assert all(m is None for m in given)
    globals_ = vars(tapped_attention_module).values()
    assert not any(isinstance(v, torch.Tensor) or (isinstance(v, (list, dict)) and any(
        isinstance(x, torch.Tensor) for x in (v.values() if isinstance(v, dict) else v))) for v in globals_)
