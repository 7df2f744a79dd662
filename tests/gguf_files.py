"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from random transformers
models (its names, its q/k permutation in `llama` files, stacked experts, LongRoPE's factor tensors, Gemma's
norms stored as 1 + w and its metadata, a byte-level vocabulary with specials or a caller's own), for the
GGUF tests; and the float32 bound their
converted models are held to."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import decoder_bound
import gguf
import numpy as np
import torch
from test_gguf_linear import SCALE_OFFSETS, random_blocks
from tiny import BASE, freq_error
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIALS = ["<|begin|>", "<|end|>", "<|eot|>"]
USER_DEFINED = ["<think>"]
MERGES = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "i n", "Ġ in", "1 2"]
TOKENS = SPECIALS + USER_DEFINED + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
TEMPLATE = "{% for m in messages %}<|begin|>{{ m['role'] }}\n{{ m['content'] }}<|end|>{% endfor %}"
TINY = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=len(TOKENS),
            num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
              "mlp.experts.down_proj": "ffn_down_exps", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Gemma's sandwich norms (its `ffn_norm` is the one before the feed-forward, Llama's the one after attention)
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA = ("gemma2", "gemma3")
QUANTIZED = ("ffn_up", "ffn_down")  # Q8_0, so the dequantisation path is exercised too


