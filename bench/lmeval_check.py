"""lm-evaluation-harness against a real `pagedrl serve` process, checked against transformers.

lm-eval (its own environment: `bench/lmeval_env.sh`) evaluates the default model through pagedrl's
server as a vLLM user would: `local-completions` with the server's own tokenizer
(`tokenizer_backend=remote`: `/tokenizer_info`, `/tokenize`, `/detokenize`) for a multiple-choice
task, which sends token ids with `echo`, `logprobs` and `max_tokens: 0` and reads the prompt
log-probs; and `local-chat-completions` for a generation task (greedy, exact match). No dataset can
be downloaded here, so both tasks are written from the built-in arithmetic task into a local folder
(`dataset_path: json`).

The reference is transformers on the same weights, in this process: for every multiple-choice
request lm-eval logged (context and continuation), the continuation's log-likelihood and whether it
is the greedy one, tokenised as lm-eval tokenises a pair; for every generation request, greedy
`generate` on the chat template's prompt. Printed: lm-eval's scores, the largest log-likelihood
difference, and how many choices / generations differ.

    bash bench/lmeval_env.sh                       # once: lm-eval in /work/.lmeval
    .venv/bin/python bench/lmeval_check.py [--num-docs 100] [--out runs/lmeval]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MC_TASK = """task: pagedrl_arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is {{{{a}}}} + {{{{b}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """task: pagedrl_arith_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "What is {{{{a}}}} + {{{{b}}}}? Reply with the number only."
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 16
  do_sample: false
  temperature: 0
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path, num_docs: int, seed: int = 0) -> None:
    """Two-digit sums; the multiple-choice distractors are near misses (±1, ±10) in a seeded order.
    The generation task scores the last number of the reply (the model tends to restate the sum)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(num_docs):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        s = a + b
        options = [s, s + rng.choice([-1, 1]), s + rng.choice([-10, 10]), s + rng.choice([-11, 9, 2])]
        rng.shuffle(options)
        rows.append({"a": a, "b": b, "answer": str(s), "choices": [str(o) for o in options],
                     "gold": options.index(s)})
    (folder / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = str((folder / "arith.jsonl").resolve())
    (folder / "pagedrl_arith_mc.yaml").write_text(MC_TASK.format(data=data))
    (folder / "pagedrl_arith_gen.yaml").write_text(GEN_TASK.format(data=data))


def run_lm_eval(lm_eval: Path, model_type: str, base_url: str, task: str, tasks_dir: Path, out: Path,
                extra: list[str]) -> tuple[dict, list[dict], float]:
    args = (f"model=smollm2-135m-instruct,base_url={base_url},tokenizer_backend=remote,num_concurrent=4,"
            "max_retries=1,tokenized_requests=" + ("True" if model_type == "local-completions" else "False"))
    cmd = [str(lm_eval), "--model", model_type, "--model_args", args, "--tasks", task,
           "--include_path", str(tasks_dir), "--log_samples", "--output_path", str(out / task), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                                                                   "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        (out / f"{task}.log").write_text(proc.stdout + proc.stderr)
        raise SystemExit(f"lm_eval failed ({proc.returncode}), its output: {out / f'{task}.log'}")
    results = json.loads(next((out / task).rglob("results_*.json")).read_text())
    samples = [json.loads(line) for p in (out / task).rglob(f"samples_{task}_*.jsonl")
               for line in p.read_text().splitlines()]
    return results["results"][task], samples, seconds


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: trailing spaces of the context move to the continuation; the
    continuation's ids are those of the whole after the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    ctx, cont = encode_pair(tokenizer, context, continuation)
    ids = torch.tensor([ctx + cont])
    logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].double(), dim=-1)
    target = torch.tensor(cont)
    chosen = logp.gather(-1, target[:, None]).squeeze(-1)
    return float(chosen.sum()), bool((logp.argmax(-1) == target).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-docs", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("runs/lmeval"))
    parser.add_argument("--lm-eval", type=Path, default=Path(os.environ.get("LMEVAL_VENV", "/work/.lmeval")) / "bin/lm_eval")
    args = parser.parse_args()
    import transformers
    from server_process import running_server

    from pagedrl.model.resolve import resolve_model_path

    torch.manual_seed(0)
    folder = resolve_model_path(None)
    tasks_dir = args.out / "tasks"
    write_tasks(tasks_dir, args.num_docs)
    with running_server(folder, args.out, "--served-model-name", "smollm2-135m-instruct",
                        "--kv-cache-tokens", "16384") as server:
        mc, mc_samples, mc_s = run_lm_eval(args.lm_eval, "local-completions", server.base_url + "/v1/completions",
                                           "pagedrl_arith_mc", tasks_dir, args.out, [])
        gen, gen_samples, gen_s = run_lm_eval(args.lm_eval, "local-chat-completions",
                                              server.base_url + "/v1/chat/completions", "pagedrl_arith_gen",
                                              tasks_dir, args.out, ["--apply_chat_template"])
    print(f"lm-eval local-completions, pagedrl_arith_mc ({len(mc_samples)} docs, {mc_s:.0f} s): "
          f"acc {mc['acc,none']:.4f}, acc_norm {mc['acc_norm,none']:.4f}")
    print(f"lm-eval local-chat-completions, pagedrl_arith_gen ({len(gen_samples)} docs, {gen_s:.0f} s): "
          f"exact_match {gen['exact_match,first_number']:.4f}")

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    worst, greedy_diff, choice_diff, ref_correct = 0.0, 0, 0, 0
    for sample in mc_samples:
        ours, ref = [], []
        for request, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            ll, greedy = resp[0]  # logged as strings
            ref_ll, ref_greedy = reference_loglikelihood(model, tokenizer, request["arg_0"], request["arg_1"])
            worst = max(worst, abs(float(ll) - ref_ll))
            greedy_diff += int((str(greedy) == "True") != ref_greedy)
            ours.append(float(ll))
            ref.append(ref_ll)
        choice_diff += int(max(range(len(ours)), key=ours.__getitem__) != max(range(len(ref)), key=ref.__getitem__))
        ref_correct += int(max(range(len(ref)), key=ref.__getitem__) == sample["doc"]["gold"])
    print(f"transformers on the same requests: acc {ref_correct / len(mc_samples):.4f}; largest log-likelihood "
          f"difference {worst:.2e}; is_greedy differs on {greedy_diff}; the chosen answer differs on {choice_diff} "
          f"of {len(mc_samples)} docs")

    gen_differs = 0
    for sample in gen_samples:
        doc = sample["doc"]
        messages = [{"role": "user", "content": f"What is {doc['a']} + {doc['b']}? Reply with the number only."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        gen_differs += int(text != sample["resps"][0][0])
    print(f"transformers greedy generation differs on {gen_differs} of {len(gen_samples)} chat requests")


if __name__ == "__main__":
    main()
