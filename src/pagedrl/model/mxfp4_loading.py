"""gpt-oss loaded with its MXFP4 experts kept so (`model/mxfp4_experts.py`): from a published Hugging Face
checkpoint (`quantization="mxfp4"`, vLLM's spelling) and from a llama.cpp GGUF file (`quantization="gguf"`).

The model is built on the meta device, each layer's experts replaced by `MXFP4Experts` over the file's
blocks, and every other tensor (attention, router, norms, embedding, sinks, the experts' biases) read as
float32 as the dequantizing load reads it: the experts are ~95% of gpt-oss's weights, so this is where the
bytes are. Not the default for such checkpoints (vLLM's is): a CPU computes kept weights in float32
(`model/loader.py`), while the dequantized model runs in bf16 where the CPU computes it natively and can be
trained; a user who needs the memory asks for it.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from pagedrl.model.checkpoint import CheckpointError, load_weights, read_folder_config, read_state_dict
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.footprint import check_fits, footprint
from pagedrl.model.gguf_gpt_oss import gpt_oss_state
from pagedrl.model.gguf_metadata import GGUFError, open_gguf
from pagedrl.model.mxfp4 import BLOCKS, SCALES
from pagedrl.model.mxfp4_experts import MXFP4_TYPE, MXFP4Experts, hf_rows, interleave_rows


def _assemble(cfg: ModelConfig, state: dict[str, torch.Tensor], experts: dict[int, MXFP4Experts], source: str,
              origins: dict[str, str] | None = None) -> CausalLM:
    """The meta-built model with `experts` in place and `state` (float tensors) assigned as its others."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    for layer, module in experts.items():
        model.model.layers[layer].mlp.experts = module
        base = f"model.layers.{layer}.mlp.experts."
        state.update({base + k: v for k, v in module.state_dict().items()})
    load_weights(model, state, source, origins, assign=True)
    model.model.reset_rope()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_mxfp4_kept(folder: str | Path) -> tuple[CausalLM, Counter[str]]:
    """A published gpt-oss checkpoint with its experts' `*_blocks` / `*_scales` kept as MXFP4, the rest in
    float32; and how many weights it keeps. Refused by name: another family, experts not in MXFP4."""
    folder = Path(folder)
    cfg = read_folder_config(folder)
    if cfg.gpt_oss is None:
        raise CheckpointError(f"{folder}: quantization='mxfp4' keeps gpt-oss's published MXFP4 experts; this is a "
                              f"{cfg.model_type} model (int8 / int4 quantize other models at load)")
    # Refused before reading when it cannot fit: float32 less the experts' weights, plus their blocks.
    fp = footprint(cfg, torch.float32)
    weights = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_intermediate_size
    check_fits(dataclasses.replace(fp, weight_bytes=fp.weight_bytes - 4 * weights + weights * 17 // 32),
               torch.device("cpu"), f"{folder} (its MXFP4 experts kept)")
    origins: dict[str, str] = {}
    state = read_state_dict(folder, dtype=torch.float32, origins=origins, keep_mxfp4=True)
    experts: dict[int, MXFP4Experts] = {}
    rules = cfg.gpt_oss
    for layer in range(cfg.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts."
        need = [base + w + s for w in ("gate_up_proj", "down_proj") for s in (BLOCKS, SCALES)]
        need += [base + "gate_up_proj_bias", base + "down_proj_bias"]
        missing = next((n for n in need if n not in state), None)
        if missing is not None:
            raise CheckpointError(f"{folder}: quantization='mxfp4' keeps experts published in MXFP4; tensor {missing!r} "
                                  "is missing (a checkpoint with float experts loads without quantization)")
        t = [state.pop(n) for n in need]
        try:
            experts[layer] = MXFP4Experts(hf_rows(t[0], t[1]), t[4], hf_rows(t[2], t[3]), t[5],
                                          rules.swiglu_alpha, rules.swiglu_limit)
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(f"{origins.get(need[0], str(folder))}: layer {layer}: {e}") from None
    return _assemble(cfg, state, experts, str(folder), origins), Counter({"MXFP4": 2 * len(experts)})


_EXPERT = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.(?P<suffix>weight|bias)")


def load_gguf_gpt_oss_kept(gguf_path: str | Path, cfg: ModelConfig) -> tuple[CausalLM, Counter[str]]:
    """A llama.cpp gpt-oss GGUF with its MXFP4 experts kept (gate and up rows interleaved into one weight,
    as transformers holds them), every other tensor dequantized to float32 as the plain load does."""
    source = str(gguf_path)
    reader = open_gguf(Path(gguf_path))
    arrays: dict[str, np.ndarray] = {}
    parts: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        m = _EXPERT.fullmatch(t.name)
        if m is not None and m["suffix"] == "weight":
            if int(t.tensor_type) != MXFP4_TYPE:
                raise GGUFError(f"{source}: tensor {t.name!r} is {t.tensor_type.name}; quantization='gguf' keeps "
                                "gpt-oss's experts when they are MXFP4 (without quantization the file loads dequantized)")
            parts[int(m["layer"])][m["proj"]] = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(
                shape[0], shape[1], -1)
            continue
        value = np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if m is not None:
            parts[int(m["layer"])][m["proj"] + "_bias"] = torch.from_numpy(value)
            continue
        arrays[t.name] = value
    state = {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in gpt_oss_state(arrays, source).items()}
    experts: dict[int, MXFP4Experts] = {}
    rules = cfg.gpt_oss
    assert rules is not None
    need = ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
    for layer, p in parts.items():
        if sorted(p) != sorted(need):
            raise GGUFError(f"{source}: layer {layer}'s experts have {sorted(p)}; gpt-oss needs {sorted(need)}")
        try:
            experts[layer] = MXFP4Experts(interleave_rows(p["gate"], p["up"]), torch.stack((p["gate_bias"], p["up_bias"]), -1).flatten(-2),
                                          p["down"], p["down_bias"], rules.swiglu_alpha, rules.swiglu_limit)
        except ValueError as e:
            raise GGUFError(f"{source}: layer {layer}: {e}") from None
    try:
        return _assemble(cfg, state, experts, source), Counter({"MXFP4": 3 * len(experts)})
    except CheckpointError as e:
        raise GGUFError(str(e)) from None
