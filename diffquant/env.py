"""`diffquant env`: what a bug report needs."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform

PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "accelerate", "numpy", "gguf", "matplotlib",
            "bitsandbytes", "torchao", "optimum-quanto", "flash-attn", "lm-eval", "datasets"]


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def environment() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "threads": torch.get_num_threads(),
    }
    info["attention"] = attention_implementations()
    from diffquant.quant.checkpoints.backends import backend_status

    info["backends"] = backend_status()
    return info


def attention_implementations() -> dict[str, bool]:
    import torch

    import diffquant.taps.attention  # noqa: F401  (registers "diffquant")
    from transformers import AttentionInterface

    usable = {"eager": True, "sdpa": hasattr(torch.nn.functional, "scaled_dot_product_attention")}
    usable["flash_attention_2"] = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    usable["diffquant"] = "diffquant" in AttentionInterface._global_mapping
    return usable


def format_environment(info: dict) -> str:
    lines = [f"python       {info['python']} ({info['platform']})"]
    for name, version in info["packages"].items():
        lines.append(f"{name:<12} {version or '-'}")
    lines.append(f"device       {', '.join(info['devices']) or 'cpu'} ({info['threads']} CPU threads)")
    lines.append("attention    " + ", ".join(f"{k}{'' if v else ' (no)'}" for k, v in info["attention"].items()))
    for name, status in info["backends"].items():
        lines.append(f"backend      {name}: {status}")
    return "\n".join(lines)
