"""The quick demo's calibration: a short measurement of this machine at start, and the plan sized
from it, so that every method gets enough optimizer steps to mean something on any CPU class.

A fixed plan of wall-clock minutes means different things on different machines: one training
minute is four GRPO steps on an AMX CPU in bf16 and one on an AVX2-only CPU in float32 under load,
and one step at the full learning rate is Adam's sign step on one noisy batch (it made the quick
demo significantly worse there). So the quick form measures, in a few seconds, the two rates every
stage is made of, and sizes the plan from them:

- the engine's rate: a greedy pass over 32 of the held-out problems, as the evaluations run them
  (seconds per problem, generated tokens per second, completion length);
- the trainer's rate: a forward and backward pass of the policy over a packed batch, with the
  trainers' precision (training tokens per second).

Every stage's seconds follow from a cost model in those two rates (`predict`), and the sizing
(`size_quick`) chooses each method's steps so that the methods get the same predicted training
minutes, no method fewer than its minimum steps, and the whole demo about `target_minutes`. A
method then trains for its steps (its budget), with a minutes cap of `CAP` times its prediction
so that a machine that slows down mid-run ends a stage early rather than late.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from pagedrl.demo.plan import CAP, DemoPlan

# What the cost model assumes beyond the two measured rates, from the demo's own logs (bench/RESULTS.md,
# "Demo"): GRPO's dynamic sampling draws about 2.5 groups per group kept at temperature 0.7 (a round
# of 32 completions keeps about half its groups); a DPO step costs its policy's pass and a third of
# that for the reference's forward; a PPO step trains policy and critic and runs three forwards
# (reference, reward model, the rollout's values); each stage loads its models and builds an engine.
GRPO_DRAWS_PER_KEPT = 2.5
STAGE_SETUP_LOADS = {"paged": 3, "pairs": 1, "grpo": 1, "dpo": 2, "rm": 1, "ppo": 4}
MIN_STEPS = {"grpo": 4, "dpo": 12, "rm": 4, "ppo": 3}
MAX_STEPS = {"grpo": 16, "dpo": 60, "rm": 60, "ppo": 24}
# GRPO's first steps at lower rates: 1/3, 2/3, then the full rate (`warmup_starts_at_zero` false).
GRPO_WARMUP, PPO_WARMUP = 2, 1


@dataclass(frozen=True)
class Measurement:
    """What the calibration measured, all of it kept in plan.json (a resumed run sizes itself
    from the same numbers, so it finds the same plan)."""

    cpu_class: str  # pagedrl.kernels.isa.describe()
    precision: str  # what the trainers compute in
    load_seconds: float  # loading the model from disk
    eval_problems: int
    eval_seconds: float  # evaluating eval_problems held-out problems as the trainers do
    sampled_completions: int
    sampled_tokens: int
    sample_seconds: float  # one rollout round: sampled_completions drawn at once
    prompt_tokens: float  # mean prompt tokens of the task
    train_tokens: int
    train_seconds: float  # one forward + backward over train_tokens
    seconds: float  # the whole calibration
    load_average: float  # the machine's 1-minute load average at start (os.getloadavg)

    @property
    def sample_tps(self) -> float:
        """Generated tokens per second of a rollout's batch of completions."""
        return self.sampled_tokens / self.sample_seconds

    @property
    def sampled_length(self) -> float:
        """Mean tokens of a sampled completion."""
        return self.sampled_tokens / self.sampled_completions

    @property
    def train_tps(self) -> float:
        """Training tokens (forward + backward) per second."""
        return self.train_tokens / self.train_seconds


