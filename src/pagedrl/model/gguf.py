"""GGUF (llama.cpp) to a Hugging Face folder, so one loader serves both.

A GGUF carries the same model as a Hugging Face folder, spelled differently: sizes under `<arch>.*`
metadata keys, tensors under llama.cpp names, most of them quantized, a mixture of experts' experts as
one 3-D tensor per projection, the q/k projection rows permuted for llama.cpp's rotary layout (in the
`llama` architecture only: llama.cpp rotates Qwen's and Gemma's heads in halves, as transformers does),
Gemma's norm weights stored as 1 + w (`model/gguf_gemma.py`), gpt-oss's gate and up split from their
interleaving (`model/gguf_gpt_oss.py`), DeepSeek's `kv_b_proj` split in two (`model/gguf_deepseek.py`),
and the tokenizer as arrays of tokens, merges and token types instead of a tokenizer.json. `convert_gguf` undoes each of these and writes float32 safetensors with
config, tokenizer and generation config beside them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from gguf.quants import dequantize
from safetensors.numpy import save_file

from pagedrl.model.config import ModelConfig
from pagedrl.model.expert_weights import DISK_NAMES
from pagedrl.model.gguf_deepseek import (
    CORRECTION_BIAS,
    DEEPSEEK2,
    DEEPSEEK_LAYER_TENSORS,
    deepseek_config,
    join_kv_b_state,
    kv_b_halves,
)
from pagedrl.model.gguf_gemma import GEMMA_ARCHITECTURES, GEMMA_LAYER_TENSORS, gemma_config, norm_offset
from pagedrl.model.gguf_gpt_oss import GPT_OSS, gpt_oss_config, gpt_oss_state
from pagedrl.model.gguf_metadata import GGUFError, Metadata, open_gguf, published_float
from pagedrl.model.gguf_tokenizer import read_tokenizer
from pagedrl.model.staging import staged_folder

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the atomic rename alone still prevents torn folders
    fcntl = None  # type: ignore[assignment]

# llama.cpp's `general.architecture` -> the transformers architecture it was converted from. Llama's
# converter permutes the q/k rows (its `permute`); the others keep transformers' layout.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", **GEMMA_ARCHITECTURES,
                 **GPT_OSS, **DEEPSEEK2}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ROTARY_PERMUTED = ("LlamaForCausalLM", "MixtralForCausalLM")  # (Mixtral: a `llama` file with experts)
# Phi-3's `ffn_up` is its fused gate_up_proj (and `attn_qkv` its qkv_proj), as transformers holds them.
FUSED_UP = ("Phi3ForCausalLM",)
# LongRoPE's per-pair factors (Phi-3 128k): config, not weights.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
CONVERSION_MARKER = "pagedrl-conversion.json"  # written last: a folder without it is unfinished
CONVERSION_FORMAT = 3  # 2: end-of-generation tokens by text, llama.cpp's BOS default; 3: and FIM's

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused projection
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    # The experts, one [experts, rows, columns] tensor a projection (`_split_experts`).
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

def _read_config(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    arch = meta.need("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{meta.source}: architecture {arch!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch in GEMMA_ARCHITECTURES:
        return gemma_config(meta, tensors)
    if arch in GPT_OSS:
        return gpt_oss_config(meta, tensors)
    if arch in DEEPSEEK2:
        return deepseek_config(meta, tensors)
    p = f"{arch}."
    hidden, heads = int(meta.need(p + "embedding_length")), int(meta.need(p + "attention.head_count"))
    kv_heads = meta.get(p + "attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise GGUFError(f"{meta.source}: per-layer {p}attention.head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rot = int(meta.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim and arch != "phi3":
        raise GGUFError(f"{meta.source}: partial rotary embeddings ({p}rope.dimension_count={rot}, "
                        f"head_dim={head_dim}) are not supported in {arch!r} files (only in phi3)")
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{meta.source}: per-frequency rope factors (tensor rope_freqs.weight, Llama 3.1 style) "
                        "are not supported")
    scaling_type = meta.get(p + "rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": published_float(meta.need(p + "rope.scaling.factor"))}
    elif scaling_type == "none":
        rope_scaling = None
    else:
        raise GGUFError(f"{meta.source}: {p}rope.scaling.type {scaling_type!r} is not supported (linear, none)")
    if ROPE_FACTORS[0] in tensors:
        rope_scaling = _longrope(meta, p, tensors)
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{meta.source}: tensor 'token_embd.weight' is missing")
    layers = int(meta.need(p + "block_count"))
    window = meta.get(p + "attention.sliding_window")
    cfg = ModelConfig(
        architecture="MixtralForCausalLM" if arch == "llama" and meta.get(p + "expert_count") else ARCHITECTURES[arch],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta.need(p + "feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=published_float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=published_float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        partial_rotary_factor=rot / head_dim,
        sliding_window=int(window) if window else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
        **_experts_config(meta, p, tensors, layers),
    )
    cfg.validate(meta.source)
    return cfg


def _longrope(meta: Metadata, p: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 128k's LongRoPE: the long and short factors a rotary pair (the file's `rope_factors_*`
    tensors) and the original context they stretch; the attention factor follows from the lengths, as
    transformers derives it."""
    def factors(name: str) -> list[float]:
        if name not in tensors:
            raise GGUFError(f"{meta.source}: tensor {name!r} is missing beside {ROPE_FACTORS[0]!r}")
        values = dequantize(tensors[name].data, tensors[name].tensor_type).astype(np.float32).reshape(-1)
        return [published_float(v) for v in values]

    return {"rope_type": "longrope", "long_factor": factors(ROPE_FACTORS[0]), "short_factor": factors(ROPE_FACTORS[1]),
            "original_max_position_embeddings": int(meta.need(p + "rope.scaling.original_context_length"))}


