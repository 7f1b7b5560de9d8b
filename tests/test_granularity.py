"""Granularities against the module's table written out: which dims each one reduces at every kind of site, what it
tells the code outside (group size, one scale per weight row, position runs), its names both ways, and the sites
it cannot apply to (issue 50: quant/numerics/granularity.py in the mutation check)."""

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.quant.numerics import granularity as G

TOKEN = ("batch", "pos", "channel")
LOGITS = ("batch", "head", "q", "k")
CACHE = ("batch", "kv_head", "pos", "dim")
WEIGHT = ("out", "in")


@pytest.mark.parametrize("g, dims, reduced", [
    (G.PerTensor(), TOKEN, (0, 1, 2)), (G.PerTensor(), WEIGHT, (0, 1)),
    (G.PerChannel(), TOKEN, (0, 1)), (G.PerChannel(), LOGITS, (0, 1, 2)), (G.PerChannel(0), WEIGHT, (1,)),
    (G.PerChannel(-2), WEIGHT, (1,)), (G.PerChannel(1), TOKEN, (0, 2)),
    (G.PerToken(), TOKEN, (2,)), (G.PerToken(), LOGITS, (3,)), (G.PerToken(), WEIGHT, (1,)),
    (G.PerHead(), LOGITS, (0, 2, 3)), (G.PerHead(), CACHE, (0, 2, 3)),
    (G.KVChannel(), CACHE, (0, 2)), (G.KVChannel(32), TOKEN, (0, 1)),
])
def test_each_granularity_reduces_the_dims_of_the_table(g, dims, reduced):
    x = torch.zeros((2, 3, 4, 5)[:len(dims)])
    assert g.reduce_dims(x, dims) == reduced


def test_what_each_granularity_tells_the_code_outside():
    """(group size, one scale per weight row, positions per scale)."""
    cases = {G.PerTensor(): (None, False, 0), G.PerChannel(): (None, False, 0), G.PerChannel(0): (None, True, 0),
             G.PerChannel(-2): (None, True, 0), G.PerChannel(1): (None, False, 0), G.PerToken(): (None, True, 0),
             G.PerHead(): (None, False, 0), G.PerGroup(64): (64, False, 0), G.KVChannel(): (None, False, 0),
             G.KVChannel(32): (None, False, 32)}
    for g, want in cases.items():
        assert (g.group_size, g.per_row, g.position_run) == want, g


def test_the_head_axis_is_the_first_head_dim_by_name():
    assert G.head_axis(LOGITS) == 1 and G.head_axis(CACHE) == 1 and G.head_axis(TOKEN) is None
    assert G.head_axis(("batch", "kv_head", "head")) == 2  # "head" is looked for before "kv_head"


def test_sites_a_granularity_cannot_apply_to():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(DiffquantError, match=r"^per-head granularity needs a site with a head dimension, not "
                                             r"\[batch, pos, channel\]$"):
        G.PerHead().reduce_dims(x, TOKEN)
    with pytest.raises(DiffquantError, match=r"^kv-channel granularity needs a site with a pos dimension, not "
                                             r"\[batch, head, q\]$"):
        G.KVChannel().reduce_dims(x, LOGITS[:3])
    bad = [(G.PerChannel(), (), "s is a scalar: only per-tensor scales apply, not channel"),
           (G.PerHead(), TOKEN, "s: per-head granularity needs a site with a head dimension, not [batch, pos, channel]"),
           (G.PerChannel(3), TOKEN, "s: channel axis 3 is outside its dims [batch, pos, channel]"),
           (G.PerChannel(-4), TOKEN, "s: channel axis -4 is outside its dims [batch, pos, channel]"),
           (G.KVChannel(), LOGITS, "s: kv-channel granularity needs a site with a pos dimension, not "
                                   "[batch, head, q, k]")]
    for g, dims, message in bad:
        with pytest.raises(DiffquantError) as err:
            G.validate(g, dims, "s")
        assert str(err.value) == message
    for g, dims in ((G.PerTensor(), ()), (G.PerChannel(-3), TOKEN), (G.PerChannel(2), TOKEN), (G.PerHead(), CACHE),
                    (G.KVChannel(), TOKEN)):
        G.validate(g, dims, "s")  # allowed: no error


@pytest.mark.parametrize("text, g, label", [
    ("tensor", G.PerTensor(), "tensor"), ("per-tensor", G.PerTensor(), "tensor"), ("channel", G.PerChannel(), "channel"),
    (" Channel:0 ", G.PerChannel(0), "channel:0"), ("token", G.PerToken(), "token"), ("row", G.PerToken(), "token"),
    ("head", G.PerHead(), "head"), ("group:64", G.PerGroup(64), "group:64"), ("group:1", G.PerGroup(1), "group:1"), ("kv-channel", G.KVChannel(), "kv-channel"),
    ("kv-channel:32", G.KVChannel(32), "kv-channel:32"),
])
def test_names_both_ways(text, g, label):
    assert G.parse_granularity(text) == g and G.label(g) == label
    assert G.from_dict(G.to_dict(g)) == g and G.from_dict(label) == g
    assert ("group" in G.to_dict(g)) == (isinstance(g, G.KVChannel) and g.group > 0)


def test_names_that_are_not_granularities():
    cases = {"group": "group granularity needs a positive size, e.g. group:128 (got 'group')",
             "group:0": "group granularity needs a positive size, e.g. group:128 (got 'group:0')",
             "group:x": "group granularity needs a positive size, e.g. group:128 (got 'group:x')",
             "kv-channel:x": "kv-channel granularity takes a position run length, e.g. kv-channel:32 (got "
                             "'kv-channel:x')",
             "block": "unknown granularity 'block'; choose tensor, channel[:AXIS], token, head, group:SIZE or "
                      "kv-channel[:POSITIONS]"}
    for text, message in cases.items():
        with pytest.raises(DiffquantError) as err:
            G.parse_granularity(text)
        assert str(err.value) == message
    with pytest.raises(DiffquantError, match=r"^unknown granularity 'block'; choose one of: tensor, channel, token, "
                                             r"head, group, kv-channel$"):
        G.from_dict({"kind": "block"})
    for make, message in ((lambda: G.PerGroup(0), "group size must be a positive integer, got 0"),
                          (lambda: G.PerGroup(True), "group size must be a positive integer, got True"),
                          (lambda: G.PerGroup(2.0), "group size must be a positive integer, got 2.0"),
                          (lambda: G.KVChannel(-1), "position group must be a non-negative integer, got -1"),
                          (lambda: G.KVChannel(True), "position group must be a non-negative integer, got True"),
                          (lambda: G.KVChannel(1.5), "position group must be a non-negative integer, got 1.5")):
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value) == message
    assert G.KVChannel(0).position_run == 0 and G.PerGroup(1).group_size == 1
