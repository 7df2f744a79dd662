"""GRPO on the in-process engine: packing, the logprob contract, shared tensors, a full run, bad input."""

from __future__ import annotations

import json
import math

import decoder_bound
import pytest
import torch
from float_bounds import U

from pagedrl.engine.logits_processing import processed_logprobs
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model
from pagedrl.train.adapters import attach_lora
from pagedrl.train.algorithms.grpo import GRPO, run_grpo
from pagedrl.train.distributed import DistInfo
from pagedrl.train.examples import PromptOnly
from pagedrl.train.rl.config import GRPOConfig
from pagedrl.train.rl.online import rollout_engine_args, rollout_kv_tokens
from pagedrl.train.rl.packing import pack, split_units
from pagedrl.train.rl.rollout import Rollout
from pagedrl.train.tokenization import tokenize_prompt

REWARDS = (
    "def has_three(prompts, completions, completion_ids, answer, **kw):\n"
    "    return [1.0 if str(a) in c[-1]['content'] else 0.0 for c, a in zip(completions, answer)]\n"
    "def token_sum(prompts, completions, completion_ids, **kw):\n"
    "    return [(sum(ids) % 7) / 7.0 for ids in completion_ids]\n"
    "def raises(prompts, completions, completion_ids, **kw):\n"
    "    raise KeyError('answer')\n"
)


@pytest.fixture()
def prompts_file(tmp_path):
    return write_prompts(tmp_path)


def write_prompts(folder):
    """16 arithmetic prompts (`prompts.jsonl`) and the reward functions of REWARDS (`rewards.py`) in `folder`."""
    rows = [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}"}], "answer": a + b}
            for a in range(4) for b in range(4)]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "rewards.py").write_text(REWARDS)
    return path


def grpo(model_dir, prompts_file, **fields) -> GRPO:
    defaults = dict(model=str(model_dir), dataset=str(prompts_file), eval_dataset=str(prompts_file),
                    output_dir=str(prompts_file.parent / "out"), num_generations=4,
                    per_device_train_batch_size=8, gradient_accumulation_steps=2, max_completion_length=12,
                    reward_funcs=[f"{prompts_file.parent}/rewards.py:has_three",
                                  f"{prompts_file.parent}/rewards.py:token_sum"],
                    learning_rate=1e-3, logging_steps=1, save_steps=100)
    config = GRPOConfig(**{**defaults, **fields})
    loaded = load_model(model_dir)
    attach_lora(config, loaded.model)  # with use_peft: as a run attaches them (train/trainer.py)
    return GRPO(config, loaded.model.train(), loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)


