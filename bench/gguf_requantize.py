"""A GGUF file with its quantized tensors requantized to another GGML type (its float tensors, metadata
and tokenizer as they are): the default model's Q4_1 weights as Q8_0, so pagedrl and llama.cpp can be
compared on a second quant type read from one file. Requantizing from Q4_1 keeps Q4_1's rounding (the
values are then exactly representable in Q8_0 only up to Q8_0's own rounding); for a speed comparison
the file's size and layout are what count.

    .venv/bin/python bench/gguf_requantize.py IN.gguf OUT.gguf [--type Q8_0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def requantize(source: Path, target: Path, type_name: str) -> Path:
    """Write `target`: `source` with every quantized tensor requantized to `type_name` (written whole, then
    renamed into place)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    partial = target.with_suffix(".part")
    writer = gguf.GGUFWriter(str(partial), arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.tensor_type in FLOAT_TYPES:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        shape = [int(d) for d in reversed(t.shape)]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("target", type=Path)
    ap.add_argument("--type", default="Q8_0")
    args = ap.parse_args()
    print(requantize(args.source, args.target, args.type))


if __name__ == "__main__":
    main()
