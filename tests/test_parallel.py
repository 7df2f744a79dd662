"""Two gloo processes equal one process, under DDP and FSDP2, for SFT, RM, DPO (with the reference
run alongside, or its log-probs precomputed by strided shares), GRPO, RLOO and PPO.

One torchrun launch (`parallel_worker.py`) runs every two-process scenario in sequence; the
one-process references run here, from the same builders (`parallel_scenarios.py`), with the
per-device batch doubled so that the global batch of a step is the same.

Why the online algorithms can be compared at all: every prompt carries its own sampling seed,
drawn from the run's seed and the prompt's place in the run's stream of prompts, and the engine
draws each sequence's noise from that sequence's own generator. A prompt therefore gets the same
completions whichever rank samples it and however many ranks there are, and the test checks that
the two runs' rollouts are token for token the same before it compares losses and gradients.
What could still tell them apart is the last bit of a logit: a matmul over 1 to 3 rows takes
another CPU kernel than one over more, so a batch that shrinks to a few sequences, or a prompt
block read from the prefix cache, could round differently and, at a near tie, flip a token. The
scenarios keep every engine batch at 16 sequences or more (completions of 8 tokens, which the
tiny model rarely ends early) and evaluate only after the steps, so no rollout reads a block
cached by another batch; the token check makes any such flip fail loudly, not as a loss drift. On
top of that, every statistic of the batch is taken over all ranks: GRPO's `scale_rewards: batch`
std (the scenarios use it, with rewards that differ between the ranks' groups), RLOO's leave-one-out
baselines and batch normalisation of KL-penalised rewards, PPO's advantage
and reward whitening and its adaptive KL coefficient (step 2 uses the coefficient step 1 set).
Step 2 of GRPO and PPO samples a new rollout from the updated weights, which under FSDP2 the
engine reads whole, gathered for the rollout and released after.

What is compared, per step: the loss, the whole gradient before and after clipping
(`max_grad_norm` is small enough to clip; under FSDP2 the sharded gradients are gathered), the
gradient norm, every logged metric but timings, after the steps the held-out evaluation (5 rows:
3 on one rank, 2 on the other) and PPO's adaptive KL coefficient. A separate check runs `collect_rollout` on
groups whose reward spread differs between the ranks, and a checkpoint written under one of DDP
and FSDP2 is resumed under the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parallel_scenarios import ALGORITHMS, LORA, build, rollout_statistics, run_steps

from pagedrl.model.checkpoint import read_state_dict
from pagedrl.train.distributed import DistInfo
from pagedrl.train.rl.advantages import group_advantages

WORKER = Path(__file__).parent / "parallel_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def two_processes(tiny_train_model, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("two-processes")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(tiny_train_model), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out / "results.pt", weights_only=False), out


@pytest.fixture(scope="module")
def one_process(tiny_train_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one-process")
    return {a: run_steps(build(a, tiny_train_model, out / a, DistInfo(), None)) for a in ALGORITHMS}


@pytest.mark.parametrize("parallel", ["ddp", "full_shard"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_two_processes_equal_one_process(algorithm, parallel, two_processes, one_process) -> None:
    ones, twos = one_process[algorithm], two_processes[0][f"{algorithm}-{parallel}"]
    assert len(ones) == len(twos) == 2
    for step, (one, two) in enumerate(zip(ones, twos, strict=True), start=1):
        where = f"{algorithm} under {parallel}, step {step}"
        if "completion_ids" in one:  # the same samples, or nothing below could hold
            assert two["completion_ids"] == one["completion_ids"], where
        if "advantages" in one:
            assert two["advantages"] == pytest.approx(one["advantages"], abs=TOL), where
        assert two["loss"] == pytest.approx(one["loss"], abs=TOL), where
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], abs=TOL), where
        assert one["grad_norm"] > 0.05  # so clipping did scale the gradient
        for kind in ("grads", "clipped"):
            assert set(two[kind]) == set(one[kind]), where
            for name, g in one[kind].items():
                assert torch.allclose(two[kind][name], g, rtol=0, atol=TOL), f"{where}: {kind} of {name}"
        if "evaluation" in one:  # held-out metrics over both ranks' rows
            one_eval, two_eval = dict(one["evaluation"]), dict(two["evaluation"])
            # Per-problem outcomes come back in the held-out set's order from both ranks' shares.
            assert "outcomes" not in one_eval or two_eval.pop("outcomes") == one_eval.pop("outcomes"), where
            assert one_eval and two_eval == pytest.approx(one_eval, rel=TOL, abs=TOL), where
        if "kl_coef" in one:
            assert one["kl_coef"] != 0.1 and two["kl_coef"] == pytest.approx(one["kl_coef"], rel=1e-6), where
        assert set(two["metrics"]) == set(one["metrics"]), where
        for name, value in one["metrics"].items():
            if name == "rewards/accuracies" and abs(one["metrics"]["rewards/margins"]) < TOL:
                # The policy is still its reference (DPO's step 1): every margin is float32 rounding
                # noise (one process: a rejected reward of -4.8e-8; two: exactly 0), and the share of
                # margins above 0 is the sign of that noise, which no two batch layouts need to share.
                continue
            assert two["metrics"][name] == pytest.approx(value, rel=TOL, abs=TOL, nan_ok=True), f"{where}: {name}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lora_under_ddp_equals_one_process(algorithm, two_processes, tiny_train_model, tmp_path) -> None:
    """Adapters on a frozen base: only adapter (and head) gradients exist, and they are the one-process ones."""
    ones = run_steps(build(algorithm, tiny_train_model, tmp_path / algorithm, DistInfo(), None, **LORA))
    twos = two_processes[0][f"{algorithm}-lora"]
    for step, (one, two) in enumerate(zip(ones, twos, strict=True), start=1):
        where = f"{algorithm} with LoRA under DDP, step {step}"
        if "completion_ids" in one:
            assert two["completion_ids"] == one["completion_ids"], where
        assert two["loss"] == pytest.approx(one["loss"], abs=TOL), where
        assert one["grads"] and all("lora_" in n or "score" in n or "value_head" in n for n in one["grads"]), where
        assert set(two["grads"]) == set(one["grads"]), where
        assert any(g.abs().max() > 0 for g in one["grads"].values()), where
        for name, g in one["grads"].items():
            assert torch.allclose(two["grads"][name], g, rtol=0, atol=TOL), f"{where}: gradient of {name}"


def test_kto_averages_its_kl_term_over_the_ranks(two_processes, tiny_train_model, tmp_path) -> None:
    """TRL gathers each process's KL estimate and takes their mean: the two ranks' micro-batch k (rows 2k, 2k+1
    and 4+2k, 5+2k of the first step's 8) share one z₀, computed here from one process's log-probs."""
    from pagedrl.train.algorithms.dpo import answer_logps
    from pagedrl.train.kto_losses import kto_loss

    two = two_processes[0]["kto-ddp"][0]
    algorithm = build("kto", tiny_train_model, tmp_path, DistInfo(), None).algorithm
    c, losses, kls = algorithm.config, [], []
    rewards: dict[str, list] = {"chosen": [], "rejected": []}
    per_rank: dict[str, list] = {"chosen": [], "rejected": []}  # each rank's own micro-batch means instead
    for k in range(2):
        batches = [algorithm.collate(algorithm.examples[start:start + 2]) for start in (2 * k, 4 + 2 * k)]
        with torch.no_grad():
            logps = [(answer_logps(algorithm.model, b).logps, algorithm.reference_logps(b)) for b in batches]
        means = torch.stack([(pi[2:] - ref[2:]).mean() for pi, ref in logps])
        assert abs(float(means[0] - means[1])) > 0.1  # each rank's own would give another loss: the check can fail
        kl = means.mean().clamp(min=0)
        kls.append(float(kl))
        for b, (pi, ref) in zip(batches, logps, strict=True):
            losses.append(kto_loss(pi[:2], ref[:2], b.desirable, kl, c.beta, c.loss_type).losses.sum())
        # TRL's metric of micro-batch k: its rows on both ranks pooled, one value counting 1 in the step's mean
        both = torch.cat([c.beta * (pi[:2] - ref[:2]) for pi, ref in logps])
        good = torch.cat([b.desirable for b in batches])
        for side, mask in (("chosen", good), ("rejected", ~good)):
            if bool(mask.any()):
                rewards[side].append((float(both[mask].sum()), int(mask.sum())))
            per_rank[side] += [float(r[m].mean()) for r, m in zip(both.split(2), mask.split(2), strict=True) if m.any()]
    assert min(kls) > 0.01  # the term is there to be checked
    assert two["loss"] == pytest.approx(float(sum(losses)) / 8, abs=TOL)
    assert two["metrics"]["kl"] == pytest.approx(sum(kls) / 2, abs=TOL)
    gaps = []
    for side, sums in rewards.items():
        expected = sum(t / n for t, n in sums) / len(sums)
        assert two["metrics"][f"rewards/{side}"] == pytest.approx(expected, abs=TOL), side
        gaps.append(abs(sum(per_rank[side]) / len(per_rank[side]) - expected))
    assert max(gaps) > 1e-4  # the ranks' means unpooled would log another number: the check can fail


@pytest.mark.parametrize(("dynamic_sampling", "scale_rewards"), [(False, "batch"), (True, "batch"), (True, "group")])
def test_grpo_batch_statistics_are_gathered_across_ranks(dynamic_sampling, scale_rewards, two_processes) -> None:
    """TRL gathers every process's rewards before its advantages; so do the ranks here: the
    advantages, the groups dynamic sampling keeps and its rounds are one process's."""
    two = two_processes[0][f"rollout-{dynamic_sampling}-{scale_rewards}"]
    one = rollout_statistics(DistInfo(), dynamic_sampling, scale_rewards)
    assert two["prompts"] == one["prompts"] and two["rounds"] == one["rounds"]
    assert two["advantages"] == pytest.approx(one["advantages"], abs=1e-6)
    if not dynamic_sampling:  # each rank's own std would give other advantages: the check can fail
        rewards = torch.tensor([[i % 3, i % 3 + (i % 2) * (1 + 9 * (i >= 3))] for i in range(6)], dtype=torch.float64)
        local = torch.cat([group_advantages(rewards[:3], scale_rewards="batch"),
                           group_advantages(rewards[3:], scale_rewards="batch")]).reshape(-1)
        assert not torch.allclose(local.float(), torch.tensor(two["advantages"]), atol=1e-3)


def test_the_engine_sees_whole_weights_for_a_rollout_and_shards_after(two_processes) -> None:
    states = two_processes[0]["full-weights"]
    assert states == {"before": True, "inside": True, "nested": True, "after_nested": True, "after": True}


def test_the_fsdp_option_takes_transformers_spelling() -> None:
    from pagedrl.train.config import TrainConfigError, load_config
    from pagedrl.train.offline_config import SFTConfig

    assert load_config(SFTConfig, None, ["fsdp=full_shard auto_wrap"]).fsdp_reshard_after_forward is True
    assert load_config(SFTConfig, None, ["fsdp=shard_grad_op"]).fsdp_reshard_after_forward is False
    assert load_config(SFTConfig, None, []).fsdp_reshard_after_forward is None
    with pytest.raises(TrainConfigError, match="fsdp: unknown option in 'hybrid_shard'"):
        load_config(SFTConfig, None, ["fsdp=hybrid_shard"])
    with pytest.raises(TrainConfigError, match="exactly one of full_shard or shard_grad_op"):
        load_config(SFTConfig, None, ["fsdp=full_shard shard_grad_op"])
    with pytest.raises(TrainConfigError, match="fsdp: LoRA .* under FSDP2 is not supported"):
        load_config(SFTConfig, None, ["fsdp=full_shard", "use_peft=true"])


@pytest.mark.parametrize("critic", ["policy", "shared"])
def test_ppo_saves_whole_policy_and_critic_under_fsdp(critic, two_processes, tiny_train_model, tmp_path) -> None:
    """The policy and the critic gathered from their shards equal what one process saves."""
    sharded = two_processes[1] / f"ppo-save-{critic}" / "checkpoint-0"
    one = build("ppo", tiny_train_model, tmp_path, DistInfo(), None, critic=critic)
    one.save_checkpoint()
    one.algorithm.close()
    for sub in ("", "critic"):
        mine, theirs = read_state_dict(tmp_path / "checkpoint-0" / sub), read_state_dict(sharded / sub)
        assert set(theirs) == set(mine) and all(torch.equal(theirs[k], v) for k, v in mine.items()), sub


def test_a_checkpoint_resumes_across_ddp_and_fsdp(two_processes) -> None:
    """SFT for three steps under DDP and under FSDP2, each saving every step; each run's step-1
    checkpoint resumed under the other continues as it did (step 3 needs AdamW's moments). The
    same for PPO from DDP to FSDP2: its prompts, KL coefficient, critic and value head come back."""
    out = two_processes[1]

    def rows(run: str) -> dict[int, dict]:
        return {r["step"]: r for r in map(json.loads, (out / run / "metrics.jsonl").read_text().splitlines())}

    ddp, fsdp = rows("run-ddp"), rows("run-full_shard")
    for step in (1, 2, 3):
        assert fsdp[step]["loss"] == pytest.approx(ddp[step]["loss"], abs=TOL)
    for first, resumed in (("run-ddp", "resumed-full_shard"), ("run-full_shard", "resumed-ddp"),
                           ("ppo-run-ddp", "ppo-resumed-full_shard")):
        a, b = rows(first), rows(resumed)
        assert sorted(b) == [2, 3]  # it started after step 1
        for step in (2, 3):
            assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=TOL), (resumed, step)
            assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], abs=TOL), (resumed, step)
    # The saved folders are whole Hugging Face checkpoints, the same whichever way they were sharded.
    for folder in ("checkpoint-1", "final"):
        saved = read_state_dict(out / "run-ddp" / folder)
        sharded = read_state_dict(out / "run-full_shard" / folder)
        assert set(saved) == set(sharded)
        for name, t in saved.items():
            assert torch.allclose(sharded[name], t, atol=1e-4), (folder, name)
