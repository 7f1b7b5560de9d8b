"""Matched-pair training: the baseline and the DIFF model of a preset on identical data.

Both models see the same batches in the same order (a permutation of training windows fixed by the
seed), with the same schedule and token budget. The data order and the LR are functions of the step
alone, so `--resume` continues bit-exactly from the last checkpoint (weights in safetensors,
optimizer state beside them).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json, fix_modes
from diffquant.stats.distributed import barrier, rank_world

ARCHS = ("baseline", "diff")  # the default pair; any key of diffquant.designs trains
SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "tiny"
    corpus: str = "kjv"
    tokens: int = 1_000_000  # training tokens per model
    batch_size: int = 16
    seq_len: int | None = None  # default: the preset's
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.05
    schedule: str = "cosine"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's; Guo et al.'s Bigram-Backcopy recipe uses (0.9, 0.99)
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 0
    eval_every: int = 100
    eval_tokens: int = 32768
    save_every: int = 200
    archs: tuple[str, ...] = ARCHS
    needle_fraction: float = 0.0
    bos: bool = False  # text corpora: every window starts with the tokenizer's <|endoftext|> as BOS
    track: bool = False  # emergence snapshots (diffquant/track.py)
    track_points: int = 16
    track_sequences: int = 8
    track_metrics: str = ""  # the papers' metric sets in each snapshot, comma-separated (stats/metric_sets.py)

    def __post_init__(self) -> None:
        from diffquant.designs import DESIGNS

        if self.tokens <= 0:
            raise ValueError(f"tokens must be positive, got {self.tokens}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.batch_size <= 0 or self.lr <= 0:
            raise ValueError("batch_size and lr must be positive")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas) or self.grad_clip < 0:
            raise ValueError(f"betas must be two numbers in [0, 1) and grad_clip >= 0, got {self.betas}, {self.grad_clip}")
        if self.weight_decay < 0 or not 0 <= self.warmup_frac < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("weight_decay must be >= 0, warmup_frac in [0, 1), min_lr_ratio in [0, 1]")
        unknown = set(self.archs) - set(DESIGNS)
        if unknown or not self.archs or len(set(self.archs)) != len(self.archs):
            raise ValueError(f"architectures must be distinct names from: {', '.join(DESIGNS)} (got {list(self.archs)})")
        if not 0 <= self.needle_fraction < 1:
            raise ValueError("needle_fraction must be in [0, 1)")
        if self.track and (self.track_points < 2 or self.track_sequences < 1):
            raise ValueError("track needs track_points >= 2 and track_sequences >= 1")
        if self.track_metrics and not self.track:
            raise ValueError("track_metrics needs track (metric sets are computed in the tracking snapshots)")
        if self.track_metrics:
            from diffquant.stats.metric_sets import parse

            try:
                parse(self.track_metrics)
            except DiffquantError as e:
                raise ValueError(str(e)) from None


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warmup = max(1, int(cfg.warmup_frac * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.schedule == "constant":
        return cfg.lr
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay)


def batch_at(windows: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The step's batch: a seeded permutation per epoch, so any step can be recomputed on resume."""
    per_epoch = len(windows) // batch_size
    if per_epoch == 0:
        raise DiffquantError(f"the training split has {len(windows)} sequences, fewer than one batch of {batch_size}")
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(windows), generator=g)
    return windows[perm[i * batch_size:(i + 1) * batch_size]]


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)  # no decay on norms, biases, λ vectors
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def unigram_entropy(stream: np.ndarray) -> float:
    """Entropy (nats) of the token unigram distribution: the loss of a model that learned nothing else."""
    counts = np.bincount(stream)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclass
class Data:
    tokenizer: object
    train: torch.Tensor  # [n, seq_len] windows
    val: torch.Tensor
    sha256: str
    unigram_entropy: float
    meta: dict = field(default_factory=dict)

    @property
    def vocab(self) -> int | None:
        """The model vocabulary the data needs, where it is not the preset's (synthetic corpora)."""
        return self.meta.get("vocab")


