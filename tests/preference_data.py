"""Synthetic preference pairs for trainer tests: the chosen answer ends with "five", the rejected
one, otherwise identical, with "six"; prompts and answers are random words, so held-out pairs
share the property but not the text."""

from __future__ import annotations

import random

WORDS = ["red", "green", "blue", "yellow", "cat", "dog", "one", "two", "three", "four", "the", "mat", "park"]


def preference_rows(n: int, seed: int = 0, chat_every: int = 0) -> list[dict]:
    """`n` rows of {prompt, chosen, rejected}; every `chat_every`-th row (if > 0) in chat form."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = "what is " + " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))
        body = " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))
        chosen, rejected = f" {body} five", f" {body} six"
        if chat_every and i % chat_every == 0:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen.strip()}],
                         "rejected": [{"role": "assistant", "content": rejected.strip()}]})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def unpaired_rows(n: int, seed: int = 0, chat_every: int = 0) -> list[dict]:
    """`n` rows of {prompt, completion, label} for KTO: `preference_rows`' pairs, each row one of its pair's
    answers, the chosen one (label true) or, at random, the rejected one (false)."""
    rng = random.Random(seed + 1000)
    out = []
    for row in preference_rows(n, seed, chat_every):
        label = rng.random() < 0.5
        out.append({"prompt": row["prompt"], "completion": row["chosen" if label else "rejected"], "label": label})
    return out


def dpo_trainer(model_dir, output_dir, rows: list[dict] | None = None, eval_rows: list[dict] | None = None,
                reference=None, kto: bool = False, **fields):
    """A DPO (or with `kto`, a KTO) Trainer on the tiny model, built without run_dpo so tests can reach into
    it; `reference` is a CausalLM to use as the reference (default: a copy of the starting policy)."""
    import torch

    from pagedrl.model.loader import load_model
    from pagedrl.train.algorithms.dpo import DPO
    from pagedrl.train.algorithms.kto import KTO
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.offline_config import DPOConfig, KTOConfig
    from pagedrl.train.trainer import Trainer

    defaults = dict(model=str(model_dir), output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=8,
                    learning_rate=1e-3, logging_steps=1, save_steps=1000, seed=0, use_cpu=True)
    config = (KTOConfig if kto else DPOConfig)(**{**defaults, **fields})
    seed_everything(config.seed)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    dist = DistInfo()
    if rows is None:
        rows = unpaired_rows(32) if kto else preference_rows(32)
    algorithm = (KTO if kto else DPO)(config, loaded.model, loaded.tokenizer, dist, rows, eval_rows,
                                      ref_model=reference)
    return Trainer(config, algorithm, dist, progress=False)


def rm_trainer(model_dir, output_dir, rows: list[dict] | None = None, eval_rows: list[dict] | None = None,
               **fields):
    """A reward-model Trainer on the tiny model (a fresh score head on its backbone)."""
    import torch

    from pagedrl.model.heads import load_sequence_scorer
    from pagedrl.model.tokenizer import Tokenizer
    from pagedrl.train.algorithms.rm import RewardModeling
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.offline_config import RewardConfig
    from pagedrl.train.trainer import Trainer

    defaults = dict(model=str(model_dir), output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=8,
                    learning_rate=1e-3, logging_steps=1, save_steps=1000, seed=0, use_cpu=True)
    config = RewardConfig(**{**defaults, **fields})
    seed_everything(config.seed)
    model = load_sequence_scorer(model_dir, generator=torch.Generator().manual_seed(config.seed))
    dist = DistInfo()
    algorithm = RewardModeling(config, model, Tokenizer.from_folder(model_dir), dist,
                               rows if rows is not None else preference_rows(32), eval_rows)
    return Trainer(config, algorithm, dist, progress=False)
