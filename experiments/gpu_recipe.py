"""GPU recipe: on one GPU, train the `small` matched pair token-matched with outlier tracking (`train --track`:
emergence.json and curves), profile both (Table 5 analog, sinks) and run the Figure 8 sweep, all under one folder,
within `--minutes` (10), offline: the corpus is generated Bigram-Backcopy (Guo et al. 2024, diffquant's
`synth:bb`: the task that makes attention sinks and massive activations in small transformers), so nothing is
downloaded and no tokenizer is trained. Before it trains, it measures on the machine the training rate of both
designs and the cost of a tracking snapshot, a checkpoint and a profiled forward, prints the estimated time, and
refuses a plan that will not fit the minutes (`--train-tokens` lowers it). `--corpus` takes any corpus name
instead (a Debian one needs the network once). `--quick` runs the same pipeline on CPU with tiny budgets (the test
suite runs it with networking disabled).

    python -m experiments.gpu_recipe --out runs/gpu        # on a GPU
    python -m experiments.gpu_recipe --quick --out /tmp/g  # anywhere
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Settings:
    preset: str = "small"  # width 512, 8 layers, 512-token windows: 25.4M parameters on 66 symbols (paper: 3B)
    corpus: str = "synth:bb:vocab=65,triggers=3"  # Guo et al.'s (65 symbols, 3 triggers), as fair_rivals' small-bb
    train_tokens: int = 20_000_000  # per model; checked against the measured rate before training
    batch_size: int = 64  # x 512 tokens = 32K tokens per step
    lr: float = 2e-3
    profile_tokens: int = 262_144
    eval_tokens: int = 65_536
    bits: list[int] = field(default_factory=lambda: [16, 8, 6, 4])
    granularity: list[str] = field(default_factory=lambda: ["tensor", "head", "token"])
    seeds: list[int] = field(default_factory=lambda: [0])
    minutes: float = 10.0  # the whole recipe, start-up included


QUICK = dict(preset="micro", corpus="synth:bb:vocab=32", train_tokens=8192, batch_size=8, profile_tokens=512,
             eval_tokens=512, granularity=["tensor"])
TRACK_POINTS, SAVE_EVERY, EVAL_EVERY, TRAIN_EVAL_TOKENS = 16, 200, 100, 32768  # what trained_pairs asks of train


def main(argv=None) -> None:
    t0 = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/gpu")
    p.add_argument("--pairs", default=None, help="folder of trained pairs, reused when their settings match (default: OUT/pairs)")
    p.add_argument("--corpus", default=None, help="the corpus to train on (default: generated Bigram-Backcopy)")
    p.add_argument("--train-tokens", type=int, default=None, help="training tokens per model")
    p.add_argument("--minutes", type=float, default=None, help="the time the recipe must fit (default 10)")
    a = p.parse_args(argv)
    s = Settings(**QUICK) if a.quick else Settings()
    for key in ("corpus", "train_tokens", "minutes"):
        if getattr(a, key) is not None:
            setattr(s, key, getattr(a, key))
    run(s, Path(a.out), Path(a.pairs) if a.pairs else None, t0)


def estimate(s: Settings, dev: str) -> tuple[dict[str, float], float]:
    """({part: seconds}, seconds per training token) of the whole recipe, from rates measured here: both designs'
    training steps, a tracking snapshot, a checkpoint write and a profiled forward (profile, the sweep's quantized
    evaluations and train's periodic held-out losses are charged at the profiled rate, an upper bound)."""
    import tempfile

    import torch

    import diffquant as dq
    from diffquant.lab import build_cells, build_model, fuse, get_preset, is_synthetic, snapshot, synthetic_spec
    from experiments.pairs import seconds, train_rate

    spec = get_preset(s.preset)
    vocab = synthetic_spec(s.corpus).vocab + 1 if is_synthetic(s.corpus) else None
    rates = [train_rate(s.preset, arch, s.batch_size, spec.seq_len, vocab, dev) for arch in ("baseline", "diff")]
    model = build_model(spec, "diff", vocab=vocab, seq_len=spec.seq_len).to(dev).eval()
    fuse(model)
    ids = torch.randint(0, vocab or spec.vocab, (8, spec.seq_len), device=dev)
    snap = seconds(lambda: snapshot(model, ids, 0, 0), dev)
    forward = ids.numel() / seconds(lambda: dq.profile(model, ids, batch_size=8, sinks=True), dev)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        save = seconds(lambda: (model.save_pretrained(tmp), torch.save(opt.state_dict(), f"{tmp}/state.pt")), dev)
    step_tokens = s.batch_size * spec.seq_len
    per_token = sum(1 / r for r in rates) + 2 * (save / SAVE_EVERY + TRAIN_EVAL_TOKENS / forward / EVAL_EVERY) / step_tokens
    cells = len(build_cells(["Transformer", "DIFF"], ["attn_logits"], s.bits, s.granularity, None, None, {}))
    parts = {"training": sum(s.train_tokens / r for r in rates),
             "checkpoints": 2 * save * (s.train_tokens // step_tokens // SAVE_EVERY + 1),
             "held-out losses": 2 * TRAIN_EVAL_TOKENS / forward * (s.train_tokens // step_tokens // EVAL_EVERY + 1),
             "tracking": 2 * (TRACK_POINTS + 2) * snap, "profile": 2 * s.profile_tokens / forward,
             "sweep": cells * s.eval_tokens / forward}
    return parts, per_token


def run(s: Settings, out: Path, pairs: Path | None = None, t0: float | None = None) -> None:
    from experiments.pairs import device, fit_or_refuse, trained_pairs

    import diffquant as dq
    from diffquant.lab import (Evaluator, atomic_write_json, build_cells, get_preset, plot_emergence, run_cells,
                               start_run, summary_table, write_report)

    t0 = time.perf_counter() if t0 is None else t0
    dev = device()
    out = start_run(out, s, dev)
    parts, per_token = estimate(s, dev)
    left = max(0.0, s.minutes * 60 - (time.perf_counter() - t0))
    fits = int((left - sum(parts.values()) + s.train_tokens * per_token) / per_token)
    fit_or_refuse(parts, left / 60, f"gpu_recipe ({s.preset}, {s.train_tokens:,} tokens per model, {dev})",
                  f"lower --train-tokens (about {max(0, fits):,} fit) or allow more --minutes")
    atomic_write_json(out / "estimate.json", {"seconds": parts, "minutes_left": left / 60})
    t_train = time.perf_counter()
    folder = trained_pairs(s.preset, s.corpus, s.train_tokens, s.seeds[:1], pairs or out / "pairs", batch_size=s.batch_size,
                           lr=s.lr, track=True)[0]
    t_train = time.perf_counter() - t_train
    (out / "emergence").mkdir(exist_ok=True)
    plot_emergence(json.loads((folder / "emergence.json").read_text()), out / "emergence")
    models = dq.load_pair(folder, designs=("baseline", "diff"), device=dev)
    tokenizer = models["DIFF"][1]
    seq_len = get_preset(s.preset).seq_len
    windows = lambda tokens: dq.windows(s.corpus, tokenizer, split="validation", seq_len=seq_len,  # noqa: E731
                                        tokens=tokens)
    profiles = [dq.profile(m, windows(s.profile_tokens), label=label, batch_size=32, sinks=True, progress=True)
                for label, (m, _) in models.items()]
    write_report(profiles, out / "profile")
    evalset = windows(s.eval_tokens)
    evaluators = {label: Evaluator(["ppl"], evalset, t, "", {}) for label, (_, t) in models.items()}
    cells = build_cells(list(models), ["attn_logits"], s.bits, s.granularity, None, None, {})
    (out / "fig8").mkdir(exist_ok=True)
    rows = run_cells(models, cells, evaluators, out / "fig8")
    dq.plot_sweep(rows, out / "fig8")
    total = time.perf_counter() - t0
    atomic_write_json(out / "timing.json", {"train_s": t_train, "total_s": total, "estimate_s": parts})
    print((out / "profile" / "table5.md").read_text())
    print(summary_table(rows))
    print(f"total {total:.0f} s (estimated {sum(parts.values()):.0f} s after start-up); everything under {out}")


if __name__ == "__main__":
    import diffquant as dq

    try:
        main()
    except dq.DiffquantError as err:  # one line, not a traceback
        raise SystemExit(f"gpu_recipe: {err}") from None
