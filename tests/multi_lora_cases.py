"""Adapters for the multi-LoRA tests: three of different ranks and targets on the tiny model, one of
them saved by `peft` itself, and each one's greedy tokens from its merged checkpoint; copies of an
adapter with NaN, infinite or overflowing numbers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tiny import randomise_adapter

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRAConfig, apply_lora

PROMPTS = ["the cat sat on the mat", "what is two plus three", "red green blue yellow"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MAX_RANK = 8


def pagedrl_adapter(base: Path, folder: Path, r: int, targets: list[str], seed: int) -> Path:
    """An adapter as a pagedrl trainer writes it, with B drawn large enough to change the tokens."""
    loaded = load_model(base, device="cpu", dtype=torch.float32)
    apply_lora(loaded.model, LoRAConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                        base_model_name_or_path=str(base)), torch.Generator().manual_seed(seed))
    randomise_adapter(loaded.model, seed + 100, scale=0.5)
    return save_adapter(loaded.model, folder)


def peft_adapter(base: Path, folder: Path, r: int, seed: int) -> Path:
    """An adapter saved by `peft` on the transformers model of the same folder."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"],
                                                    task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(folder)
    return folder


def make_adapters(base: Path, root: Path) -> dict[str, Path]:
    """Ranks 2, 4 and 8; the attention only, every projection, and PEFT's choice of three."""
    return {
        "qv2": pagedrl_adapter(base, root / "qv2", 2, ["q_proj", "v_proj"], seed=1),
        "all4": pagedrl_adapter(base, root / "all4", 4, ["all-linear"], seed=2),
        "peft8": peft_adapter(base, root / "peft8", MAX_RANK, seed=3),
    }


def merged_greedy(base: Path, adapters: dict[str, Path], prompts: list[str] = PROMPTS,
                  params: SamplingParams = GREEDY) -> dict[str | None, list[list[int]]]:
    """Greedy tokens per prompt of the base (key None) and of each adapter folded into the base's weights."""
    out: dict[str | None, list[list[int]]] = {}
    for name, folder in [(None, None), *adapters.items()]:
        llm = LLM(str(base), adapter=None if folder is None else str(folder), dtype=torch.float32,
                  kv_cache_tokens=2048)
        out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    distinct = {tuple(map(tuple, tokens)) for tokens in out.values()}
    assert len(distinct) == len(out), "every adapter must change what the base generates"
    return out


def rewrite_adapter(good: Path, folder: Path, tensors: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                    **config: Any) -> Path:
    """A copy of the adapter `good` with each tensor passed through `tensors(name, tensor)` and `config`
    merged into its adapter_config.json (json writes NaN and Infinity as Python reads them back)."""
    folder.mkdir(parents=True)
    raw = json.loads((good / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**raw, **config}))
    state = load_file(str(good / ADAPTER_WEIGHTS))
    if tensors is not None:
        state = {name: tensors(name, t) for name, t in state.items()}
    save_file(state, str(folder / ADAPTER_WEIGHTS))
    return folder


def nan_in_first_lora_a(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What a fine-tune that diverged saves: NaN in its weights (here one, in the first lora_A)."""
    if name.endswith("layers.0.self_attn.q_proj.lora_A.weight"):
        tensor = tensor.clone()
        tensor[0, 0] = float("nan")
    return tensor