def training_windows(cfg: TrainConfig, seq_len: int) -> int:
    """How many training windows the run consumes: steps × batch size."""
    return max(1, cfg.tokens // (cfg.batch_size * seq_len)) * cfg.batch_size


def prepare_data(cfg: TrainConfig, out: Path, cache: str | None = None) -> Data:
    """Train (or reuse) the tokenizer in out/tokenizer and cut the corpus into windows (synthetic corpora:
    generate exactly the windows the run needs, plus the validation ones)."""
    from transformers import AutoTokenizer

    from diffquant.data.corpora import load_text, sha256, split
    from diffquant.data.synthetic import is_synthetic
    from diffquant.data.tokens import encode, sequences, train_tokenizer
    from diffquant.data.windows import check_source
    from diffquant.models.presets import get_preset

    check_source(cfg.corpus)  # the corpus names every command accepts
    spec = get_preset(cfg.preset)
    seq_len = cfg.seq_len or spec.seq_len
    if is_synthetic(cfg.corpus):
        return _synthetic_data(cfg, out, seq_len)
    text, _ = load_text(cfg.corpus, cache)
    train_text, val_text = split(text)
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tokenizer = train_tokenizer(train_text, spec.vocab)
        tokenizer.save_pretrained(tok_dir)
    if cfg.needle_fraction > 0:
        from diffquant.data.needle import mix_needles

        train_text = mix_needles(train_text, cfg.needle_fraction, cfg.seed)
    train_ids = encode(tokenizer, train_text)
    val_ids = encode(tokenizer, val_text)
    if len(val_ids) < seq_len + 1:
        raise DiffquantError(f"the validation split has {len(val_ids)} tokens, fewer than one sequence of {seq_len}")
    if cfg.bos:  # windows of seq_len - 1 tokens behind a BOS
        bos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        cut = lambda ids, n=None: _with_bos(sequences(ids, seq_len - 1, n and n * (seq_len - 1) // seq_len), bos)  # noqa: E731
        train, val = cut(train_ids), cut(val_ids, cfg.eval_tokens)
    else:
        train, val = sequences(train_ids, seq_len), sequences(val_ids, seq_len, cfg.eval_tokens)
    return Data(tokenizer, train, val, sha256(text), unigram_entropy(train_ids),
                {"train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)), "seq_len": seq_len,
                 "val_windows": len(val), "bos": cfg.bos})


def _with_bos(windows: torch.Tensor, bos: int) -> torch.Tensor:
    return torch.cat([torch.full((len(windows), 1), bos, dtype=windows.dtype), windows], dim=1)


def _synthetic_data(cfg: TrainConfig, out: Path, seq_len: int) -> Data:
    import hashlib

    from diffquant.data import synthetic

    spec = synthetic.parse(cfg.corpus)
    tokenizer = synthetic.tokenizer(spec)
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        tokenizer.save_pretrained(tok_dir)
    train = torch.from_numpy(synthetic.sequences(spec, "train", training_windows(cfg, seq_len), seq_len))
    val = torch.from_numpy(synthetic.sequences(spec, "validation", max(1, cfg.eval_tokens // seq_len), seq_len))
    return Data(tokenizer, train, val, hashlib.sha256(spec.label().encode()).hexdigest(),
                unigram_entropy(train.flatten().numpy()),
                {"train_tokens": int(train.numel()), "val_tokens": int(val.numel()), "seq_len": seq_len,
                 "val_windows": len(val), "synthetic": spec.label(), "bos": True, "vocab": spec.vocab + 1})


PRECISIONS = ("auto", "fp32", "bf16")  # training's: weights and optimizer state stay fp32; bf16 autocasts the forward


def autocast_dtype(dtype: str, device: str):
    """The dtype the forward autocasts to (None: none): `auto` is bf16 on CUDA and fp32 elsewhere; `bf16` autocasts
    on the CPU too (its bfloat16 matmuls); fp16 is refused (it needs loss scaling, which training does not do)."""
    if dtype not in PRECISIONS:
        raise DiffquantError(f"training precision must be one of {', '.join(PRECISIONS)}, got {dtype!r}"
                             + (" (fp16 needs loss scaling)" if dtype == "fp16" else ""))
    if dtype == "bf16" or (dtype == "auto" and device.startswith("cuda")):
        return torch.bfloat16
    return None


def train_model(arch: str, cfg: TrainConfig, data: Data, out: Path, device: str = "cpu", resume: bool = False,
                progress: bool = True, stop_after: int | None = None, dtype: str = "auto") -> dict:
    """Train one model of the pair; checkpoints in out/<arch>. Returns its metrics. `dtype`: PRECISIONS."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from diffquant.evaluate import language_modeling
    from diffquant.pretrained import from_pretrained
    from diffquant.models.presets import get_preset

    spec = get_preset(cfg.preset)
    rank, world = rank_world()
    seq_len = data.train.shape[1]
    total = max(1, cfg.tokens // (cfg.batch_size * seq_len))
    if cfg.batch_size % world:
        raise DiffquantError(f"batch size {cfg.batch_size} must divide by the {world} ranks")
    ckpt = out / arch
    state_path = ckpt / "trainer_state.pt"
    metrics = {"arch": arch, "steps": total, "curve": [], "val": []}
    if resume and state_path.is_file():
        model = from_pretrained(ckpt, dtype=torch.float32)
        state = torch.load(state_path, weights_only=False)
        start = state["step"]
        metrics = state["metrics"]
        if start >= total and "tokens_per_s" in metrics:
            return metrics  # already finished
    else:
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(spec.config(arch, vocab=data.vocab, seq_len=seq_len))
        state, start = None, 0
    from diffquant.models.fused import fuse, layer_lambdas

    fuse(model)  # DIFF: one softmax per layer
    model.to(device).train()
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    ddp_model = model
    if world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    amp = autocast_dtype(dtype, device)
    track = _Tracker(cfg, data, total, metrics, device) if cfg.track else None
    if track:
        track(model, start)
    bar = tqdm(total=total, initial=start, desc=f"train {arch}", unit="step", disable=not progress or rank != 0)
    t0, tokens_done = time.perf_counter(), 0
    step = start
    for step in range(start, total):
        if stop_after is not None and step >= stop_after:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        batch = batch_at(data.train, step, cfg.batch_size, cfg.seed)
        batch = batch[rank * len(batch) // world:(rank + 1) * len(batch) // world].to(device)
        with torch.autocast(device.split(":")[0], dtype=amp or torch.float32, enabled=amp is not None):
            loss = ddp_model(batch, labels=batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tokens_done += batch.numel() * world
        if step % 10 == 0 or step == total - 1:
            tps = tokens_done / max(1e-9, time.perf_counter() - t0)
            point = {"step": step, "loss": float(loss.detach()), "lr": lr_at(step, total, cfg)}
            lams = layer_lambdas(model)  # DIFF's λ per layer after this step's update (differential designs)
            if lams is not None:
                point["lambda"] = lams
            metrics["curve"].append(point)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", tok_s=f"{tps:,.0f}")
        bar.update(1)
        done = step + 1
        if done % cfg.eval_every == 0 or done == total:
            model.eval()
            val = language_modeling(model, data.val.to(device))
            val.pop("per_sequence_loss")
            metrics["val"].append({"step": done, **val})
            model.train()
        if track:
            track(model, done)
        if rank == 0 and (done % cfg.save_every == 0 or done == total):
            _save(model, opt, data, ckpt, done, metrics)
        step = done
    bar.close()
    elapsed = time.perf_counter() - t0
    if track:
        metrics["track_seconds"] = metrics.get("track_seconds", 0.0) + track.seconds
    metrics["tokens_per_s"] = tokens_done / max(1e-9, elapsed) if tokens_done else metrics.get("tokens_per_s", 0.0)
    metrics["finished_step"] = step
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    if rank == 0 and step == total:
        _save_state(ckpt, opt, step, metrics)
    return metrics


class _Tracker:
    """Emergence snapshots at the planned steps, kept in the run's metrics (so checkpoints carry them)."""

    def __init__(self, cfg: TrainConfig, data: Data, total: int, metrics: dict, device: str):
        from diffquant.track import track_steps

        self.plan = set(track_steps(total, cfg.track_points))
        self.batch = data.val[:cfg.track_sequences].to(device)
        self.per_step = cfg.batch_size * data.train.shape[1]
        self.points = metrics.setdefault("emergence", [])
        self.metrics = cfg.track_metrics
        self.seconds = 0.0

    def __call__(self, model, step: int) -> None:
        from diffquant.track import snapshot

        if step not in self.plan or any(p["step"] == step for p in self.points):
            return
        t = time.perf_counter()
        self.points.append(snapshot(model, self.batch, step, step * self.per_step,
                                   tuple(n for n in self.metrics.split(",") if n)))
        self.seconds += time.perf_counter() - t


def _save_state(ckpt: Path, opt, step: int, metrics: dict) -> None:
    tmp = ckpt / "trainer_state.pt.tmp"
    torch.save({"step": step, "optimizer": opt.state_dict(), "metrics": metrics}, tmp)
    tmp.replace(ckpt / "trainer_state.pt")


def _save(model, opt, data: Data, ckpt: Path, step: int, metrics: dict) -> None:
    """Write the checkpoint into a temporary folder, then swap it in: a crash leaves the old one whole."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    data.tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": opt.state_dict(), "metrics": metrics}, tmp / "trainer_state.pt")
    fix_modes(tmp)
    old = ckpt.with_name(ckpt.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if ckpt.exists():
        ckpt.rename(old)
    tmp.rename(ckpt)
    shutil.rmtree(old, ignore_errors=True)


def environment_record(device: str) -> dict:
    import platform

    import transformers

    rev = None
    try:
        import subprocess

        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        pass
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": device, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "git_revision": rev}


def train_pair(cfg: TrainConfig, out: str | Path, device: str | None = None, resume: bool = False,
               force: bool = False, cache: str | None = None, progress: bool = True, figures: bool = True,
               dtype: str = "auto") -> dict:
    """Train every arch of `cfg` into out/<arch>; writes out/metrics.json and returns it. With `track`, also
    emergence.json and (`figures`) its plots; a caller that plots many runs together passes figures=False.
    `dtype` (PRECISIONS) is how the forward runs, like `device` a setting of the machine, recorded in the run's
    environment record."""
    out = Path(out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    autocast_dtype(dtype, device)  # refused before anything is written
    cfg_path = out / "train_config.json"
    exists = cfg_path.exists()
    barrier()  # every rank has looked before rank 0 writes the config (else a later rank finds it and refuses)
    if exists and not (resume or force):
        raise DiffquantError(f"{out} already holds a training run; pass --resume to continue it or --force to restart")
    saved_archs: tuple = ()
    if resume and cfg_path.exists():
        saved = json.loads(cfg_path.read_text())
        saved_archs = tuple(saved.pop("archs"))
        saved.setdefault("track_metrics", "")  # runs saved before metric sets existed
        saved.setdefault("betas", [0.9, 0.95])  # runs saved before betas was a setting used these
        if saved != {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "archs"}:
            raise DiffquantError(f"{out} was trained with other settings ({cfg_path}); resume with the same settings "
                                 "(designs may be added: every design trains on the same data independently)")
    if force and not resume:
        for arch in cfg.archs:
            shutil.rmtree(out / arch, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    rank, _ = rank_world()
    if rank == 0:
        atomic_write_json(cfg_path, asdict(cfg) | {"archs": list(dict.fromkeys(saved_archs + tuple(cfg.archs)))})
    data = prepare_data(cfg, out, cache)
    results = {"config": asdict(cfg), "data": {"corpus": cfg.corpus, "sha256": data.sha256,
                                               "unigram_entropy": data.unigram_entropy, **data.meta},
               "environment": environment_record(device) | {"precision": dtype}, "models": {}}
    metrics_path = out / "metrics.json"
    if metrics_path.exists() and resume:
        results["models"] = json.loads(metrics_path.read_text()).get("models", {})
    for arch in cfg.archs:
        m = train_model(arch, cfg, data, out, device, resume=resume, progress=progress, dtype=dtype)
        m["final_val"] = m["val"][-1] if m["val"] else None
        results["models"][arch] = m
        if rank == 0:
            atomic_write_json(metrics_path, results)
            if cfg.track:
                write_emergence(results, out, figures)
    return results


def write_emergence(results: dict, out: Path, figures: bool = True) -> None:
    """emergence.json (every snapshot of every model, with the run's scale) and its figures."""
    from diffquant.report.emergence_plots import plot_emergence
    from diffquant.report.style import display

    cfg = results["config"]
    doc = {"config": cfg, "data": results["data"],
           "scale": {display(a): {"parameters": m.get("parameters"), "tokens": m["emergence"][-1]["tokens"]}
                     for a, m in results["models"].items() if m.get("emergence")},
           "track_sequences": cfg["track_sequences"], "models": {display(a): m.get("emergence", [])
                                                                 for a, m in results["models"].items()}}
    atomic_write_json(out / "emergence.json", doc)
    if figures:
        plot_emergence(doc, out)
