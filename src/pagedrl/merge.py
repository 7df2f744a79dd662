"""`pagedrl merge BASE ADAPTER OUT`: fold a LoRA adapter into its base and write one Hugging Face
folder (what transformers, vLLM and `pagedrl serve` load without knowing about adapters)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def out_refused(out: Path, sources: list[Path]) -> str | None:
    """Why OUT may not be written (None: it may): replacing it must never take the base, the adapter or
    a folder that is not a model (someone's files) with it."""
    target = out.resolve()
    for source in sources:
        if source.exists() and (target == source.resolve() or source.resolve() in target.parents
                                or target in source.resolve().parents):
            return f"is or holds {source}, which the merge reads; choose another folder"
    if target.exists() and not (target.is_dir() and (target / "config.json").is_file()):
        return "exists and is not a model folder (no config.json); choose another folder or remove it"
    return None


def merge_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl merge", description="Merge a LoRA adapter into its base model.")
    parser.add_argument("base", help="the base model: a Hugging Face folder or Hub id, .gguf file or "
                                     "'smollm2-135m-instruct'")
    parser.add_argument("adapter", help="the adapter folder or Hub id (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("out", help="the merged model's folder (an existing model folder there is replaced; "
                                    "any other folder, the base or the adapter is refused)")
    parser.add_argument("--revision", default=None, help="the branch, tag or commit of a Hub id BASE")
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--load-in-4bit", action="store_true", help="a QLoRA adapter trained on the base in 4 bits: "
                      "merge into the base quantized and dequantized again (what the adapter was trained on)")
    held.add_argument("--load-in-8bit", action="store_true", help="the same for a base trained in int8 rows")
    parser.add_argument("--bnb-4bit-quant-type", default=None, choices=("nf4", "fp4"),
                        help="as the run set it; unset: nf4, and a GGUF base's projections of at most 4 bits kept "
                        "in the file's own blocks, as the trainers keep them")
    parser.add_argument("--use-bnb-nested-quant", action="store_true", help="the base had double quantization")
    args = parser.parse_args(argv)

    from pagedrl.model.checkpoint import CheckpointError
    from pagedrl.model.merge import merge_adapter
    from pagedrl.model.quantized_linear import QuantizedBase

    refused = out_refused(Path(args.out), [Path(args.base), Path(args.adapter)])
    if refused:
        print(f"pagedrl merge: OUT {args.out}: {refused}", file=sys.stderr)
        return 2
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
