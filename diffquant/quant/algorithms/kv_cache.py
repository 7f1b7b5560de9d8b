"""A KV cache whose entries are quantized when written: decode-time evaluation of a KV scheme.

Prefill semantics (`attach_scheme` with a KV scheme) quantizes the keys and values of one forward at the
`k_cache` / `v_cache` sites, so every query sees every cached entry quantized. A deployed cache is
written token by token; `WriteOnceCache` simulates that with the same quantizers (same configs, same
arithmetic): each layer keeps the cache tensors transformers' DynamicLayer keeps, and replaces a span
of positions by its quantized values once, when the span becomes final:

- positions before `keep_first` (attention sinks) stay in full precision;
- the last `keep_last` positions (KIVI's residual window) stay in full precision until newer tokens
  push them out, then they are quantized;
- kv-channel:G keys are quantized in complete runs of G positions counted from `keep_first` (KIVI);
  the incomplete last run waits in full precision;
- otherwise a span is quantized as written: the prompt in one piece, then one token per step. A scale
  that spans positions (per tensor, per head, kv-channel without runs) therefore covers the prompt at
  prefill and a single token at each decode step.

Where the scale is per token (per token, per group of channels) and `keep_last` is 0, every entry is
quantized as the prefill semantics quantizes it, so decode-time logits equal prefill-time ones up to float
rounding (tests/test_kv_cache.py). Rounding is discontinuous: once a float-level difference between
one-query and whole-sequence attention (~1e-5) moves a value across a rounding boundary, the two runs carry
different draws of the same quantization noise. Elsewhere they differ by construction (a recent window is
full precision at decode; runs and spanning scales see fewer positions), and the decode-time numbers are the
deployed ones.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from diffquant.errors import DiffquantError
from diffquant.frozen import no_autograd
from diffquant.taps.attention import CACHE_POINTS


def final_end(config, length: int) -> tuple[int, int]:
    """[start, end) of the positions of a cache of `length` that are quantized now (see the module doc)."""
    start, end = config.quantized_span(length)
    g = config.granularity
    run = g.position_run or 1
    return start, start + (end - start) // run * run


class WriteOnceLayer(DynamicLayer):
    """DynamicLayer whose entries are quantized once each, when final. `quant`: {"keys"/"values": (FakeQuant,
    TapContext) or None}."""

    def __init__(self, quant: dict):
        super().__init__()
        self.quant = quant
        self.done = {"keys": 0, "values": 0}  # end of the quantized span so far

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states, *args, **kwargs)
        self.keys = self._write("keys", self.keys)
        self.values = self._write("values", self.values)
        return self.keys, self.values

    def _write(self, which: str, x: torch.Tensor) -> torch.Tensor:
        entry = self.quant.get(which)
        if entry is None:
            return x
        fq, ctx = entry
        start, end = final_end(fq.config, x.shape[2])
        first = max(self.done[which], start)
        if end <= first:
            return x
        y = fq.apply_all(x[:, :, first:end], ctx)
        self.done[which] = end
        return torch.cat([x[:, :, :first], y, x[:, :, end:]], dim=2)


class WriteOnceCache(Cache):
    """One WriteOnceLayer per decoder layer."""

    def __init__(self, layers: list[WriteOnceLayer]):
        super().__init__(layers=layers)


def write_once_cache(model, scheme) -> WriteOnceCache:
    """A fresh cache that quantizes `scheme`'s `k_cache` / `v_cache` sites on write. Refuses a scheme with any
    other site (apply those with `attach_scheme`), and models whose cache is not one full-attention layer per
    decoder layer (sliding windows, KV sharing, linear attention)."""
    from diffquant.quant.numerics.scheme import plan
    from diffquant.taps import site_table

    table = site_table(model)
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    types = set(types) if types else {"sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"}
    if types != {"full_attention"}:
        raise DiffquantError(f"decode-time KV quantization simulates full-attention caches only; "
                             f"{type(model).__name__} has {', '.join(sorted(types))} layers")
    planned = plan(model, scheme)
    other = sorted(n for n in planned if table.sites[n].kind not in CACHE_POINTS)
    if other:
        raise DiffquantError(f"scheme {scheme.name!r} quantizes sites other than the KV cache ({other[0]}, ...); "
                             "a write-once cache simulates k_cache/v_cache only")
    return WriteOnceCache([WriteOnceLayer(q) for q in _layer_quantizers(model, scheme)])


def _layer_quantizers(model, scheme, both: bool = False) -> list[dict]:
    """Per decoder layer {"keys"/"values": (FakeQuant, TapContext)} of the scheme's cache sites."""
    from diffquant.quant.numerics.fake import FakeQuant
    from diffquant.quant.numerics.scheme import plan
    from diffquant.taps import site_table
    from diffquant.taps.tap import TapContext

    table, planned = site_table(model), plan(model, scheme)
    out = []
    for i in range(len(table.layers)):
        quant = {}
        for which, point in (("keys", "k_cache"), ("values", "v_cache")):
            name = f"layers.{i}.{point}"
            if name in planned:
                quant[which] = (FakeQuant(planned[name]), TapContext(table.sites[name]))
            elif both:
                raise DiffquantError(f"scheme {scheme.name!r} leaves {name} in full precision; this cache "
                                     "quantizes keys and values together")
        out.append(quant)
    return out