def _experts_config(meta: Metadata, p: str, tensors: dict[str, Any], layers: int) -> dict[str, Any]:
    """A mixture of experts' fields (none for a dense file): Mixtral's in a `llama` file (its experts of
    `feed_forward_length`); Qwen3-MoE's, whose layers without expert tensors are dense (`mlp_only_layers`)
    and whose chosen experts' weights llama.cpp always renormalises, so `norm_topk_prob` is true, as
    transformers reads such a file."""
    experts = meta.get(p + "expert_count")
    if not experts:
        return {}
    if p == "llama.":
        return dict(num_experts=int(experts), num_experts_per_tok=int(meta.need(p + "expert_used_count")))
    if p != "qwen3moe.":
        raise GGUFError(f"{meta.source}: a {p[:-1]!r} file with experts ({p}expert_count={experts}) is not "
                        "supported; supported mixtures of experts: llama (Mixtral), qwen3moe")
    return dict(num_experts=int(experts), num_experts_per_tok=int(meta.need(p + "expert_used_count")),
                moe_intermediate_size=int(meta.need(p + "expert_feed_forward_length")), norm_topk_prob=True,
                mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensors])


def hf_name(name: str, source: str, architecture: str = "LlamaForCausalLM") -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if (bias := CORRECTION_BIAS.fullmatch(name)) is not None:  # DeepSeek-V3's router correction bias
        return f"model.layers.{bias.group(1)}.mlp.gate.e_score_correction_bias"
    m = _LAYER_NAME.fullmatch(name)
    layer_tensors = _LAYER_TENSORS
    if architecture in GEMMA_ARCHITECTURES.values():
        layer_tensors = {**_LAYER_TENSORS, **GEMMA_LAYER_TENSORS}
    elif architecture in DEEPSEEK2.values():
        layer_tensors = {**_LAYER_TENSORS, **DEEPSEEK_LAYER_TENSORS}
    if m and m.group(2) in layer_tensors:
        module = "mlp.gate_up_proj" if m.group(2) == "ffn_up" and architecture in FUSED_UP else layer_tensors[m.group(2)]
        return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
    raise GGUFError(f"{source}: tensor {name!r} has no Hugging Face counterpart in the architectures "
                    f"pagedrl reads from GGUF ({', '.join(SUPPORTED_ARCHITECTURES)})")


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (`permute` in convert_hf_to_gguf.py).

    Hugging Face rotates the two halves of each head against each other; llama.cpp rotates adjacent
    pairs, so its converter interleaves the halves. Per head this takes rows [pair, half] back to
    [half, pair], exactly like transformers' GGUF loader.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_weights(tensors: dict[str, Any], cfg: ModelConfig, source: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    permuted = cfg.architecture in ROTARY_PERMUTED
    gpt_oss = cfg.architecture in GPT_OSS.values()  # (renamed and restacked as a whole: `gguf_gpt_oss`)
    for name, t in tensors.items():
        if name in ROPE_FACTORS:
            continue
        # (DeepSeek's kv_b_proj halves keep the file's names until they are joined: `gguf_deepseek`)
        hf = name if gpt_oss or kv_b_halves(name) else hf_name(name, source, cfg.architecture)
        try:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise GGUFError(f"{source}: tensor {name!r}: {e}") from None
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if offset := norm_offset(name, cfg.architecture):
            w = w - np.float32(offset)
        if permuted and ".attn_q." in name:
            w = unpermute_rotary(w, cfg.num_attention_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_rotary(w, cfg.num_key_value_heads)
        out[hf] = np.ascontiguousarray(w)
    if gpt_oss:
        return gpt_oss_state(out, source)
    if cfg.deepseek is not None:
        out = join_kv_b_state(out, cfg, source)
    return _split_experts(out, cfg)


def _split_experts(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Each layer's `ffn_{gate,up,down}_exps` ([experts, rows, columns]) as one tensor per expert and
    projection, and the router, under the names the family's checkpoints publish (`expert_weights`:
    Mixtral's `block_sparse_moe.experts.E.w1`, Qwen3-MoE's `mlp.experts.E.gate_proj`), which transformers
    reads and the loader stacks back."""
    names = DISK_NAMES.get(cfg.model_type)
    if names is None:
        return state
    roles = {"gate_proj": names.gate, "up_proj": names.up, "down_proj": names.down}
    out: dict[str, np.ndarray] = {}
    for name, w in state.items():
        stem, _, proj = name.removesuffix(".weight").rpartition(".")
        if stem.endswith(".mlp") and proj == "gate":  # the router
            out[f"{stem.removesuffix('mlp')}{names.block}.gate.weight"] = w
        elif stem.endswith(".mlp.experts") and w.ndim == 3:
            block = f"{stem.removesuffix('mlp.experts')}{names.block}.experts"
            for e in range(w.shape[0]):
                out[f"{block}.{e}.{roles[proj]}.weight"] = np.ascontiguousarray(w[e])
        else:
            out[name] = w
    return out


# Tokens llama.cpp ends generation at by their text, whatever the metadata names (llama-vocab.cpp): files
# converted before `eot_token_id` existed still end a chat turn where llama.cpp ends it.
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                           "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                           "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")
# Fill-in-the-middle's pad, repository and file-separator tokens end generation in llama.cpp too (a code
# model's answer stops where its next file would begin): the metadata's id, else the first text found.
FIM_END_TEXTS = {"pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                 "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                 "sep": ("<|file_sep|>",)}


def _generation_config(meta: Metadata) -> dict[str, Any]:
    """Chat models end a turn with EOT (Llama 3's <|eot_id|>) as well as EOS; generation stops at either,
    and, as in llama.cpp, at the fill-in-the-middle tokens of `FIM_END_TEXTS` and at every token of
    `END_OF_GENERATION_TEXTS` the vocabulary holds, with llama.cpp's two exceptions: <|end|>, which ends a
    message and not the answer where <|return|> and <|call|> (or <|calls|> and <|flush|>) are there too,
    and </s> where <|tool_response> is."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    fim = [meta.get(f"tokenizer.ggml.fim_{kind}_token_id") for kind in FIM_END_TEXTS]
    fim = [i if i is not None else next((j for j, t in enumerate(tokens) if t in texts), None)
           for i, texts in zip(fim, FIM_END_TEXTS.values(), strict=True)]
    by_text = {i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS}
    named = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in [*named, *sorted({*by_text, *fim} - {None})] if i is not None))
    texts = {tokens[i]: i for i in eos if i < len(tokens)}  # what ends generation, by text: the exceptions
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
        eos.remove(texts["<|end|>"])
    if "<|tool_response>" in texts and "</s>" in texts:
        eos.remove(texts["</s>"])
    gen: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
                           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = pad
    return gen


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the Hugging Face folder for a GGUF (`SUPPORTED_ARCHITECTURES`) at `out_dir` and return it.

    Everything is written to a temporary sibling and renamed into place at the end, so `out_dir`
    either does not exist or is complete, whatever happens to this process. An existing `out_dir` is
    an error unless `overwrite`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    reader = open_gguf(gguf_path)
    meta = Metadata(reader, str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = _read_config(meta, tensors)
    tokenizer = read_tokenizer(meta)  # before the weights: a bad tokenizer fails fast
    with staged_folder(out_dir, replace=overwrite) as tmp:
        save_file(_read_weights(tensors, cfg, str(gguf_path)), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        _write_json(tmp / "config.json", cfg.to_dict())
        _write_json(tmp / "generation_config.json", _generation_config(meta))
        tokenizer.save(tmp)
        _write_json(tmp / CONVERSION_MARKER, conversion_record(gguf_path))
    return out_dir


def conversion_record(gguf_path: Path) -> dict[str, Any]:
    """What the marker file records: enough to tell a finished conversion of this very file."""
    st = gguf_path.stat()
    return {"format": CONVERSION_FORMAT, "source": gguf_path.name, "source_bytes": st.st_size,
            "source_mtime_ns": st.st_mtime_ns}


def is_converted(gguf_path: str | Path, out_dir: str | Path) -> bool:
    """True when `out_dir` holds a finished conversion of this GGUF by this converter version."""
    try:
        marker = json.loads((Path(out_dir) / CONVERSION_MARKER).read_text(encoding="utf-8"))
        return marker == conversion_record(Path(gguf_path))
    except (OSError, ValueError):
        return False


def ensure_converted(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert once and reuse: return `out_dir` if it holds this GGUF's finished conversion, else
    (re)convert it. Safe when several processes ask at once: a lock file serialises them, and the
    folder appears by atomic rename, so none ever sees a half-written one."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_converted(gguf_path, out_dir):
        return out_dir
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out_dir.parent / f".{out_dir.name}.lock"):
        if is_converted(gguf_path, out_dir):  # another process finished while we waited
            return out_dir
        return convert_gguf(gguf_path, out_dir, overwrite=True)  # replaces a stale or unfinished folder


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
