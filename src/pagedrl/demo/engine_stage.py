"""The demo's first stage: one workload (mixed-length requests and an n-sample request from one long
prompt) through pagedrl's engine and transformers' static batches, then the prefix-sharing count.
Returns plain numbers (written to `stages/paged.json`) and the KV snapshot the picture is drawn from.
With `--quantization` the engine's weights are loaded as `serve --quantization` loads them; the
transformers peer keeps the float weights, and the report says which ran."""

from __future__ import annotations

import dataclasses
import gc
import random
from typing import Any

from pagedrl.demo.paged import (
    Request,
    fit_tokens,
    load_transformers_model,
    make_workload,
    prefix_sharing,
    run_pagedrl,
    run_transformers,
)
from pagedrl.demo.plan import DemoPlan
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams


def demo_workload(plan: DemoPlan, vocab: int) -> list[Request]:
    rng = random.Random(plan.seed + 7)
    long_prompt = [rng.randrange(16, vocab) for _ in range(plan.long_prompt_tokens)]
    return [Request(long_prompt, plan.n_sample_tokens, n=plan.n_samples),
            *make_workload(plan.num_requests, plan.scale, vocab, seed=plan.seed)]


def measure_paged(plan: DemoPlan) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("the static-batching baseline needs transformers: pip install transformers "
                         "(make demo installs it)") from None
    from pagedrl.model.loader import load_model
    from pagedrl.model.resolve import resolve_model_path

    loaded = load_model(plan.model, quantization=plan.quantization)
    model, tokenizer = loaded.model, loaded.tokenizer
    workload = demo_workload(plan, model.config.vocab_size)
    block_size = 16
    llm = LLM.from_module(model, tokenizer, eos_token_ids=loaded.eos_token_ids, block_size=block_size,
                          kv_cache_tokens=fit_tokens(workload, block_size), seed=plan.seed)
    llm.generate([workload[1].prompt[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    ours = run_pagedrl(llm, workload, seed=plan.seed)
    preemptions = llm.stats()["num_preemptions"]
    del llm
    gc.collect()
    # the same precision; a quantized engine's peer runs the float weights (transformers keeps none quantized)
    hf, pad = load_transformers_model(resolve_model_path(plan.model), model.dtype)
    run_transformers(hf, workload[1:3], 2, pad)  # warm-up
    peer, peer_kv = run_transformers(hf, workload, plan.hf_batch_size, pad)
    del hf
    gc.collect()
    sharing = prefix_sharing(model, tokenizer, workload[0].prompt, plan.n_samples, plan.n_sample_tokens, block_size)
    assert ours.snapshot is not None
    return {
        "num_requests": len(workload), "num_sequences": sum(r.n for r in workload),
        "precision": loaded.precision.describe(), "quantization": plan.quantization,
        "prompt_tokens": ours.prompt_tokens, "output_tokens": ours.output_tokens,
        "pagedrl_seconds": ours.seconds, "pagedrl_output_tps": ours.output_tps, "pagedrl_steps": len(ours.kv_live),
        "pagedrl_preemptions": preemptions, "pagedrl_kv_utilisation": ours.kv_utilisation,
        "transformers_seconds": peer.seconds, "transformers_output_tps": peer.output_tps,
        "transformers_batch_size": plan.hf_batch_size, "transformers_kv_utilisation": peer_kv,
        "throughput_ratio": ours.output_tps / peer.output_tps,
        "prefix": dataclasses.asdict(sharing),
        "snapshot": dataclasses.asdict(ours.snapshot),
    }
