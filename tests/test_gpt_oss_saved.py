"""A saved tiny gpt-oss folder (the trainers' tokenizer, a 4-token window the rows cross): the first
batch of DPO against transformers' own class on the same weights (loss and every parameter's gradient;
SFT with the router's load-balancing loss is `test_trainer_accumulation.py`'s), and `pagedrl serve`
answering the OpenAI client with the offline engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from first_batches import assert_first_dpo_batch_equals_transformers
from server_process import assert_serves_the_engines_text
from tiny_train import build_model_dir

GPT_OSS = dict(architectures=["GptOssForCausalLM"], sliding_window=4, head_dim=16, num_local_experts=4,
               num_experts_per_tok=2, intermediate_size=32, layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory) -> tuple[str, str]:
    """A policy and a different reference, both gpt-oss with the trainers' tokenizer."""
    root = tmp_path_factory.mktemp("gpt-oss")
    return (str(build_model_dir(root / "policy", seed=0, **GPT_OSS)),
            str(build_model_dir(root / "reference", seed=1, **GPT_OSS)))


def test_dpo_first_batch_equals_transformers(gpt_oss_dirs, tmp_path) -> None:
    assert_first_dpo_batch_equals_transformers(gpt_oss_dirs[0], gpt_oss_dirs[1], tmp_path / "out",
                                               longer_than=2 * 4,  # the window (4) is crossed
                                               router_aux_loss_coef=0.0)  # with it: test_moe_trl.py


def test_serve_answers_the_openai_client_with_the_offline_engines_tokens(gpt_oss_dirs, tmp_path) -> None:
    assert_serves_the_engines_text(gpt_oss_dirs[0], tmp_path, prompt="the cat sat on the mat and a dog ran in the park",
                                   kv_cache_tokens=512, max_tokens=6)


def test_grpo_rollouts_carry_the_trainers_log_probs(gpt_oss_dirs, tmp_path) -> None:
    """GRPO's first step: the engine's rollouts (paged, sinks and windows through the reference
    attention) and the trainer's packed recompute (each group's completions sharing one prompt) give
    every sampled token the same log-prob within float32 rounding; the loss is finite."""
    import json

    from test_grpo import REWARDS, grpo

    rows = [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}"}], "answer": a + b}
            for a in range(4) for b in range(2)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    algo = grpo(gpt_oss_dirs[0], prompts, temperature=1.0)
    batches = algo.step_batches(1)
    total = torch.tensor(float(sum(algo.count(b) for b in batches)))
    for b in batches:
        with torch.no_grad():
            trainer = b.to_padded(algo.token_logps(algo.model, b).logps)
        assert float((trainer - b.sampling_logps).abs()[b.mask].max()) < 1e-5
        assert torch.isfinite(algo.loss(algo.model, b, total)[0])
