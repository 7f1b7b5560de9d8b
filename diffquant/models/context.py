"""How many positions a model is built for, read without loading it (so a too-long window is refused in
well under a second, before torch loads): a preset's context, a saved folder's config.json, a GGUF's
metadata. None where it cannot be known without loading (hub ids, zoo models not fetched yet)."""

from __future__ import annotations

from pathlib import Path

from diffquant.models.files import check_gguf, read_json

CONFIG_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(source: str, cache: str | None = None) -> tuple[int | None, str]:
    """(positions, where that number comes from) for a model source as `load_model` takes it."""
    from diffquant.models.presets import PRESETS
    from diffquant.models.zoo import ZOO

    name, _, arch = source.partition(":")
    if name in PRESETS and arch:
        return PRESETS[name].context, f"the {name} preset's max_position_embeddings"
    if source in ZOO:
        from diffquant.paths import cache_dir

        cached = cache_dir(cache) / "zoo" / source / Path(ZOO[source].member).name
        return (_gguf_context(cached), "its GGUF's context_length") if cached.is_file() else (None, "")
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        check_gguf(path)
        return _gguf_context(path), "its GGUF's context_length"
    if (path / "config.json").is_file():
        config = read_json(path / "config.json", "a transformers config.json")
        config = config.get("text_config", config)
        for key in CONFIG_KEYS:
            if isinstance(config.get(key), int):
                return config[key], f"config.json's {key}"
    scheme = path / "diffquant_scheme.json"
    if scheme.is_file():  # a simulated scheme saved without weights: the model it names
        source = read_json(scheme, "a scheme diffquant quantize saved").get("source")
        if isinstance(source, str):
            return context_length(source, cache)
    return None, ""


def _gguf_context(path: Path) -> int | None:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        return None
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    field = reader.get_field(f"{arch}.context_length")
    return int(field.parts[field.data[0]][0]) if field is not None else None