def measure(plan: DemoPlan, eval_problems: int = 32, sample_prompts: int = 2,
            train_batch: tuple[int, int] = (4, 96)) -> Measurement:
    """Time the rates on this machine with `plan`'s model (10-30 seconds on a 2-core CPU): one
    evaluation group as the trainers evaluate (`greedy_scores`, groups of EVAL_BATCH problems, each
    as long as its longest answer), one rollout round of `sample_prompts` x G completions at the
    rollouts' temperature, and one training pass."""
    import torch

    from pagedrl.demo.alignment import held_out_rows, verifier
    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.kernels.isa import describe
    from pagedrl.model.loader import load_model
    from pagedrl.train.evaluate import greedy_scores

    start = time.perf_counter()
    load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = plan.grpo().use_bf16(device)
    loaded = load_model(plan.model, device=device, dtype=torch.float32)  # as the trainers hold it
    load_seconds = time.perf_counter() - start
    model, tokenizer = loaded.model, loaded.tokenizer
    rows = held_out_rows(plan, tokenizer)
    problems, prompts = rows[:eval_problems], rows[-sample_prompts:]
    longest = max(len(r.prompt_ids) for r in rows)
    completions = sample_prompts * plan.num_generations
    llm = LLM.from_module(model, tokenizer, eos_token_ids=loaded.eos_token_ids, seed=plan.seed,
                          kv_cache_tokens=max(len(problems), completions) * (longest + plan.completion_tokens + 16),
                          autocast_dtype=torch.bfloat16 if bf16 else None)
    llm.generate([problems[0].prompt_ids], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    with llm.batch_invariance_suspended():  # as the trainers' evaluations run
        greedy_scores(llm, problems, verifier(), plan.completion_tokens)
    eval_seconds = time.perf_counter() - t0
    params = SamplingParams(n=plan.num_generations, temperature=plan.rollout_temperature,
                            max_tokens=plan.completion_tokens, seed=plan.seed)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in prompts], params, use_tqdm=False)
    sample_seconds = time.perf_counter() - t0
    sampled = [len(c.token_ids) for o in outs for c in o.outputs]
    llm.sleep()
    del llm, outs
    gc.collect()
    batch, length = train_batch
    generator = torch.Generator().manual_seed(plan.seed)
    ids = torch.randint(16, model.config.vocab_size, (batch, length), generator=generator).to(device)

    train_pass(model, ids[:1, :16], bf16)  # warm-up: the first backward allocates
    t0 = time.perf_counter()
    train_pass(model, ids, bf16)
    train_seconds = time.perf_counter() - t0
    del model, loaded
    gc.collect()
    return Measurement(cpu_class=describe(), precision="bf16 autocast over float32 masters" if bf16 else "float32",
                       load_seconds=load_seconds, eval_problems=len(problems), eval_seconds=eval_seconds,
                       sampled_completions=len(sampled), sampled_tokens=max(1, sum(sampled)),
                       sample_seconds=sample_seconds, prompt_tokens=sum(len(r.prompt_ids) for r in rows) / len(rows),
                       train_tokens=batch * length, train_seconds=train_seconds,
                       seconds=time.perf_counter() - start, load_average=load_average)


def train_pass(model: Any, ids: Any, bf16: bool) -> None:
    """A forward and backward pass over `ids` with logits at every position, as a trainer's."""
    import torch

    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model.logits(model(ids))
    torch.logsumexp(logits, -1).mean().backward()
    model.zero_grad(set_to_none=True)


# -- the cost model ---------------------------------------------------------------------------------


def step_seconds(plan: DemoPlan, m: Measurement) -> dict[str, float]:
    """Predicted seconds of one optimizer step of each trained stage."""
    sampled = m.sampled_length
    sequence = m.prompt_tokens + sampled  # one completion with its prompt
    grpo_n = plan.grpo_prompts_per_step * plan.num_generations
    grpo = (GRPO_DRAWS_PER_KEPT * grpo_n * sampled / m.sample_tps
            + (grpo_n * sampled + plan.grpo_prompts_per_step * m.prompt_tokens) / m.train_tps)
    dpo = 2 * plan.dpo_batch_pairs * sequence * (1 + 1 / 3) / m.train_tps
    rm = 2 * plan.rm_batch_pairs * sequence / m.train_tps
    ppo_n = plan.ppo_prompts_per_step * plan.ppo_generations
    ppo = ppo_n * sampled / m.sample_tps + ppo_n * sequence * (2 + 3 / 3) / m.train_tps
    return {"grpo": grpo, "dpo": dpo, "rm": rm, "ppo": ppo}


def eval_seconds(plan: DemoPlan, m: Measurement) -> float:
    """One greedy evaluation over the plan's held-out problems."""
    from pagedrl.train.evaluate import EVAL_BATCH

    return math.ceil(plan.num_eval / EVAL_BATCH) * m.eval_seconds / math.ceil(m.eval_problems / EVAL_BATCH)


