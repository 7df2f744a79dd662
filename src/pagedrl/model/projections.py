"""The names of a decoder layer's projections, the layers LoRA wraps ("all-linear" means these, never an
output head) and a quantized base holds quantized: the Llama layout's seven, Phi-3's fused `qkv_proj` and
`gate_up_proj` (`model/fused.py`; PEFT names no default there), and latent attention's `q_a_proj` …
`kv_b_proj` (DeepSeek-V3's, `model/mla.py`). One list for both, in one module below both."""

LAYER_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "k_proj", "v_proj",
                     "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
