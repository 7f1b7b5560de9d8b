"""The files a model folder or file is made of, checked before a library reads them: a broken one is refused in
one line that names the file and what was expected (a GGUF's magic, a JSON document, a safetensors header), where the
library would raise `ValueError: cannot mmap an empty file` or a `JSONDecodeError` that names nothing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from diffquant.errors import DiffquantError

GGUF_MAGIC = b"GGUF"


def read_json(path: Path, expected: str) -> dict:
    """A JSON object from `path`; `expected` says what the file should be ("a transformers config.json")."""
    try:
        data = json.loads(Path(path).read_text("utf-8"))
    except UnicodeDecodeError:
        raise DiffquantError(f"{path} is not text: expected {expected} (JSON)") from None
    except json.JSONDecodeError as e:
        raise DiffquantError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): expected "
                             f"{expected}") from None
    if not isinstance(data, dict):
        raise DiffquantError(f"{path} holds a JSON {type(data).__name__}, not an object: expected {expected}")
    return data


def check_gguf(path: Path) -> None:
    """A file that starts with GGUF's magic bytes."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise DiffquantError(f"{path} is empty: expected a GGUF model file")
    if head != GGUF_MAGIC:
        raise DiffquantError(f"{path} is not a GGUF file: it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r}")


def check_safetensors(path: Path) -> None:
    """A file with a safetensors header: 8 bytes of little-endian header length, then that many bytes of JSON."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise DiffquantError(f"{path} is {'empty' if size == 0 else 'truncated'}: expected a safetensors file")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > size - 8:
            raise DiffquantError(f"{path} is truncated or not a safetensors file: its header claims {n:,} bytes, the "
                                 f"file has {size - 8:,} after it")
        try:
            json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise DiffquantError(f"{path} is not a safetensors file: its header is not JSON") from None


def check_folder(folder: Path) -> None:
    """Every file of a save_pretrained folder a loader reads first: config.json, the tokenizer's JSON files, the
    weights' safetensors headers and index, a diffquant scheme file."""
    folder = Path(folder)
    read_json(folder / "config.json", "a transformers config.json")
    for name, what in (("tokenizer.json", "a tokenizers tokenizer.json"), ("tokenizer_config.json",
                                                                              "a transformers tokenizer_config.json"),
                       ("model.safetensors.index.json", "a safetensors shard index"),
                       ("diffquant_scheme.json", "a scheme diffquant quantize saved")):
        if (folder / name).is_file():
            read_json(folder / name, what)
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights)