def fixed_seconds(plan: DemoPlan, m: Measurement) -> dict[str, float]:
    """Predicted seconds of each stage outside its training steps: loading, the paged stage's two
    engines, the pairs' sampling, evaluations."""
    evaluation = eval_seconds(plan, m)
    pairs = plan.pair_prompts * plan.pair_generations * m.sampled_length / m.sample_tps
    # The paged stage: pagedrl and transformers each generate its output tokens (about a quarter
    # of its mixed requests' 16-256, times `scale`), at about a third of a full batch's rate.
    paged_tokens = (plan.num_requests * 136 * plan.scale + plan.n_samples * plan.n_sample_tokens)
    setup = {k: n * m.load_seconds + 2 for k, n in STAGE_SETUP_LOADS.items()}
    evals_along = {k: max(0, math.ceil(getattr(plan, f"{k}_max_steps") / getattr(plan, f"{k}_eval_steps")) - 1)
                   for k in ("grpo", "dpo", "ppo")} if plan.grpo_max_steps else {"grpo": 0, "dpo": 0, "ppo": 0}
    return {"paged": setup["paged"] + 2 * 3 * paged_tokens / m.sample_tps,
            "pairs": setup["pairs"] + evaluation + pairs,
            "grpo": setup["grpo"] + evaluation * (1 + evals_along["grpo"]),
            "dpo": setup["dpo"] + evaluation * (1 + evals_along["dpo"]),
            "rm": setup["rm"], "ppo": setup["ppo"] + evaluation * (1 + evals_along["ppo"])}


START_SECONDS = 10.0  # the command's start-up before the calibration: imports, the precision probe


def predict(plan: DemoPlan, m: Measurement) -> dict[str, float]:
    """Predicted seconds of each stage of a plan with step budgets, and of the start ("start": the
    start-up and the calibration itself)."""
    steps = step_seconds(plan, m)
    fixed = fixed_seconds(plan, m)
    stages = {k: fixed[k] + (getattr(plan, f"{k}_max_steps") * steps[k] if k in steps else 0.0) for k in fixed}
    return {"start": START_SECONDS + m.seconds, **stages}


# -- the sizing -------------------------------------------------------------------------------------


def with_steps(plan: DemoPlan, m: Measurement, share: float, grpo_along: bool) -> DemoPlan:
    """`plan` with each method's steps: as many as fit in its share of `share` training minutes at
    the measured rates, within MIN_STEPS and MAX_STEPS; GRPO evaluated once along the way (after
    half its steps, an even count) if `grpo_along`, every method at its last step."""
    steps = step_seconds(plan, m)
    # RLHF's share: the reward model's part (`rm_share`, or its minimum steps' minutes if more), PPO the rest.
    rm = min(share, max(share * plan.rm_share, MIN_STEPS["rm"] * steps["rm"] / 60))
    minutes = {"grpo": share, "dpo": share, "rm": rm, "ppo": share - rm}
    counts = {k: min(MAX_STEPS[k], max(MIN_STEPS[k], math.floor(60 * minutes[k] / steps[k]))) for k in steps}
    if grpo_along:
        counts["grpo"] -= counts["grpo"] % 2
    return dataclasses.replace(
        plan, budget_minutes=share, grpo_max_steps=counts["grpo"], dpo_max_steps=counts["dpo"],
        rm_max_steps=counts["rm"], ppo_max_steps=counts["ppo"],
        grpo_eval_steps=counts["grpo"] // 2 if grpo_along else counts["grpo"], dpo_eval_steps=counts["dpo"],
        ppo_eval_steps=counts["ppo"])


def size_quick(plan: DemoPlan, m: Measurement, target_minutes: float = 6.5,
               budget_minutes: float | None = None, share_range: tuple[float, float] = (0.5, 1.5)) -> DemoPlan:
    """`plan` (the quick preset) with step budgets chosen from `m`. Each method's share of training
    minutes is what the target leaves after the stages' fixed work (`fixed_seconds`), split equally
    between GRPO, DPO and RLHF (a quarter of RLHF's to the reward model) within `share_range`, or
    `budget_minutes` if given; each takes the steps that fit in its share, at least MIN_STEPS. While
    the prediction is over the target, a slow machine gives up, in this order: DPO's 8 pairs a step
    for 4 and PPO's 4 prompts for 2 (more, smaller steps at the same learning rate), GRPO's
    evaluation along the way, 32 of the 128 held-out problems, then 16 of the 48 prompts the pairs
    are sampled from. Past that it takes longer than
    the target rather than fewer steps: a method's minimum steps are what make its verdict mean
    something."""
    levers = [dict(dpo_batch_pairs=min(4, plan.dpo_batch_pairs)), dict(ppo_prompts_per_step=min(2, plan.ppo_prompts_per_step)),
              dict(grpo_along=False), dict(num_eval=min(96, plan.num_eval)), dict(pair_prompts=min(32, plan.pair_prompts))]
    fields: dict[str, Any] = {}
    while True:
        along = fields.get("grpo_along", True)
        base = dataclasses.replace(plan, **{k: v for k, v in fields.items() if k != "grpo_along"})
        probe = with_steps(base, m, 1.0, along)  # step budgets on, to count the evaluations along the way
        fixed = START_SECONDS + m.seconds + sum(fixed_seconds(probe, m).values())
        share = budget_minutes if budget_minutes is not None else \
            min(share_range[1], max(share_range[0], (60 * target_minutes - fixed) / 3 / 60))
        sized = with_steps(base, m, share, along)
        predicted = predict(sized, m)
        if sum(predicted.values()) <= 60 * target_minutes + 1 or not levers:
            break
        fields.update(levers.pop(0))
    return dataclasses.replace(sized, calibration={
        "measured": dataclasses.asdict(m),
        "rates": {"generated tokens/s": m.sample_tps, "sampled length": m.sampled_length,
                  "training tokens/s": m.train_tps},
        "target_minutes": target_minutes,
        "given up": sorted(k for k in fields),
        "step_seconds": step_seconds(sized, m),
        "predicted_stage_seconds": predicted,
        "predicted_minutes": sum(predicted.values()) / 60,
    })


