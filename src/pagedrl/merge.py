"""`pagedrl merge BASE ADAPTER OUT`: fold a LoRA adapter into its base and write one Hugging Face
folder (what transformers, vLLM and `pagedrl serve` load without knowing about adapters)."""

from __future__ import annotations

import argparse
import sys


def merge_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl merge", description="Merge a LoRA adapter into its base model.")
    parser.add_argument("base", help="the base model: a Hugging Face folder or Hub id, .gguf file or "
                                     "'smollm2-135m-instruct'")
    parser.add_argument("adapter", help="the adapter folder or Hub id (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("out", help="the merged model's folder (replaced if it exists)")
    parser.add_argument("--revision", default=None, help="the branch, tag or commit of a Hub id BASE")
    args = parser.parse_args(argv)

    from pagedrl.model.checkpoint import CheckpointError
    from pagedrl.model.merge import merge_adapter

    try:
        out = merge_adapter(args.base, args.adapter, args.out, revision=args.revision)
    except (CheckpointError, ValueError) as e:
        print(f"pagedrl merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {args.base}: {out}")
    return 0
