"""`diffquant env`, `models` and `sites`: what this machine, the presets and a model's sites are."""

from __future__ import annotations


def env(args) -> None:
    from diffquant.env import environment, format_environment

    info = environment()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        print(format_environment(info))


def models(args) -> None:
    from diffquant.designs import DESIGNS
    from diffquant.models.presets import PRESETS
    from diffquant.models.zoo import ZOO

    archs = list(DESIGNS)
    print(f"{'preset':<7} {'hidden':>6} {'layers':>6} {'heads':>5} {'ffn':>5} {'vocab':>6} {'seq':>5}  "
          + "  ".join(f"{DESIGNS[a].display:>21}" for a in archs))
    for name, spec in PRESETS.items():
        base = spec.parameters("baseline")
        cells = [f"{spec.parameters(a):,}" + ("" if a == "baseline" else
                                              f" ({100 * (spec.parameters(a) - base) / base:+.3f}%)") for a in archs]
        heads = f"{spec.heads_of('baseline')}/{spec.heads_of('diff') // 2}"  # DIFF's config counts softmax maps
        print(f"{name:<7} {spec.hidden:>6} {spec.layers:>6} {heads:>5} {spec.ffn:>5} {spec.vocab:>6} "
              f"{spec.seq_len:>5}  " + "  ".join(f"{c:>21}" for c in cells))
    print("\n'heads' = attention heads per layer: softmax heads / DIFF's differential heads (two maps each).")
    print("designs (diffquant train --design KEY):")
    for a in archs:
        print(f"  {a:<12} {DESIGNS[a].display:<12} {DESIGNS[a].doc}")
    print("zoo (offline, from package registries):")
    for entry in ZOO.values():
        print(f"  {entry.name:<14} {entry.display}: {entry.note} (also: {', '.join(entry.aliases)})")


def sites(args) -> None:
    from diffquant.taps.sites import site_docs

    if args.model is None:
        for point, shape, doc in site_docs():
            print(f"{point:<16} {shape:<34} {doc}")
        return
    from diffquant.models.load import load_model
    from diffquant.quant.numerics.scheme import SCHEME_PRESETS, applies
    from diffquant.taps import site_table

    from diffquant.models.placement import resolve_device

    model, _ = load_model(args.model, dtype=args.dtype, device=resolve_device(args.device), hub=args.hub)
    table = site_table(model)
    sites = table.match(args.select) if args.select else list(table)
    for site in sites:
        note = " (MoE router: left in float by wildcard weight patterns)" if site.router else ""
        print(f"{site.name:<44} [{', '.join(site.dims)}]{note}")
    ok = [name for name, scheme in SCHEME_PRESETS.items() if applies(model, scheme) is None]
    print(f"\nscheme presets that apply to {type(model).__name__}: {', '.join(ok)}")
    for name, scheme in SCHEME_PRESETS.items():
        if name not in ok:
            print(f"  not {name}: {applies(model, scheme).split('. ')[0]}")
