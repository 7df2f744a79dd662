"""What every `run_<algorithm>` does before it builds its algorithm and `Trainer`: join the process
group, seed, load the model in float32 (the master weights) and, with `use_peft`, put adapters on it."""

from __future__ import annotations

from typing import Any

import torch

from pagedrl.kernels.memory import keep_freed_memory
from pagedrl.train import adapters
from pagedrl.train import checkpointing as ckpt
from pagedrl.train.config import TrainConfig
from pagedrl.train.distributed import DistInfo, init_distributed
from pagedrl.train.dither import dither_for_run


def start_run(config: TrainConfig, needs: str) -> tuple[DistInfo, Any]:
    """What every `run_<algorithm>` does first: join the process group (if under torchrun), seed,
    and load `config.model` in float32 (the master weights) with its tokenizer, which `needs` names;
    with `use_peft`, adapters go on it here, before an algorithm could copy it as a reference."""
    from pagedrl.model.loader import load_model

    dist = init_distributed(config.use_cpu)
    ckpt.seed_everything(config.seed)
    if dist.device.type == "cpu":
        keep_freed_memory(every_block=True)  # a step's large tensors reuse the last step's memory
    loaded = _load_qlora_gguf(config, dist.device) or load_model(config.model, device=dist.device, dtype=torch.float32,
                                                                 revision=config.revision)
    if loaded.tokenizer is None:
        raise ValueError(f"model: {loaded.path} has no tokenizer.json; {needs} the model's tokenizer")
    adapters.attach_lora(config, loaded.model)  # use_peft: adapters on the frozen base (train/adapters.py)
    dither_for_run(config, dist.device, loaded.model)  # bf16: before any reference copy is taken
    return dist, loaded


def _load_qlora_gguf(config: TrainConfig, device: torch.device) -> Any:
    """A QLoRA run's model from a GGUF file whose blocks its base keeps, loaded with them kept
    (`model/qlora_gguf.py` `as_qlora_base`): no float32 copy of a kept projection is ever made. None
    where that does not apply (no QLoRA, a quant type set, a folder) or the file holds a type the
    kernels do not (then the float load and `quantize_base` keep what they can)."""
    from pagedrl.model.gguf import GGUFError
    from pagedrl.model.loader import load_model
    from pagedrl.model.qlora_gguf import as_qlora_base
    from pagedrl.model.resolve import resolve_gguf

    spec = config.quantized_base if config.use_peft else None
    if spec is None or not spec.keeps_file_blocks or resolve_gguf(config.model, config.revision) is None:
        return None
    try:
        loaded = load_model(config.model, device=device, dtype=torch.float32, revision=config.revision,
                            quantization="gguf")
    except GGUFError:
        return None
    as_qlora_base(loaded.model, spec)
    return loaded
