"""`diffquant data fetch|info NAME`."""

from __future__ import annotations

import json


def run_cli(args) -> None:
    from diffquant.data import corpora

    if args.action == "list":
        for c in corpora.CORPORA.values():
            print(f"{c.name:<10} {c.about} (Debian: {', '.join(c.packages)})")
        print(f"{'debian-mix':<10} all of the above")
        return
    if args.action == "fetch":
        path = corpora.fetch(args.name, args.cache_dir)
        print(f"{args.name}: {path}")
        return
    info = corpora.info(args.name, args.cache_dir)
    if args.tokenizer:
        from transformers import AutoTokenizer

        from diffquant.data.tokens import encode

        text, _ = corpora.load_text(args.name, args.cache_dir)
        info["tokens"] = int(len(encode(AutoTokenizer.from_pretrained(args.tokenizer), text)))
    print(json.dumps(info, indent=2))
