"""What each choice of GRPO's training layout saves: forward + backward time of one step's batch.

One rollout from the engine (the default SmolLM2-135M-Instruct, 8 arithmetic prompts x G = 8,
64-token completions, temperature 1.0), cut into 4 micro-batches of 16 completions as
`examples/grpo_arithmetic.yaml` does, then the log-probs of the completion tokens and their
gradient computed four ways:

  padded        each completion a row [prompt + completion], padded to the micro-batch's longest,
                logits over the whole completion span, padding included (TRL's layout)
  packed        no padding: one packed row, each completion with its own copy of the prompt,
                logits only where a completion token needs its log-prob
  shared        as packed, but each group's prompt once (its completions attend to one copy of the
                prompt's keys and values; autograd sums their gradients): pagedrl's layout
  shared+all    as shared, but the LM head and log-softmax on every row

All four give the same log-probs (checked here, max |diff| printed). Times are the median of
`--repeats` runs after one warm-up, float32, on torch's default threads.

    .venv/bin/python bench/bench_grpo_layout.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from pagedrl import LLM, SamplingParams
from pagedrl.model.attention import DenseAttention
from pagedrl.train.data import load_examples
from pagedrl.train.examples import PromptRows
from pagedrl.train.rl.arithmetic import ArithmeticTask
from pagedrl.train.rl.packing import PackedBatch, Unit, pack, split_units
from pagedrl.train.rl.rollout import Rollout, sample

G, PROMPTS, LENGTH, MICRO_BATCHES = 8, 8, 64, 4


def unit_rows(rollout: Rollout, units: list[Unit]) -> list[tuple[list[int], list[int]]]:
    return [(rollout.prompts[u.prompt].prompt_ids, rollout.completion_ids[i]) for u in units for i in u.completions]


def padded_logps(model, rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """[N] log-probs from a right-padded batch (prompt + completion per row), logits over the
    completion span of every row, as TRL computes them."""
    P = max(len(p) for p, _ in rows)
    L = max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), P + L, dtype=torch.long)
    mask = torch.zeros(len(rows), P + L, dtype=torch.long)
    for r, (p, c) in enumerate(rows):  # prompts left-padded to P, completions right-padded to L
        ids[r, P - len(p):P + len(c)] = torch.tensor(p + c)
        mask[r, P - len(p):P + len(c)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model(ids, positions=positions, meta=DenseAttention.causal(mask))
    logits = model.logits(hidden[:, P - 1:P + L - 1])  # [B, L, V]: padding included
    targets = ids[:, P:P + L]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    keep = mask[:, P:P + L].bool()
    return logps[keep]


def padded_tokens(rows: list[tuple[list[int], list[int]]]) -> int:
    return len(rows) * (max(len(p) for p, _ in rows) + max(len(c) for _, c in rows))


def packed_logps(model, batch: PackedBatch, all_rows: bool = False) -> torch.Tensor:
    hidden = model(batch.input_ids, positions=batch.positions, meta=batch.meta)[0]
    if all_rows:
        logps = torch.log_softmax(model.logits(hidden).float(), -1)
        return logps.index_select(0, batch.predict_at).gather(-1, batch.targets[:, None])[:, 0]
    logits = model.logits(hidden.index_select(0, batch.predict_at))
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.targets[:, None])[:, 0]


def one_copy_per_completion(units: list[Unit]) -> list[Unit]:
    return [Unit(u.prompt, [i]) for u in units for i in u.completions]


def time_step(model, micro_batches: list, fn: Callable, repeats: int) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of forward + backward over every micro-batch, and the log-probs of the last run."""
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        out = []
        start = time.perf_counter()
        for mb in micro_batches:
            logps = fn(mb)
            (-logps.sum()).backward()
            out.append(logps.detach())
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM()
    model, tokenizer = llm.engine.model, llm.tokenizer
    task = ArithmeticTask(seed=42)
    stream = task.train_rows()
    rows, _ = load_examples([next(stream) for _ in range(PROMPTS)], PromptRows(tokenizer, None))
    params = SamplingParams(n=G, temperature=1.0, max_tokens=LENGTH, seed=0)
    rollout = sample(llm, rows, params)
    del llm
    model.train().requires_grad_(True)
    units = split_units(rollout, MICRO_BATCHES)
    prompt_tokens = sum(len(p.prompt_ids) for p in rollout.prompts)
    completion_tokens = rollout.generated_tokens
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"one step: {PROMPTS} prompts ({prompt_tokens} tokens) x G={G}, {completion_tokens} completion tokens "
          f"(mean {completion_tokens / (PROMPTS * G):.1f}, max {LENGTH}), {MICRO_BATCHES} micro-batches")
    cpu = torch.device("cpu")
    shared = [pack(rollout, u, cpu) for u in units]
    packed = [pack(rollout, one_copy_per_completion(u), cpu) for u in units]
    padded = [unit_rows(rollout, u) for u in units]
    layouts = {
        "padded": (padded, lambda rows: padded_logps(model, rows), sum(padded_tokens(rows) for rows in padded)),
        "packed": (packed, lambda b: packed_logps(model, b), sum(b.input_ids.numel() for b in packed)),
        "shared": (shared, lambda b: packed_logps(model, b), sum(b.input_ids.numel() for b in shared)),
        "shared+all": (shared, lambda b: packed_logps(model, b, all_rows=True), sum(b.input_ids.numel() for b in shared)),
    }
    results = {}
    reference = None
    for name, (mbs, fn, tokens) in layouts.items():
        seconds, logps = time_step(model, mbs, fn, args.repeats)
        flat = torch.cat(logps)
        diff = 0.0 if reference is None else (flat - reference).abs().max().item()
        reference = flat if reference is None else reference
        results[name] = seconds
        print(f"{name:11s} {tokens:6d} tokens through the model  forward+backward {seconds:6.2f} s  "
              f"(padded / this {results['padded'] / seconds:4.2f}x)  log-probs max|diff| vs padded {diff:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