def describe(plan: DemoPlan) -> str:
    """The calibration in one paragraph, for the report."""
    c = plan.calibration
    if c is None:
        return ""
    m = c["measured"]
    minutes = {k: getattr(plan, f"{k}_max_steps") * c["step_seconds"][k] / 60 for k in MIN_STEPS}
    return (f"CPU class {m['cpu_class']}, training in {m['precision']}. Calibrated at start in {m['seconds']:.0f} s "
            f"(load average {m['load_average']:.1f}): a greedy pass over {m['eval_problems']} held-out problems took "
            f"{m['eval_seconds']:.1f} s; {m['sampled_completions']} completions sampled at once {m['sample_seconds']:.1f} s "
            f"({c['rates']['generated tokens/s']:.0f} tokens/s, {c['rates']['sampled length']:.0f} tokens a completion); a forward and backward pass over {m['train_tokens']} "
            f"tokens {m['train_seconds']:.2f} s ({c['rates']['training tokens/s']:.0f} training tokens/s). Chosen for "
            f"about {c['target_minutes']:g} minutes in all (predicted {c['predicted_minutes']:.1f}): "
            f"{plan.num_eval} held-out problems; GRPO {plan.grpo_max_steps} steps of {plan.grpo_prompts_per_step} "
            f"prompts x {plan.num_generations} (predicted {c['step_seconds']['grpo']:.0f} s a step), DPO "
            f"{plan.dpo_max_steps} steps of {plan.dpo_batch_pairs} pairs ({c['step_seconds']['dpo']:.1f} s), the reward "
            f"model {plan.rm_max_steps} steps of {plan.rm_batch_pairs} pairs ({c['step_seconds']['rm']:.1f} s), PPO "
            f"{plan.ppo_max_steps} steps of {plan.ppo_prompts_per_step} prompts x {plan.ppo_generations} "
            f"({c['step_seconds']['ppo']:.0f} s); predicted training minutes GRPO {minutes['grpo']:.2g}, DPO "
            f"{minutes['dpo']:.2g}, RLHF {minutes['rm'] + minutes['ppo']:.2g} (the share of each: "
            f"{plan.budget_minutes:.2g}, raised to its minimum steps), each stage capped at {CAP:g}x its prediction."
            + (f" Given up to fit: {', '.join(c['given up'])}." if c["given up"] else ""))


def calibrated(plan: DemoPlan, target_minutes: float = 6.5, budget_minutes: float | None = None) -> DemoPlan:
    """`plan` sized by `size_quick`, from the calibration its output folder already holds (a resumed
    run: the same measurement gives the same plan) or from a new measurement."""
    import json

    saved = plan.out / "plan.json"
    if saved.is_file():
        kept = json.loads(saved.read_text()).get("calibration")
        if kept is not None:
            return size_quick(plan, Measurement(**kept["measured"]), kept["target_minutes"], budget_minutes)
    return size_quick(plan, measure(plan), target_minutes, budget_minutes)


def summary_line(plan: DemoPlan) -> str:
    """The calibration's choice in one line, for the terminal."""
    c = plan.calibration
    assert c is not None
    return (f"calibrated in {c['measured']['seconds']:.0f} s ({c['rates']['generated tokens/s']:.0f} generated, "
            f"{c['rates']['training tokens/s']:.0f} training tokens/s): {plan.num_eval} problems, GRPO "
            f"{plan.grpo_max_steps} steps, DPO {plan.dpo_max_steps} x {plan.dpo_batch_pairs} pairs, reward model "
            f"{plan.rm_max_steps}, PPO {plan.ppo_max_steps}; about {c['predicted_minutes']:.1f} minutes")
