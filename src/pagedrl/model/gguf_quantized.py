"""A GGUF file loaded with its quantized weights kept quantized (`quantization="gguf"`).

The model is the one `model/gguf.py` converts (same config, tokenizer, names and rotary layout), built
on the meta device so that no float32 copy of a quantized weight is ever made: each projection and the
embedding become `GGUFLinear` / `GGUFEmbedding` over the file's own blocks (the q/k rows un-permuted
as whole rows of blocks in the `llama` architecture, which is what llama.cpp's permutation moves), norms
and other float tensors load as float32. A tied LM head multiplies the embedding's blocks. A mixture of
experts' experts (llama.cpp's `ffn_*_exps`, one [experts, rows, blocks] tensor a projection) become
`GGUFExperts`, each expert's projections over its own rows of blocks. DeepSeek's `kv_b_proj`, which the
file holds as two halves one of them transposed (`model/gguf_deepseek.py`), is joined in float32: its
key half's blocks run along the wrong axis to be kept (and the absorbed attention reads it as floats).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from pagedrl.model.checkpoint import read_folder_config
from pagedrl.model.decoder import CausalLM
from pagedrl.model.gguf import ROPE_FACTORS, ROTARY_PERMUTED, GGUFError, hf_name, norm_offset, open_gguf
from pagedrl.model.gguf_deepseek import join_kv_b_state, kv_b_halves
from pagedrl.model.gguf_modules import SUPPORTED_TYPES, GGUFEmbedding, GGUFExperts, GGUFLinear
from pagedrl.model.projections import LAYER_PROJECTIONS

_FLOAT_TYPES = {int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16), int(GGMLQuantizationType.BF16)}


def unpermute_rotary_rows(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """`gguf.unpermute_rotary` on whole rows (of blocks): per head, rows [pair, half] → [half, pair]."""
    n = rows.shape[0]
    return rows.reshape(n_heads, n // n_heads // 2, 2, -1).transpose(1, 2).reshape(n, -1).contiguous()


_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")


def _load_experts(block: nn.Module, tensors: dict[str, Any], floats: dict[str, torch.Tensor], name: str, source: str,
                  kept: Counter[str]) -> None:
    """A layer's `ffn_{gate,up,down}_exps` ([experts, rows, blocks]): kept quantized as `GGUFExperts` when
    all three are of a kept type, read as the float model's stacked `gate_up_proj` / `down_proj` when all
    three are float tensors."""
    if sorted(tensors) != ["down", "gate", "up"]:
        raise GGUFError(f"{source}: {name} has expert tensors {sorted(tensors)}; it needs gate, up and down")
    types = {proj: int(t.tensor_type) for proj, t in tensors.items()}
    if all(ggml_type in _FLOAT_TYPES for ggml_type in types.values()):
        stacks = {proj: torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            [int(d) for d in reversed(t.shape)])) for proj, t in tensors.items()}
        floats[f"{name}.gate_up_proj"] = torch.cat([stacks["gate"], stacks["up"]], dim=1)
        floats[f"{name}.down_proj"] = stacks["down"]
        return
    if not all(ggml_type in SUPPORTED_TYPES for ggml_type in types.values()):
        listed = ", ".join(f"ffn_{proj}_exps {tensors[proj].tensor_type.name}" for proj in sorted(types))
        raise GGUFError(f"{source}: {name}: experts of types {listed}; quantization='gguf' keeps experts whose three "
                        f"tensors are all of {', '.join(SUPPORTED_TYPES.values())} (or all float)")
    projections: dict[str, list[GGUFLinear]] = {}
    for proj, t in tensors.items():
        count, rows, k = (int(d) for d in reversed(t.shape))
        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(count, rows, -1)
        projections[proj] = [GGUFLinear(blocks[e], types[proj], k) for e in range(count)]
        kept[t.tensor_type.name] += 1
    block.experts = GGUFExperts(projections["gate"], projections["up"], projections["down"])


def _float(t: Any) -> np.ndarray:
    """A GGUF tensor's values in float32, in transformers' dims order (GGUF lists dims innermost first)."""
    shape = [int(d) for d in reversed(t.shape)]
    return gguf_dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)


def _blocks(t: Any, cfg: Any, permuted: bool) -> torch.Tensor:
    """A quantized 2-D tensor's blocks as uint8 [rows, row_bytes], in transformers' row order (the q/k
    rows un-permuted where llama.cpp permuted them)."""
    rows = int(t.shape[-1])
    blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(rows, -1)
    if permuted and ".attn_q." in t.name:
        return unpermute_rotary_rows(blocks, cfg.num_attention_heads)
    if permuted and ".attn_k." in t.name:
        return unpermute_rotary_rows(blocks, cfg.num_key_value_heads)
    return blocks


def projection_blocks(gguf_path: str | Path, folder: str | Path, keep: Callable[[int], bool]) -> dict[str, GGUFLinear]:
    """The decoder projections of `gguf_path` whose GGML type `keep` accepts (and the kernels hold), as
    `GGUFLinear`s over the file's own blocks, by their transformers module name from `layers.` on (config
    from its converted `folder`); every other tensor is left unread."""
    cfg = read_folder_config(Path(folder))
    permuted = cfg.architecture in ROTARY_PERMUTED
    found: dict[str, GGUFLinear] = {}
    for t in open_gguf(Path(gguf_path)).tensors:
        ggml_type = int(t.tensor_type)
        if ggml_type not in SUPPORTED_TYPES or len(t.shape) != 2 or not t.name.endswith(".weight") \
                or _EXPERTS.fullmatch(t.name) or kv_b_halves(t.name) or t.name in ROPE_FACTORS or not keep(ggml_type):
            continue
        module_name = hf_name(t.name, str(gguf_path), cfg.architecture).rpartition(".")[0]
        if module_name.rpartition(".")[2] in LAYER_PROJECTIONS:
            found[module_name[module_name.find("layers."):]] = GGUFLinear(_blocks(t, cfg, permuted), ggml_type, int(t.shape[0]))
    return found


def load_gguf_quantized(gguf_path: str | Path, folder: str | Path) -> tuple[CausalLM, Counter[str]]:
    """The CPU model of `gguf_path` with its quantized weights kept so (config and names from its
    converted `folder`), and how many tensors of each type it keeps."""
    gguf_path, source = Path(gguf_path), str(gguf_path)
    cfg = read_folder_config(Path(folder))
    if cfg.gpt_oss is not None:  # its MXFP4 experts kept, the rest float32 (`model/mxfp4_loading.py`)
        from pagedrl.model.mxfp4_loading import load_gguf_gpt_oss_kept

        return load_gguf_gpt_oss_kept(gguf_path, cfg)
    reader = open_gguf(gguf_path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    kept: Counter[str] = Counter()
    floats: dict[str, torch.Tensor] = {}
    permuted = cfg.architecture in ROTARY_PERMUTED
    experts: dict[int, dict[str, Any]] = defaultdict(dict)  # layer -> projection -> its GGUF tensor
    halves: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if (m := _EXPERTS.fullmatch(t.name)) is not None:
            experts[int(m["layer"])][m["proj"]] = t
            continue
        if t.name in ROPE_FACTORS:  # (in the config)
            continue
        if kv_b_halves(t.name):
            halves[t.name] = _float(t)
            continue
        name = hf_name(t.name, source, cfg.architecture)
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        ggml_type = int(t.tensor_type)
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        if ggml_type in _FLOAT_TYPES:
            value = _float(t)
            if offset := norm_offset(t.name, cfg.architecture):  # (Gemma's norms, stored as 1 + w)
                value = value - np.float32(offset)
            floats[name] = torch.from_numpy(np.array(value, dtype=np.float32))
            continue
        if ggml_type not in SUPPORTED_TYPES or leaf != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
            what = t.tensor_type.name if ggml_type not in SUPPORTED_TYPES else f"a quantized {leaf}"
            raise GGUFError(f"{source}: tensor {t.name!r} is {what}, which quantization='gguf' does not keep "
                            f"quantized (supported: {', '.join(SUPPORTED_TYPES.values())}); without "
                            "quantization the file loads dequantized")
        blocks = _blocks(t, cfg, permuted)
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        replacement: nn.Module = GGUFEmbedding(blocks, ggml_type, shape[1]) if isinstance(module, nn.Embedding) \
            else GGUFLinear(blocks, ggml_type, shape[1])
        setattr(parent, child, replacement)
        kept[t.tensor_type.name] += 1
    for name, value in join_kv_b_state(halves, cfg, source).items():
        floats[name] = torch.from_numpy(value)
    for layer, tensors in experts.items():
        _load_experts(model.model.layers[layer].mlp, tensors, floats, f"model.layers.{layer}.mlp.experts", source, kept)
    embed = model.model.embed_tokens
    if cfg.tie_word_embeddings and "lm_head.weight" not in floats and isinstance(model.lm_head, nn.Linear):
        if isinstance(embed, GGUFEmbedding):
            model.lm_head = GGUFLinear(embed.table.qweight, embed.table.ggml_type, embed.embedding_dim)
        elif "model.embed_tokens.weight" in floats:
            floats["lm_head.weight"] = floats["model.embed_tokens.weight"]
    for name, value in floats.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf in module._buffers:  # (DeepSeek's router correction bias)
            module._buffers[leaf] = value
        else:
            setattr(module, leaf, nn.Parameter(value, requires_grad=False))
    if cfg.tie_word_embeddings and isinstance(model.lm_head, nn.Linear) and isinstance(embed, nn.Embedding):
        model.lm_head.weight = embed.weight
    model.model.reset_rope()
    missing = [n for n, v in [*model.named_parameters(), *model.named_buffers()] if v.is_meta]
    if missing:
        raise GGUFError(f"{source}: no tensor for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return model.eval(), kept
