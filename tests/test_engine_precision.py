"""The engine computes in the precision it is asked for: under `autocast_dtype` its forward runs
under torch.autocast (as a trainer's bf16 autocast runs the same float32 module) and its KV cache
holds that dtype."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES

from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import EngineConfig
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM


def test_autocast_dtype_must_be_a_low_precision_float() -> None:
    with pytest.raises(ValueError, match="autocast_dtype"):
        EngineConfig(autocast_dtype=torch.float32).validate()


def test_bf16_autocast_engine_matches_a_dense_forward_under_the_same_autocast() -> None:
    """Greedy tokens and their log-probs equal those of a dense forward under bf16 autocast on the
    same float32 weights, and differ from the float32 engine's log-probs (the autocast is real)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])).eval()
    prompts = [torch.randint(3, 211, (n,)).tolist() for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM.from_module(model, kv_cache_tokens=512, autocast_dtype=torch.bfloat16, max_num_batched_tokens=23)
    assert llm.engine.kv_cache.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM.from_module(model, kv_cache_tokens=512).generate(prompts, params, use_tqdm=False)
    gap = 0.0
    for prompt, out, ref in zip(prompts, outs, plain, strict=True):
        comp = out.outputs[0]
        ids = torch.tensor([prompt + comp.token_ids])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logp = torch.log_softmax(model.logits(model(ids))[0, len(prompt) - 1:-1].float(), -1)
        assert comp.token_ids == logp.argmax(-1).tolist()
        dense = logp.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(comp.processed_logprobs), dense, atol=5e-4, rtol=0)
        if ref.outputs[0].token_ids == comp.token_ids:
            gap = max(gap, (torch.tensor(ref.outputs[0].processed_logprobs) - dense).abs().max().item())
    assert gap > 2e-3  # the float32 engine is 7e-3 away: a difference the check above would catch
