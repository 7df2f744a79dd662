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
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--load-in-4bit", action="store_true", help="a QLoRA adapter trained on the base in 4 bits: "
                      "merge into the base quantized and dequantized again (what the adapter was trained on)")
    held.add_argument("--load-in-8bit", action="store_true", help="the same for a base trained in int8 rows")
    parser.add_argument("--bnb-4bit-quant-type", default="nf4", choices=("nf4", "fp4"))
    parser.add_argument("--use-bnb-nested-quant", action="store_true", help="the base had double quantization")
    args = parser.parse_args(argv)

    from pagedrl.model.checkpoint import CheckpointError
    from pagedrl.model.merge import merge_adapter
    from pagedrl.model.quantized_linear import QuantizedBase

    quantized = None
    if args.load_in_4bit or args.load_in_8bit:
        quantized = QuantizedBase(4 if args.load_in_4bit else 8, args.bnb_4bit_quant_type, args.use_bnb_nested_quant)
    try:
        out = merge_adapter(args.base, args.adapter, args.out, revision=args.revision, quantized=quantized)
    except (CheckpointError, ValueError) as e:
        print(f"pagedrl merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {args.base}: {out}")
    return 0
