"""What QLoRA's quantized base holds for a 0.5B-class model: Qwen2.5-0.5B's shape (random weights, as
its layout is what counts), float32 against `load_in_4bit` (NF4, with and without double quantization)
and `load_in_8bit`, the decoder projections quantized as the trainers quantize them and the tied
embedding left float, as transformers leaves it.

    .venv/bin/python bench/qlora_weight_share.py
"""
import torch

from pagedrl.engine.engine_stats import model_bytes
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.quantized_linear import QuantizedBase, quantize_projections

QWEN25_05B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
           max_position_embeddings=32768, rms_norm_eps=1e-6)


def main() -> None:
    torch.manual_seed(0)
    for spec in (None, QuantizedBase(4), QuantizedBase(4, nested=True), QuantizedBase(8)):
        m = CausalLM(ModelConfig.from_dict(QWEN25_05B))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        total = model_bytes(m)
        proj = sum(mod.weight.numel() * 4 + (mod.bias.numel() * 4 if mod.bias is not None else 0)
                   for n, mod in m.named_modules() if n.startswith("model.layers") and isinstance(mod, torch.nn.Linear))
        if spec is not None:
            quantize_projections(m, spec)
        after = model_bytes(m)
        print(f"{'float32' if spec is None else spec.field + (' nested' if spec.nested else '')}: model {after/2**20:.0f} MiB "
              f"(float32 {total/2**20:.0f} MiB; projections float32 {proj/2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
