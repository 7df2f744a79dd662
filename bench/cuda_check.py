"""The CUDA path, checked and measured in one run on a machine with a GPU.

1. Correctness (float32, TF32 off): for each tiny family of the reference tests, the engine's greedy
   output on the GPU against transformers' greedy `generate` on the same GPU, and the logprob contract
   (sampled-token log-probs against a dense recompute, temperature 0.7, top-p 0.8).
2. Throughput (bfloat16): the workload of `bench_engine.py` (256 requests, prompts 16-512, outputs
   16-256, ignore_eos) through `LLM.generate` and through transformers' static batches, on a
   SmolLM2-135M-shaped model. The weights are random (a GPU machine may hold no checkpoint): with
   `ignore_eos` the work is the same as with the real weights.
3. GRPO: a few steps of `run_grpo` on the same model folder (random weights, real tokenizer and chat
   template), with step time, generation time and peak GPU memory.

    PYTHONPATH=src python3 bench/cuda_check.py --model-dir DIR [--parts correctness,throughput,grpo]

DIR holds `config.json`, the tokenizer and chat template of a model; when it has no weights, random
ones are written there first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def correctness() -> None:
    from test_engine_greedy import prompts
    from tiny import FAMILIES, hf_model

    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampler import processed_logprobs
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    for name, raw in sorted(FAMILIES.items()):
        hf = hf_model(raw).to(device)
        batch = prompts(hf.config.vocab_size)
        ref = []
        for ids in batch:
            with torch.no_grad():
                gen = hf.generate(torch.tensor([ids], device=device), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                  pad_token_id=0)
            ref.append(gen[0, len(ids):].tolist())
        model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
        model.load_state_dict({k: v.cpu() for k, v in hf.state_dict().items()}, strict=False)
        model = model.to(device).eval()
        ids = torch.tensor([batch[5]], device=device)
        with torch.no_grad():
            logit_diff = (model.logits(model(ids)) - hf(ids).logits).abs().max().item()
        llm = LLM.from_module(model, max_num_batched_tokens=37, kv_cache_tokens=1024)
        outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        eos = hf.config.eos_token_id
        ref = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
        same = sum(g == r for g, r in zip(got, ref, strict=True))
        params = SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, seed=3, n=2, ignore_eos=True)
        worst = 0.0
        for prompt, out in zip(batch[:3], llm.generate(batch[:3], params, use_tqdm=False), strict=True):
            for comp in out.outputs:
                full = torch.tensor([prompt + comp.token_ids], device=device)
                with torch.no_grad():
                    logits = model.logits(model(full))[0, len(prompt) - 1:-1]
                dense = processed_logprobs(logits, torch.tensor(comp.token_ids, device=device), temperature=0.7,
                                           top_p=0.8)
                worst = max(worst, (torch.tensor(comp.processed_logprobs, device=device) - dense).abs().max().item())
        print(f"[correctness] {name:20s} logits max|diff| {logit_diff:.2e} | greedy equal to transformers on "
              f"{same}/{len(batch)} prompts | logprob contract max|diff| {worst:.2e}", flush=True)


def ensure_weights(model_dir: Path) -> Path:
    """`model_dir` if it has weights, else a copy of it with random ones (written once)."""
    if (model_dir / "model.safetensors").exists():
        return model_dir
    out = Path(tempfile.gettempdir()) / f"pagedrl-random-{model_dir.name}"
    if (out / "model.safetensors").exists():
        return out
    from pagedrl.model.checkpoint import save_checkpoint
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return save_checkpoint(model, out, tokenizer_dir=model_dir)


def throughput(model_dir: Path, batch_size: int) -> None:
    import bench_engine
    import transformers

    from pagedrl import LLM

    llm = LLM(model=str(model_dir), dtype=torch.bfloat16, device="cuda")
    vocab = llm.engine.model.config.vocab_size
    workload = bench_engine.make_workload(256, 1.0, vocab)
    llm.generate([[100, 200, 300]], bench_engine.SamplingParams(max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    ours = bench_engine.run_pagedrl(llm, workload)
    stats = llm.stats()
    kv = llm.engine.kv_manager.num_blocks_total * llm.engine.config.block_size
    print(f"[throughput] pagedrl: {ours.seconds:.1f} s, {len(ours.kv_live)} steps, {kv} KV tokens, "
          f"{stats['num_preemptions']} preemptions, KV slots live {ours.kv_utilisation:.1%}", flush=True)
    del llm
    torch.cuda.empty_cache()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to("cuda").eval()
    bench_engine.run_transformers(hf, workload[:2], 2, 0)
    peer, peer_kv = bench_engine.run_transformers(hf, workload, batch_size, 0)
    print(f"[throughput] transformers static batches of {batch_size}: {peer.seconds:.1f} s, "
          f"KV rows live {peer_kv:.1%}", flush=True)
    print(f"[throughput] output tok/s: transformers {peer.output_tps:.0f} | pagedrl {ours.output_tps:.0f} | "
          f"ratio {ours.output_tps / peer.output_tps:.2f}x", flush=True)
    print(f"[throughput] total tok/s:  transformers {peer.total_tps:.0f} | pagedrl {ours.total_tps:.0f} | "
          f"ratio {ours.total_tps / peer.total_tps:.2f}x", flush=True)
    del hf
    torch.cuda.empty_cache()


def grpo(model_dir: Path, steps: int) -> None:
    from pagedrl.train.algorithms.grpo import run_grpo
    from pagedrl.train.rl.config import GRPOConfig

    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(model=str(model_dir), dataset="arithmetic", output_dir=out, num_generations=8,
                            per_device_train_batch_size=16, gradient_accumulation_steps=4,
                            max_completion_length=64, temperature=1.0, learning_rate=1e-5, max_steps=steps,
                            beta=0.0, logging_steps=1, save_steps=10_000, report_to=["jsonl"], task_num_eval=64,
                            kv_cache_tokens=16384)
        start = time.perf_counter()
        run_grpo(config, progress=False)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    for r in rows:
        print(f"[grpo] step {r.get('step')}: {r['step_time']:.2f} s, rollout {r['rollout/seconds']:.2f} s, "
              f"{r['rollout/tokens_per_second']:.0f} tok/s, logp diff mean "
              f"{r.get('sampling/sampling_logp_difference/mean', float('nan')):.2e}", flush=True)
    print(f"[grpo] {steps} steps in {wall:.1f} s (load and evaluations included), peak GPU memory "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--parts", default="correctness,throughput,grpo")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--grpo-steps", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    parts = {
        "correctness": correctness,
        "throughput": lambda: throughput(ensure_weights(args.model_dir), args.hf_batch_size),
        "grpo": lambda: grpo(ensure_weights(args.model_dir), args.grpo_steps),
    }
    failed = False
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            parts[name]()
        except Exception:
            failed = True
            traceback.print_exc()
        print(f"[{name}] took {time.perf_counter() - start:.1f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