class ResidualRequantLayer(DynamicLayer):
    """transformers' `QuantizedLayer` rule (its quanto / HQQ caches), simulated with diffquant's quantizers,
    to check the simulation against the real cache: the prompt is attended in full precision and stored
    quantized; later tokens wait in a full-precision residual of up to `residual` tokens, and when it fills,
    the dequantized cache and the residual are quantized again as one tensor. `quant`: {"keys"/"values":
    (FakeQuant, TapContext)}; their configs' kept windows are not used (this rule has none)."""

    def __init__(self, quant: dict, residual: int):
        super().__init__()
        self.quant, self.residual, self.length = quant, residual, 0
        self.stored = {}

    def _q(self, which: str, x: torch.Tensor) -> torch.Tensor:
        fq, ctx = self.quant[which]
        return fq.apply_all(x.contiguous(), ctx)

    def update(self, key_states, value_states, *args, **kwargs):
        self.length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.stored = {"keys": self._q("keys", key_states), "values": self._q("values", value_states)}
            return key_states, value_states
        keys = torch.cat([self.stored["keys"], self.keys, key_states], dim=-2)
        values = torch.cat([self.stored["values"], self.values, value_states], dim=-2)
        waiting = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if waiting + key_states.shape[-2] >= self.residual:
            self.stored = {"keys": self._q("keys", keys), "values": self._q("values", values)}
            self.keys = self.values = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return keys, values

    def get_seq_length(self) -> int:
        return self.length


def residual_requant_cache(model, scheme, residual: int) -> Cache:
    """A cache of `ResidualRequantLayer`s quantizing with `scheme`'s k_cache / v_cache configs."""
    return Cache(layers=[ResidualRequantLayer(q, residual) for q in _layer_quantizers(model, scheme, both=True)])


def decode_logits(model, ids: torch.Tensor, scheme, prompt: int, cache: Cache | None = None) -> torch.Tensor:
    """Logits of every position of `ids` [batch, T] computed the way a cache is used: the first `prompt`
    tokens in one forward, then one token per forward through `cache` (default: a write-once quantized
    cache of `scheme`)."""
    if not 1 <= prompt <= ids.shape[1]:
        raise DiffquantError(f"prompt length {prompt} must be within 1..{ids.shape[1]}")
    with no_autograd(model):
        cache = cache if cache is not None else write_once_cache(model, scheme)
        out = [model(ids[:, :prompt], cache=cache, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        return torch.cat(out, dim=1)


def decode_greedy(model, prompt_ids: torch.Tensor, scheme, new_tokens: int, cache: Cache | None = None) -> torch.Tensor:
    """Greedy continuation [batch, new_tokens] of `prompt_ids`, decoding through `cache` (default: a
    write-once quantized cache of `scheme`)."""
    with no_autograd(model):
        cache = cache if cache is not None else write_once_cache(model, scheme)
        logits = model(prompt_ids, cache=cache, use_cache=True).logits[:, -1]
        tokens = []
        for _ in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = model(nxt, cache=cache, use_cache=True).logits[:, -1]
        return torch.cat(tokens, dim=1)