def exact_logps(model, b, sampling: SamplingParams | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact log-probs [N] of a packed batch's targets (under `sampling`'s distribution, else the
    model's own) and the bound of any float32 forward's (`decoder_bound`: ~3e-5 here, where a token
    attending to another completion's tokens, or a position off by one, moves them by 1e-2)."""
    probed = decoder_bound.logits(model, b.input_ids, positions=b.positions, allowed=b.meta.mask)
    rows = probed.map(lambda v: v[0, b.predict_at])
    if sampling is None:
        return decoder_bound.sampled_logprobs(rows, b.targets)
    return decoder_bound.sampled_logprobs(rows, b.targets, sampling.temperature, sampling.top_k, sampling.top_p)


def test_packed_group_gives_the_logps_of_separate_sequences(tiny_train_model) -> None:
    """Completions packed after one shared prompt see exactly what they would see alone: both are
    within float32's bound of the exact forward of each sequence."""
    model = load_model(tiny_train_model).model
    g = torch.Generator().manual_seed(0)
    lens = [3, 5, 1, 6, 2, 4]  # 2 prompts x G = 3
    prompts = [PromptOnly(torch.randint(3, 200, (p,), generator=g).tolist(), "", "") for p in (7, 4)]
    rollout = Rollout(prompts, 3, [torch.randint(3, 200, (n,), generator=g).tolist() for n in lens], [""] * 6,
                      [[0.0] * n for n in lens], torch.zeros(6, dtype=torch.bool))
    for units in split_units(rollout, 4):  # the second group is cut across micro-batches
        b = pack(rollout, units, torch.device("cpu"))
        with torch.no_grad():
            hidden = model(b.input_ids, positions=b.positions, meta=b.meta)
            packed = torch.log_softmax(model.logits(hidden[0, b.predict_at]), -1)
            packed = packed.gather(-1, b.targets[:, None])[:, 0]
            last = hidden[0, b.last_at]
        expected, expected_last = [], []
        for unit in units:
            for i in unit.completions:
                prompt_ids, comp = rollout.prompts[unit.prompt].prompt_ids, rollout.completion_ids[i]
                with torch.no_grad():
                    alone = model(torch.tensor([prompt_ids + comp]))[0]
                    lp = torch.log_softmax(model.logits(alone), -1)
                p = len(prompt_ids)
                expected += [float(lp[p - 1 + j, t]) for j, t in enumerate(comp)]
                expected_last.append(alone[-1])
        exact, bound = exact_logps(model, b)
        for logps in (packed, torch.tensor(expected)):
            assert ((logps.double() - exact).abs() <= bound).all()
        states = decoder_bound.hidden_states(model, b.input_ids, positions=b.positions, allowed=b.meta.mask)
        states = states.map(lambda v, at=b.last_at: v[0, at])  # where a sequence is scored
        for got in (last, torch.stack(expected_last)):
            assert ((got.double() - states.exact).abs() <= states.bound()).all()
        assert b.input_ids.shape[1] == sum(len(rollout.prompts[u.prompt].prompt_ids)
                                           + sum(len(rollout.completion_ids[i]) for i in u.completions) for u in units)


def test_first_step_ratio_is_one_and_engine_agrees_with_trainer(tiny_train_model, prompts_file) -> None:
    assert_first_step_ratio_is_one(tiny_train_model, prompts_file)


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_mixture_of_experts_first_step_ratio_is_one(tmp_path, prompts_file, architecture: str) -> None:
    """The same for a mixture of experts (8 experts, 2 a token): the engine's rollouts group tokens by
    expert in other batches than the trainer's packed recompute, with the same log-probs."""
    from tiny_train import build_model_dir

    moe = dict(num_local_experts=8) if architecture == "MixtralForCausalLM" else \
        dict(num_experts=8, moe_intermediate_size=32)
    model_dir = build_model_dir(tmp_path / "moe", architectures=[architecture], num_experts_per_tok=2, **moe)
    assert_first_step_ratio_is_one(model_dir, prompts_file)


def assert_first_step_ratio_is_one(model_dir, prompts_file, **fields) -> GRPO:
    """`fields` with use_peft: the adapters' B drawn first, so the adapted model is not the base."""
    from tiny import randomise_adapter

    algo = grpo(model_dir, prompts_file, temperature=0.7, top_p=0.9, top_k=20, **fields)
    randomise_adapter(algo.model)
    batches = algo.step_batches(1)
    total = torch.tensor(float(sum(algo.count(b) for b in batches)))
    for b in batches:
        with torch.no_grad():
            flat = algo.token_logps(algo.model, b).logps
        trainer = b.to_padded(flat)
        exact, bound = (b.to_padded(t) for t in exact_logps(algo.model, b, algo.sampling))
        decided = torch.isfinite(bound) & b.mask
        assert decided.sum() >= 0.9 * b.mask.sum()  # top-k/top-p cuts float32 cannot move: not vacuous
        for logp in (trainer, b.sampling_logps):  # the trainer's and the engine's
            assert ((logp.double() - exact).abs() <= bound)[b.mask].all()
        loss, metrics = algo.loss(algo.model, b, total)
        assert torch.isfinite(loss)
        # the logged max of |trainer - engine|: at most two bounds where the cut is decided; where it
        # is not, the two may keep other tokens, and the metric is what they differ by
        gap = (trainer - b.sampling_logps).abs().double()
        limit = 2 * bound[decided].max() + gap.masked_fill(decided | ~b.mask, 0).max()
        assert float(metrics["sampling/sampling_logp_difference/max"].total) <= float(limit)
        assert float(metrics["clip_ratio/region_mean"].total) == 0.0  # ratio exactly 1: nothing clipped
    return algo


def bf16_rollout_gaps(algo: GRPO) -> tuple[torch.Tensor, list[float]]:
    """The trainer's recompute under bf16 autocast against the sampled log-probs of one rollout:
    every token's |difference|, and the loss's `sampling_logp_difference/max` of each batch."""
    batches = algo.step_batches(1)
    total = torch.tensor(float(sum(algo.count(b) for b in batches)))
    gaps, logged = [], []
    for b in batches:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            flat = algo.token_logps(algo.model, b).logps
            _, metrics = algo.loss(algo.model, b, total)
        gaps.append((b.to_padded(flat) - b.sampling_logps).abs()[b.mask])
        logged.append(float(metrics["sampling/sampling_logp_difference/max"].total))
    return torch.cat(gaps), logged


def test_bf16_rollouts_carry_the_trainers_own_log_probs(wide_train_model, prompts_file) -> None:
    """Training under bf16 autocast on a CPU: the engine samples under the same autocast from the same
    float32 master tensors, batch-invariantly by default (`model/batch_invariant.py`), so the
    trainer's packed recompute gives every sampled log-prob again bit for bit, though the engine
    computed each token in a decode batch of its own size. Without batch invariance the same
    rollout is off by bf16's roundings (the logprob contract's gap this pins)."""
    algo = grpo(wide_train_model, prompts_file, temperature=0.7, bf16=True, seed=3)
    assert algo.batch_invariant and algo.model.model.batch_invariant
    assert algo.llm.engine.model is algo.model and next(algo.model.parameters()).dtype == torch.float32
    assert algo.llm.engine.kv_cache.dtype == torch.bfloat16
    gap, logged = bf16_rollout_gaps(algo)
    assert gap.numel() > 40 and float(gap.max()) == 0.0 and max(logged) == 0.0

    plain = grpo(wide_train_model, prompts_file, temperature=0.7, bf16=True, seed=3, batch_invariant=False)
    assert not plain.model.model.batch_invariant
    gap, logged = bf16_rollout_gaps(plain)
    assert float(gap.max()) > 1e-3 and max(logged) > 1e-3  # what batch invariance removes (here 2e-2)
    # A statistic of the kernels, not a rounding bound: most tokens' products round alike in a decode
    # batch and in a packed one, so the mean gap stays far below one token's bf16 bound (~0.2 nats on
    # this model, from `rounding_steps.AUTOCAST`, too costly to compute here: a minute of float64).
    assert float(gap.mean()) < 1e-3


def test_bf16_lora_rollouts_carry_the_trainers_own_log_probs(wide_train_model, prompts_file) -> None:
    """The same with LoRA adapters (their down-projection and the fused addmm are batch-invariant
    too). lora_dropout 0: a dropout mask drawn in training is a difference of its own."""
    algo = grpo(wide_train_model, prompts_file, temperature=0.7, bf16=True, seed=3, use_peft=True, lora_r=8,
                lora_dropout=0.0)
    gap, logged = bf16_rollout_gaps(algo)
    assert gap.numel() > 40 and float(gap.max()) == 0.0 and max(logged) == 0.0


def test_fixed_logps_are_taken_under_the_trainers_autocast(tiny_train_model, prompts_file) -> None:
    """Under bf16 the reference's log-probs and the ratio's denominator (num_iterations > 1) come from
    the same autocast as the loss: before the first update both equal the policy's own, bit for bit
    (a float32 pass would be ~1e-3 away on this model and bias the KL and the ratio)."""
    algo = grpo(tiny_train_model, prompts_file, temperature=0.7, bf16=True, num_iterations=2, beta=0.1)
    for b in algo.step_batches(1):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            now = b.to_padded(algo.token_logps(algo.model, b).logps).masked_fill(~b.mask, 0)
        assert torch.equal(b.old_logps.masked_fill(~b.mask, 0), now)
        assert torch.equal(b.ref_logps.masked_fill(~b.mask, 0), now)
        with torch.no_grad():
            plain = b.to_padded(algo.token_logps(algo.model, b).logps).masked_fill(~b.mask, 0)
        assert not torch.equal(plain, now)


def test_rollout_kv_is_sized_to_one_step(tiny_train_model, prompts_file) -> None:
    """With no budget given, the engine's cache holds one step's rollout at once: no preemption, and
    not the host-sized default of a serving engine."""
    algo = grpo(tiny_train_model, prompts_file, max_prompt_length=64)
    kv_tokens = algo.llm.stats()["num_blocks_total"] * algo.llm.engine.config.block_size
    # 4 prompts x 64 tokens + 16 completions x (12 + 16)
    assert kv_tokens == rollout_kv_tokens(algo.config, algo.prompts_per_step) == 4 * 64 + 16 * 28
    algo.step_batches(1)
    assert algo.llm.stats()["num_preemptions"] == 0
    assert grpo(tiny_train_model, prompts_file, kv_cache_tokens=160).llm.stats()["num_blocks_total"] == 10


def test_without_max_prompt_length_the_model_s_context_is_the_limit(tiny_train_model, prompts_file) -> None:
    """TRL's GRPOConfig has no prompt limit: unset, any prompt that leaves the model (a 256-token context)
    room for a completion token is taken, longer ones are named at load (they failed mid-run in the
    engine), and the rollout's cache is sized to the longest prompt the dataset holds."""
    assert GRPOConfig().max_prompt_length is None
    held_out = prompts_file.parent / "held_out.jsonl"  # evaluation's prompts go through the same engine
    held_out.write_text(json.dumps({"prompt": "one two three " * 40, "answer": 1}) + "\n")
    algo = grpo(tiny_train_model, prompts_file, eval_dataset=str(held_out))
    longest_eval = len(algo.eval_rows[0].prompt_ids)
    assert algo.longest_prompt == longest_eval > max(len(r.prompt_ids) for r in algo.source.rows)
    assert rollout_kv_tokens(algo.config, 4, longest_prompt=700) == 4 * 700 + 4 * 4 * (12 + 16)
    assert rollout_engine_args(algo.config, 4, False, False, longest_prompt=700).kv_cache_tokens == 4 * 700 + 4 * 4 * 28
    assert rollout_kv_tokens(algo.config, 4, longest_prompt=20) == 4 * 512 + 4 * 4 * (12 + 16)
    long = prompts_file.parent / "long.jsonl"
    long.write_text(json.dumps({"prompt": "one two three " * 200, "answer": 1}) + "\n")
    with pytest.raises(ValueError, match=r"long.jsonl:1: prompt: \d+ tokens, longer than the model's context less one "
                                         r"token \(max_prompt_length unset\)=255"):
        grpo(tiny_train_model, long)


def test_engine_runs_on_the_trainers_tensors(tiny_train_model, prompts_file) -> None:
    algo = grpo(tiny_train_model, prompts_file)
    engine_model = algo.llm.engine.model
    assert engine_model is algo.model
    prompt = tokenize_prompt(algo.tokenizer, [{"role": "user", "content": "what is 2 plus 2 " * 6}])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = algo.llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    hits = algo.llm.stats()["prefix_cache_hits"]
    algo.llm.generate([prompt], greedy, use_tqdm=False)
    assert algo.llm.stats()["prefix_cache_hits"] > hits  # same weights: the prompt's blocks are reused
    # An optimizer step changes the parameters in place; the engine sees it without any copy.
    opt = torch.optim.SGD(algo.model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(1)
    for p in algo.model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.1
    opt.step()  # updates the parameters in place, as any optimizer does
    algo.after_optimizer_step(1)
    hits = algo.llm.stats()["prefix_cache_hits"]
    after = algo.llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert algo.llm.stats()["prefix_cache_hits"] == hits  # old KV is never reused after the update
    assert after != before
    with torch.no_grad():
        logits = algo.model.logits(algo.model(torch.tensor([prompt + after])))[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == after  # the engine's greedy tokens are the new weights' argmax


def test_a_short_run_logs_trl_metrics(tiny_train_model, prompts_file) -> None:
    config = GRPOConfig(model=str(tiny_train_model), dataset=str(prompts_file), eval_dataset=str(prompts_file),
                        output_dir=str(prompts_file.parent / "run"), num_generations=4,
                        per_device_train_batch_size=8, gradient_accumulation_steps=2, max_completion_length=10,
                        reward_funcs=[f"{prompts_file.parent}/rewards.py:has_three",
                                      f"{prompts_file.parent}/rewards.py:token_sum"], beta=0.04,
                        epsilon_high=0.28, num_iterations=2, max_steps=2, eval_steps=2, logging_steps=1,
                        save_steps=100, learning_rate=1e-3, report_to=["jsonl"])
    final = run_grpo(config, progress=False)
    assert (final / "config.json").is_file()
    rows = [json.loads(line) for line in (prompts_file.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    train = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    for name in ("reward", "reward_std", "rewards/has_three/mean", "rewards/token_sum/mean", "rewards/has_three/std",
                 "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean", "step_time", "rollout/tokens_per_second", "rollout/prefix_blocks_shared",
                 "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "wall_time", "train_time"):
        assert name in train[0], name
    assert train[0]["rollout/prefix_blocks_shared"] > 0
    # policy == reference before any update: their log-probs, two float32 forwards of the same
    # weights, differ by d <= 1e-4 (twice `decoder_bound`'s ~3e-5 on this model, and more), and k3 = exp(d) - d
    # - 1 ~ d^2 / 2 <= 5e-9, plus its float32 roundings near 1 (the exp, two subtractions: 3 U = 2e-7)
    assert train[0]["kl"] == pytest.approx(0.0, abs=(3 * U + 5e-9) * 1.01)  # 1%: the mean's own rounding
    assert train[1]["kl"] > 0  # μ = 2: the second step reuses the rollout after one update
    samples = [json.loads(line) for line in (prompts_file.parent / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [1] * 4 + [2] * 4  # num_completions_to_print per logged step
    assert set(samples[0]) == {"step", "prompt", "completion", "has_three", "token_sum", "advantage"}
    assert samples[0]["prompt"].startswith("what is") and isinstance(samples[0]["completion"], str)


def test_bad_input_names_what_and_where(tiny_train_model, prompts_file, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok", "answer": 1}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: prompt: missing"):
        grpo(tiny_train_model, bad)
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: prompt: \d+ tokens, longer than max_prompt_length=5"):
        grpo(tiny_train_model, prompts_file, max_prompt_length=5)
    algo = grpo(tiny_train_model, prompts_file)
    algo.reward_funcs = [("raises", algo.reward_funcs[0][1].__globals__["raises"])]
    with pytest.raises(ValueError, match="reward function 'raises' raised KeyError"):
        algo.step_batches(1)
    with pytest.raises(ValueError, match="num_generations"):
        grpo(tiny_train_model, prompts_file, per_device_train_batch_size=6, gradient_accumulation_steps=1)


def test_processed_logprobs_is_what_the_engine_reports(tiny_train_model) -> None:
    """The trainer's recompute function and the engine share one code path (the logprob contract)."""
    logits = torch.randn(5, 50, dtype=torch.float64)
    tokens = torch.tensor([0, 3, 7, 9, 49])
    lp = processed_logprobs(logits, tokens, temperature=2.0)
    assert torch.allclose(lp, torch.log_softmax(logits / 2.0, -1).gather(-1, tokens[:, None])[:, 0])


def test_temperature_below_the_engine_floor_is_refused(tiny_train_model, prompts_file) -> None:
    """The engine raises a tiny temperature to its floor; the trainer must not recompute with another."""
    with pytest.raises(ValueError, match="temperature: must be at least 0.01"):
        grpo(tiny_train_model, prompts_file, temperature=0.005)


def test_trainer_logprobs_read_the_rollouts_own_sampling_params(tiny_train_model, prompts_file) -> None:
    """With temperature and top-k, the recomputed log-probs are those the engine sampled from."""
    algo = grpo(tiny_train_model, prompts_file, temperature=0.7, top_k=5)
    assert algo.sampling.temperature == 0.7 and algo.sampling.top_k == 5
    for b in algo.step_batches(1):
        with torch.no_grad():
            trainer = b.to_padded(algo.token_logps(algo.model, b).logps)
        exact, bound = (b.to_padded(t) for t in exact_logps(algo.model, b, algo.sampling))
        assert (torch.isfinite(bound) & b.mask).sum() >= 0.9 * b.mask.sum()  # top-k cuts decided: not vacuous
        for logp in (trainer, b.sampling_logps):  # the trainer's and the engine's
            assert ((logp.double() - exact).abs() <= bound)[b.mask].all()


def test_reference_logprobs_are_computed_once_per_rollout(tiny_train_model, prompts_file) -> None:
    algo = grpo(tiny_train_model, prompts_file, beta=0.1, num_iterations=2)
    calls = []
    algo.ref_model.register_forward_hook(lambda *_: calls.append(1))
    first = algo.step_batches(1)
    for step in (1, 2):  # μ = 2: the second step trains on the same rollout
        batches = first if step == 1 else algo.step_batches(step)
        assert batches is first
        for b in batches:
            algo.loss(algo.model, b, torch.tensor(float(algo.count(b))))
    assert len(calls) == len(first) == 2  # one reference forward per micro-batch of the rollout


def test_reward_std_is_trls_nanstd_of_the_batch() -> None:
    from trl.trainer.utils import nanstd

    from pagedrl.train.algorithms.grpo import _batch_stds
    from pagedrl.train.distributed import DistInfo

    rewards = torch.tensor([[1.0, 0.0, float("nan"), 1.0], [0.5, 0.5, 0.25, float("nan")]], dtype=torch.float64)
    kept = [1.0, 0.0, 1.0, 0.5, 0.5, 0.25]
    mean = sum(kept) / 6
    by_hand = math.sqrt(sum((x - mean) ** 2 for x in kept) / 5)  # Bessel's
    one = DistInfo(device=torch.device("cpu"))
    assert _batch_stds([rewards.flatten()], one)[0] == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(float(nanstd(rewards.flatten())), rel=1e-6)  # TRL's (float32 inside)
    assert _batch_stds([torch.tensor([2.0, float("nan")])], one) == [0.0]  # one value: no spread
    # (two processes logging what one does: tests/test_parallel.py)
