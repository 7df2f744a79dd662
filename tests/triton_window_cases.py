"""The Triton kernel under a layer's rules (sliding window, soft-capped scores, attention sinks) against
the reference path, on the CPU under Triton's interpreter (run by tests/test_triton_attention.py with
TRITON_INTERPRET=1, as triton_interpreted_cases.py is). The blocks every window has left hold NaN: the
kernel must not read them. float32 and float16 (the interpreter has no bfloat16)."""

from __future__ import annotations

import dataclasses
import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run these cases with TRITON_INTERPRET=1 set before python starts")

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import FAMILIES, hf_model  # noqa: E402
from window_batches import BLOCK, make_batch  # noqa: E402

from pagedrl.engine.attention import PagedAttention  # noqa: E402
from pagedrl.engine.llm import LLM  # noqa: E402
from pagedrl.engine.sampling_params import SamplingParams  # noqa: E402
from pagedrl.model.config import ModelConfig  # noqa: E402
from pagedrl.model.decoder import CausalLM  # noqa: E402

# float32: IEEE products, sums in other orders. float16: the kernel rounds probabilities to float16 before
# the value product (2^-11 relative each) and its output once more; outputs are within a few units of 1.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap", "sinks"), [
    (5, None, False), (16, None, False), (23, 20.0, False), (40, None, True), (None, 30.0, True), (1, None, True),
])
def test_rules_equal_the_reference(dtype: torch.dtype, window: int | None, softcap: float | None, sinks: bool) -> None:
    """Decodes at several offsets in a block, a fresh prompt longer than a query tile, a chunk of a
    prompt over a cached prefix; 3 query heads per KV head; head_dim 24 (padded)."""
    shapes = [(40, 1), (47, 1), (16, 1), (3, 1), (0, 70), (37, 21)]
    cache, seqs, q, k, v = make_batch(shapes, 6, 2, 24, dtype, window, 11)
    sink = torch.randn(6, generator=torch.Generator().manual_seed(2)) * 2 if sinks else None
    before = cache.data.clone()
    outs = []
    for impl in ("triton", "reference"):
        cache.data.copy_(before)
        meta = dataclasses.replace(PagedAttention.build(cache, BLOCK, seqs, impl=impl), windows=(window,),
                                   softcap=softcap)
        outs.append(meta.attend(0, q, k, v, sink).float())
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0], outs[1], atol=TOLERANCE[dtype], rtol=0)


def test_engine_with_one_window_in_every_layer_equals_reference() -> None:
    """A tiny Mistral with a window of 24 served past it through the Triton kernel (chunked prefill of 16
    tokens a step, blocks freed as they leave the window): the reference path's greedy tokens."""
    hf = hf_model(dict(FAMILIES["mistral"], sliding_window=24))
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    model.eval()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 211, (n,), generator=gen).tolist() for n in (60, 9, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = {}
    for impl in ("reference", "triton"):
        llm = LLM.from_module(model, kv_cache_tokens=512, max_num_batched_tokens=16, attention_impl=impl)
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["reference"]
