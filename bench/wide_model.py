"""A model whose every projection llama.cpp stores as a K-quant: random weights (transformers' Llama, seeded)
in the default model's size class but with rows 1024 and 2816 wide (multiples of 256, as a 7B model's
are), the default model's tokenizer, converted by llama.cpp's own `convert_hf_to_gguf.py` to a bf16 GGUF
and quantized by `llama-quantize` to Q4_K_M (Q4_K and Q6_K throughout). The default model's 576-wide rows
fall back to Q5_0 in llama.cpp's Q4_K_M; this one shows the K-quant products themselves against llama.cpp.

    .venv/bin/python bench/wide_model.py [OUT_DIR]     # OUT_DIR/wide-q4_k_m.gguf (default: /work/.llama.cpp)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=True)


def wide_gguf(llama_cpp: Path) -> Path:
    """`llama_cpp`/wide-q4_k_m.gguf, made on first use (llama.cpp's sources and `llama-quantize` under
    `llama_cpp`/src, as `bench/llamacpp_env.sh` and `cmake --build build --target llama-quantize` leave them)."""
    target = llama_cpp / "wide-q4_k_m.gguf"
    if target.exists():
        return target
    tool = llama_cpp / "src" / "build" / "bin" / "llama-quantize"
    converter = llama_cpp / "src" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not tool.is_file() or not converter.is_file():
        raise SystemExit(f"the wide model needs {tool} and {converter}: run bench/llamacpp_env.sh, then "
                         "`cmake --build build --target llama-quantize` in its source folder")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedrl.model.resolve import resolve_model_path

    tokenizer_folder = resolve_model_path(None)
    with tempfile.TemporaryDirectory() as tmp:
        folder, stub = Path(tmp) / "wide", Path(tmp) / "stub"
        torch.manual_seed(0)
        vocab = LlamaConfig.from_pretrained(tokenizer_folder).vocab_size
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SHAPE))
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_folder / name).is_file():
                shutil.copy(tokenizer_folder / name, folder / name)
        stub.mkdir()
        (stub / "sentencepiece.py").write_text("class SentencePieceProcessor: ...\n")
        bf16 = Path(tmp) / "wide-bf16.gguf"
        subprocess.run([sys.executable, str(converter), str(folder), "--outtype", "bf16", "--outfile", str(bf16)],
                       check=True, capture_output=True, env={"PYTHONPATH": str(stub), "PATH": "/usr/bin:/bin"})
        partial = target.with_suffix(".part")
        subprocess.run([str(tool), str(bf16), str(partial), "Q4_K_M"], check=True, capture_output=True)
        partial.rename(target)
    return target


if __name__ == "__main__":
    print(wide_gguf(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work/.llama.cpp")))
