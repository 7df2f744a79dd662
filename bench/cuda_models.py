"""The model folder `cuda_check.py` runs its throughput, decode-step and GRPO parts on: the default
model where its package is installed, else a SmolLM2-135M-shaped stand-in; random weights written
beside a folder that has none (with `ignore_eos` the work is the same as with real weights)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                    hidden_act="silu")


def model_dir(given: Path | None, log: Callable[[str, str], None]) -> Path:
    """A folder with config, tokenizer, chat template and weights (random ones written if missing)."""
    if given is None:
        try:
            from pagedrl.model.default import resolve_default_model

            given = resolve_default_model()
        except Exception as exc:  # the default model's package is not on this machine
            log("models", f"default model unavailable ({exc}); a SmolLM2-135M-shaped stand-in is written")
            given = stand_in_dir()
    if (given / "model.safetensors").exists() or (given / "model.safetensors.index.json").exists():
        return given
    out = Path(tempfile.gettempdir()) / f"pagedrl-random-{given.name}"
    if (out / "model.safetensors").exists():
        return out
    from pagedrl.model.checkpoint import save_checkpoint
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(json.loads((given / "config.json").read_text())))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return save_checkpoint(model, out, tokenizer_dir=given)


def stand_in_dir() -> Path:
    """SmolLM2-135M's shape with the tests' byte-level tokenizer, padded with added tokens to 49152."""
    from tiny_train import build_tokenizer
    from tokenizers import Tokenizer

    folder = Path(tempfile.gettempdir()) / "pagedrl-smollm2-135m-shape"
    if (folder / "config.json").exists():
        return folder
    build_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([f"<t{i}>" for i in range(SMOLLM2_135M["vocab_size"] - tok.get_vocab_size())])
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    config = dict(SMOLLM2_135M, bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|pad|>"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
