"""`pagedrl rlhf recipe.yaml [key=value ...]`: the RLHF recipe end to end, each stage skipped when
its output is already complete (so an interrupted recipe resumes at the first unfinished stage):

1. **pairs**: sample completions from the base model with the engine on the task's training
   prompts, label them with the verifier, keep a correct one (chosen) against a wrong one
   (rejected): the preference data a labeller would otherwise provide (`pairs.jsonl`);
2. **rm**: train a reward model on those pairs (`pagedrl rm`), into `rm/final`;
3. **ppo**: PPO against that reward model (`pagedrl ppo`), into `ppo/final`.

The recipe file holds `output_dir`, `model`, `seed`, the built-in task's `task_*` fields and three
sections: `pairs` (num_prompts, num_generations, temperature, max_tokens, pairs_per_prompt), `rm` (RewardConfig
fields) and `ppo` (PPOConfig fields); the recipe fills in the paths between stages. Overrides
use dotted keys: `ppo.max_steps=4`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from pagedrl.train.config import load_config
from pagedrl.train.config_values import load_yaml
from pagedrl.train.offline_config import RewardConfig
from pagedrl.train.rl.config import PPOConfig

TASK_KEYS = ("task_operations", "task_low", "task_high", "task_num_eval")
PAIR_DEFAULTS = {"num_prompts": 256, "num_generations": 8, "temperature": 0.7, "max_tokens": 64, "pairs_per_prompt": 2}
PAIRS_FILE, PAIRS_DONE = "pairs.jsonl", "pairs.json"


def read_recipe(path: str | Path, overrides: list[str]) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe: {path}: file not found")
    try:
        recipe = load_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"recipe: {path}: not valid YAML: {e}") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"recipe: {path}: expected a mapping at the top level")
    for item in overrides:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        target = recipe.setdefault(section, {}) if field else recipe
        if field and not isinstance(target, dict):
            raise ValueError(f"command line: {key!r}: {section} is not a section")
        target[field or key] = yaml.safe_load(value)
    unknown = set(recipe) - {"output_dir", "model", "seed", "pairs", "rm", "ppo", *TASK_KEYS}
    if unknown:
        raise ValueError(f"recipe: {path}: unknown keys {sorted(unknown)}")
    return recipe


def stage_configs(recipe: dict[str, Any]) -> tuple[Path, dict[str, Any], RewardConfig, PPOConfig]:
    out = Path(recipe.get("output_dir", "runs/rlhf"))
    shared = {k: recipe[k] for k in ("model", "seed") if k in recipe}
    task = {k: recipe[k] for k in TASK_KEYS if k in recipe}
    pairs = {**PAIR_DEFAULTS, **(recipe.get("pairs") or {})}
    unknown = set(pairs) - set(PAIR_DEFAULTS)
    if unknown:
        raise ValueError(f"recipe: pairs: unknown keys {sorted(unknown)}; expected {sorted(PAIR_DEFAULTS)}")
    rm = load_config(RewardConfig, None, _as_overrides({**shared, **(recipe.get("rm") or {}),
                                                         "dataset": str(out / PAIRS_FILE),
                                                         "output_dir": str(out / "rm")}))
    ppo = load_config(PPOConfig, None, _as_overrides({**shared, **task, **(recipe.get("ppo") or {}),
                                                       "dataset": "arithmetic", "output_dir": str(out / "ppo"),
                                                       "reward_model_path": str(out / "rm" / "final")}))
    return out, pairs, rm, ppo


def _as_overrides(values: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def make_pairs(out: Path, pairs: dict[str, Any], ppo: PPOConfig, llm: Any = None) -> dict[str, float]:
    """Stage 1, on the same task (and the same held-out split) PPO trains and is evaluated on;
    sampled by `llm` when given (an engine on `ppo.model` the caller already holds)."""
    import itertools

    from pagedrl import LLM
    from pagedrl.train.data import load_examples
    from pagedrl.train.examples import PromptRows
    from pagedrl.train.rl.arithmetic import ArithmeticTask
    from pagedrl.train.rl.pairs import verifier_pairs, write_jsonl
    from pagedrl.train.rl.rewards import last_integer_match

    task = ArithmeticTask(tuple(ppo.task_operations), ppo.task_low, ppo.task_high, ppo.task_num_eval, seed=ppo.seed)
    llm = llm or LLM(ppo.model, seed=ppo.seed)
    # A stream of its own, so PPO's prompts are not the pairs' prompts in the same order.
    raw = list(itertools.islice(task.train_rows(seed=ppo.seed + 1), int(pairs["num_prompts"])))
    prompts, _ = load_examples(raw, PromptRows(llm.tokenizer, ppo.max_prompt_length))
    rows, stats = verifier_pairs(llm, prompts, ("last_integer_match", last_integer_match),
                                 int(pairs["num_generations"]), float(pairs["temperature"]), int(pairs["max_tokens"]),
                                 int(pairs["pairs_per_prompt"]))
    if not rows:
        raise ValueError(f"pairs: no prompt had both a correct and a wrong completion among {stats['completions']:.0f}; "
                         "raise pairs.num_prompts, pairs.num_generations or pairs.temperature")
    write_jsonl(rows, out / PAIRS_FILE)
    (out / PAIRS_DONE).write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def rlhf_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from pagedrl.train.algorithms.ppo import run_ppo
    from pagedrl.train.algorithms.rm import run_rm

    try:
        recipe = read_recipe(argv[0], argv[1:])
        out, pairs, rm, ppo = stage_configs(recipe)
    except ValueError as e:
        print(f"pagedrl rlhf: error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    try:
        for name, done, run in (
            ("pairs", out / PAIRS_DONE, lambda: make_pairs(out, pairs, ppo)),
            ("rm", Path(rm.output_dir) / "final" / "config.json", lambda: run_rm(rm)),
            ("ppo", Path(ppo.output_dir) / "final" / "config.json", lambda: run_ppo(ppo)),
        ):
            if done.is_file():
                print(f"pagedrl rlhf: {name}: complete ({done}), skipped")
                continue
            start = time.perf_counter()
            print(f"pagedrl rlhf: {name}: running")
            result = run()
            timings[name] = time.perf_counter() - start
            print(f"pagedrl rlhf: {name}: done in {timings[name] / 60:.1f} min" +
                  (f" ({json.dumps(result)})" if isinstance(result, dict) else ""))
    except ValueError as e:
        print(f"pagedrl rlhf: error: {e}", file=sys.stderr)
        return 1
    (out / "timings.json").write_text(json.dumps({**timings, "total": time.perf_counter() - t0}, indent=2) + "\n")
    print(f"pagedrl rlhf: the aligned policy is in {Path(ppo.output_dir) / 'final'}")
    return 0