def gguf_name(hf: str, arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, *rest = hf.split(".")
    if rest[-1] in ("gate_up_proj", "down_proj"):  # a mixture of experts' stacked experts (no `.weight`)
        rest.append("weight")
    module = ".".join(rest[:-1])
    return f"blk.{layer}.{(GEMMA_NAMES if arch in GEMMA and module in GEMMA_NAMES else GGUF_NAMES)[module]}.{rest[-1]}"


def llama_cpp_tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, as its converter lays them out: q/k rows permuted in
    `llama` (its `LlamaModel.permute`; Qwen's heads rotate in halves there, unpermuted), a mixture of
    experts' experts stacked [experts, rows, columns] per projection (`ffn_gate_exps`, `ffn_up_exps`,
    `ffn_down_exps`, as its `Qwen2MoeModel` stacks them); Gemma's norms plus one and its tied head left out
    (its `Gemma2Model` / `Gemma3Model`); gpt-oss's as its `GptOssModel` splits them (`gpt_oss_tensors`)."""
    cfg = model.config
    if arch == "gpt-oss":
        return gpt_oss_tensors(model)
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        data = p.detach().numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = gguf_name(name.replace("gate_up_proj", "down_proj")).removesuffix("down_exps.weight")
            gate, up = np.split(data, 2, axis=1)
            out[stem + "gate_exps.weight"], out[stem + "up_exps.weight"] = np.ascontiguousarray(gate), np.ascontiguousarray(up)
            continue
        if arch in GEMMA and name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        target = gguf_name(name, arch)
        if arch in GEMMA and target.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if arch == "llama" and ".attn_q." in target:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in target:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        out[target] = data
    return out


def gpt_oss_tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """gpt-oss under llama.cpp's names: the sinks as `attn_sinks`, the router as `ffn_gate_inp`, the norm
    before the experts as `post_attention_norm`, the interleaved `gate_up_proj` [E, H, 2I] and its bias split
    into `ffn_gate_exps` and `ffn_up_exps` ([E, I, H]: rows are outputs), `down_proj` [E, I, H] transposed."""
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        data = p.detach().numpy().astype(np.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is None:
            out[gguf_name(name)] = data
        elif name.endswith("self_attn.sinks"):
            out[f"blk.{layer}.attn_sinks.weight"] = data
        elif ".mlp.router." in name:
            out[f"blk.{layer}.ffn_gate_inp.{name.rsplit('.', 1)[1]}"] = data
        elif name.endswith("post_attention_layernorm.weight"):
            out[f"blk.{layer}.post_attention_norm.weight"] = data
        elif name.endswith("experts.gate_up_proj"):
            for proj, start in (("gate", 0), ("up", 1)):
                out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.ascontiguousarray(data[:, :, start::2].transpose(0, 2, 1))
        elif name.endswith("experts.gate_up_proj_bias"):
            out[f"blk.{layer}.ffn_gate_exps.bias"], out[f"blk.{layer}.ffn_up_exps.bias"] = data[:, 0::2], data[:, 1::2]
        elif name.endswith("experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = np.ascontiguousarray(data.transpose(0, 2, 1))
        elif name.endswith("experts.down_proj_bias"):
            out[f"blk.{layer}.ffn_down_exps.bias"] = data
        else:
            out[gguf_name(name)] = data
    return out


def write_tiny_gguf(path: Path, model: torch.nn.Module, *, arch: str = "llama", pre: str = "llama-bpe",
                    tokenizer_model: str = "gpt2", add_bos: bool | None = True,
                    types: dict[str, gguf.GGMLQuantizationType] | None = None,
                    vocabulary: Callable[[gguf.GGUFWriter], None] | None = None, pad_token_id: int | None = None,
                    kv_b_split: bool = True) -> Path:
    """`model` as llama.cpp would write it; `types` (default: ffn_up and ffn_down in Q8_0) maps tensor
    kinds (attn_q, token_embd, ...) or single tensors (blk.1.ffn_down) to the GGML types they are stored in,
    the rest float32; `kv_b_split` false writes a `deepseek2` file as llama.cpp's converter did before it
    split `kv_b_proj`. gguf's numpy code has no K-quant quantizer: K-quant tensors are random blocks with
    small scales (the file's weights are then those blocks' values, which is all a test of loading them
    needs)."""
    types = {q: gguf.GGMLQuantizationType.Q8_0 for q in QUANTIZED} if types is None else types
    rng = np.random.default_rng(0)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "deepseek2":
        deepseek_metadata(w, cfg, kv_b_split)
    else:
        _sizes_metadata(w, cfg, arch)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model(tokenizer_model)
    if vocabulary is not None:  # the caller's tokens, types, scores and ids
        vocabulary(w)
    else:
        w.add_tokenizer_pre(pre)
        w.add_token_list(TOKENS)
        w.add_token_types([3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [1] * (len(TOKENS) - 4))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_eot_token_id(2)
    if pad_token_id is not None:
        w.add_pad_token_id(pad_token_id)
    if add_bos is not None:  # None: the key left out, as older converters did
        w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    tensors = deepseek_tensors(model, kv_b_split) if arch == "deepseek2" else llama_cpp_tensors(model, arch)
    for target, data in tensors.items():
        kind = target.split(".")[-2]
        qtype = types.get(target.removesuffix(".weight"), types.get(kind))  # one tensor's own, or its kind's
        if target.endswith(".weight") and qtype is not None:
            try:
                blocks = gguf.quants.quantize(data, qtype)
            except NotImplementedError:
                values = gguf.constants.GGML_QUANT_SIZES[qtype][0]
                blocks = random_blocks(qtype, data.shape[0], data.shape[1] // values, rng, edges=False)
                assert data.ndim == 2, "random K-quant blocks for 2-D tensors only"
                _scale_to(blocks, qtype, float(np.abs(data).max()))
            w.add_tensor(target, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(target, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _scale_to(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType, largest: float) -> None:
    """Random blocks' half scales multiplied (in place) so that their largest value is about `largest` (the
    weight's they stand for): the model's activations keep the sizes of the weights it was made with."""
    values = gguf.quants.dequantize(blocks, qtype)
    factor = largest / max(float(np.abs(values).max()), 1e-30)
    raw = blocks.reshape(blocks.shape[0], -1, gguf.constants.GGML_QUANT_SIZES[qtype][1])
    for offset in SCALE_OFFSETS[qtype]:
        halves = raw[:, :, offset:offset + 2].copy().view(np.float16).astype(np.float32) * factor
        raw[:, :, offset:offset + 2] = halves.astype(np.float16).view(np.uint8)


def _sizes_metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    """The rest of the sizes, rotary fields and experts, as `TextModel` and the family's class write them."""
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters or {}
    if arch in GEMMA:
        gemma_metadata(w, cfg, arch)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor")
                                                   or getattr(cfg, "partial_rotary_factor", None) or 1.0)))
    if rope.get("rope_type") == "longrope":  # Phi-3 128k: the factors as tensors, as llama.cpp writes them
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if head_dim != cfg.hidden_size // cfg.num_attention_heads and arch not in GEMMA:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gpt-oss":  # (its `GptOssModel`: the window, the experts' width, YaRN through `TextModel`)
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(cfg, "num_experts", None) or arch == "gpt-oss":
        w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):  # (Mixtral's experts are of intermediate_size)
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def deepseek_metadata(w: gguf.GGUFWriter, cfg, kv_b_split: bool) -> None:
    """What llama.cpp's `DeepseekV2Model` writes beyond `TextModel`'s sizes: one KV head (MLA as MQA), the
    latent ranks and head sizes, the experts, groups and routing rule, the dense first layers, YaRN's
    log multiplier as 0.1 x mscale_all_dim; before the split, the whole head's key and value sizes."""
    rope = cfg.rope_parameters
    w.add_head_count_kv(1 if kv_b_split else cfg.num_attention_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if kv_b_split:
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)


DEEPSEEK_NAMES = {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                  "self_attn.q_b_proj": "attn_q_b", "self_attn.q_proj": "attn_q",
                  "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
                  "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
                  "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                  "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def deepseek_tensors(model: torch.nn.Module, kv_b_split: bool) -> dict[str, np.ndarray]:
    """DeepSeek-V3 under llama.cpp's names, as its `DeepseekV2Model` writes them: the experts stacked, the
    correction bias as `exp_probs_b.bias`, the shared experts as `ffn_*_shexp`, and `kv_b_proj` cut per head
    into its key rows, transposed (`attn_k_b` [heads, rank, nope]), and its value rows (`attn_v_b`)."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        data = p.detach().numpy().astype(np.float32)
        parts = name.split(".")
        if not name.startswith("model.layers."):
            out[gguf_name(name)] = data
            continue
        layer, module = parts[2], ".".join(parts[3:-1])
        if name.endswith("mlp.gate.e_score_correction_bias"):
            out[f"blk.{layer}.exp_probs_b.bias"] = data
        elif name.endswith("experts.gate_up_proj"):
            gate, up = np.split(data, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate.copy(), up.copy()
        elif name.endswith("experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = data
        elif module == "self_attn.kv_b_proj" and kv_b_split:
            kv_b = data.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim:])
        elif module in DEEPSEEK_NAMES:
            out[f"blk.{layer}.{DEEPSEEK_NAMES[module]}.{parts[-1]}"] = data
        else:
            out[gguf_name(name)] = data
    return out


def gemma_metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    """What llama.cpp's `Gemma2Model` / `Gemma3Model` write beyond the sizes: the head size always, the
    soft-capping, the window, and Gemma 3's global rotary base and linear scaling (the layer kinds, the
    sliding layers' base and the attention scale it does not write: its runtime knows them)."""
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        return
    full = cfg.rope_parameters["full_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def assert_float32_forwards(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, *logits: torch.Tensor) -> None:
    """Each float32 forward's logits within float32's bound of the exact ones (`decoder_bound`, with
    transformers' own float32 rotary frequencies): the weights agree, so do the functions."""
    probed = decoder_bound.logits(ours, ids, freq_error=freq_error(hf, ours))
    for got in logits:
        assert ((got.double() - probed.exact).abs() <= probed.bound()).all()


def assert_file_follows(path: Path, out: Path, theirs: torch.nn.Module, vocab: int, ids: torch.Tensor) -> None:
    """pagedrl's model converted from the GGUF at `path` (into `out`) gives `theirs`' logits on `ids` within
    1e-5, and the engine on the file greedy-decodes `theirs`' `generate` tokens (4-token blocks, 7-token
    chunks)."""
    from test_engine_greedy import GREEDY, prompts, reference, strip_eos

    from pagedrl import LLM
    from pagedrl.model.checkpoint import load_causal_lm
    from pagedrl.model.gguf import convert_gguf

    ours = load_causal_lm(convert_gguf(path, out), dtype=torch.float32)
    with torch.no_grad():
        assert float((ours.logits(ours(ids)) - theirs(ids).logits).abs().max()) < 1e-5
    batch = prompts(vocab)[:4]
    expected = reference(theirs, batch)
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    llm.close()
    assert [strip_eos(g, 1) for g in got] == [strip_eos(e, 1) for e in expected]


def converted_as_the_original(path: Path, out: Path, hf: torch.nn.Module) -> tuple[Path, torch.nn.Module]:
    """The folder `convert_gguf` makes of the file at `path` (into `out`) and transformers' model of it,
    which must be `hf`'s class with `hf`'s every tensor (a file of float32 tensors gives them back as they
    were)."""
    import transformers

    from pagedrl.model.gguf import convert_gguf

    out = convert_gguf(path, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    return out, back
