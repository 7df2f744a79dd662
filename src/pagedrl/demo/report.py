"""The demo's report: `report.md`, a self-contained `report.html` (PNGs embedded as data URIs, opens
offline) and `report.json` (every number the two documents show). Everything is read back from what
the stages wrote: `stages/*.json`, each method's `metrics.jsonl` and its saved weights."""

from __future__ import annotations

import base64
import html
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from pagedrl.demo.calibrate import describe as describe_calibration
from pagedrl.demo.pictures import accuracy_picture, kv_picture, throughput_picture
from pagedrl.demo.plan import DemoPlan
from pagedrl.demo.verdict import rankings, verdict_lines
from pagedrl.kernels.isa import describe as describe_isa
from pagedrl.train.logging import read_metrics
from pagedrl.train.significance import compare, wilson_interval

METHODS = ("GRPO", "DPO", "RLHF")


def trainable_parameters(folder: Path) -> int:
    """Parameters saved in a checkpoint folder's safetensors (the weights training changed; 0 if
    the folder is absent, as a critic sharing the policy's backbone)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                total += _numel(st.get_slice(key).get_shape())
    return total


def cpu_name() -> str:
    """The processor's model name (Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def curve(rows: list[dict[str, Any]], offset_minutes: float, base: float) -> list[tuple[float, float]]:
    """(training minutes, accuracy) at each evaluation, starting from the base model's accuracy."""
    points = [(offset_minutes, base)]
    for r in rows:
        if r.get("eval/accuracy") is not None:
            points.append((offset_minutes + r["train_time"] / 60, r["eval/accuracy"]))
    return points


def final_outcomes(folder: Path, rows: list[dict[str, Any]]) -> list[float]:
    """The per-problem scores of a method's last evaluation (`eval_outcomes.jsonl`), checked to be
    the evaluation its last `eval/accuracy` row reports."""
    from pagedrl.train.logging import EVAL_OUTCOMES_FILE

    path = folder / EVAL_OUTCOMES_FILE
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    if not records or not evals or records[-1]["step"] != evals[-1]["step"]:
        raise ValueError(f"{path}: its last evaluation does not match the last eval/accuracy of {folder / 'metrics.jsonl'}")
    return [float("nan") if v is None else float(v) for v in records[-1]["outcomes"]]


def intervals(curve_points: list[tuple[float, float]], n: int) -> list[tuple[float, float]]:
    """Wilson 95% intervals of a curve's accuracies on `n` problems."""
    return [wilson_interval(round(y * n), n) for _, y in curve_points]


def summed(rows: list[dict[str, Any]], key: str) -> float:
    return float(sum(r[key] for r in rows if r.get(key) is not None))


def last_step(rows: list[dict[str, Any]]) -> int:
    return max((int(r["step"]) for r in rows), default=0)


def collect(plan: DemoPlan) -> dict[str, Any]:
    """Every number of the report, from the files the stages wrote."""
    out = plan.out
    stage = {p.stem: json.loads(p.read_text()) for p in sorted((out / "stages").glob("*.json"))}
    paged, pairs = stage["paged"]["result"], stage["pairs"]["result"]
    metrics = {name: read_metrics(out / name / "metrics.jsonl") for name in ("grpo", "dpo", "rm", "ppo")}
    base = pairs["base_accuracy"]
    rm_minutes = max((r["train_time"] for r in metrics["rm"]), default=0.0) / 60
    curves = {"GRPO": curve(metrics["grpo"], 0.0, base), "DPO": curve(metrics["dpo"], 0.0, base),
              "RLHF": curve(metrics["ppo"], rm_minutes, base)}
    grpo, dpo, ppo = plan.grpo(), plan.dpo(), plan.ppo()
    grpo_steps, dpo_steps, rm_steps, ppo_steps = (last_step(metrics[k]) for k in ("grpo", "dpo", "rm", "ppo"))
    ppo_models = 1 + int(ppo.kl_coef > 0) + int(ppo.reward_model_path is not None) + int(ppo.critic_init != "shared")
    methods = {
        "GRPO": {
            "models in memory": 1 + int(grpo.beta > 0),
            "trainable parameters": trainable_parameters(out / "grpo" / "final"),
            "forward passes per step": f"{1 + int(grpo.beta > 0) + int(grpo.num_iterations > 1)} "
                                       f"(policy with grad{', reference' if grpo.beta > 0 else ''})",
            "data it needs": "prompts + a verifier",
            "optimizer steps": grpo_steps,
            "samples generated": int(summed(metrics["grpo"], "rollout/sampled_completions"))
            or grpo_steps * grpo.per_device_train_batch_size * grpo.gradient_accumulation_steps,
            "KV blocks saved by prefix sharing": int(summed(metrics["grpo"], "rollout/prefix_blocks_shared")),
            "peak memory (GiB)": stage["grpo"]["peak_memory_bytes"] / 2**30,
            "wall time (min)": stage["grpo"]["seconds"] / 60,
            "training time (min)": max((r["train_time"] for r in metrics["grpo"]), default=0.0) / 60,
            "accuracy before": base, "accuracy after": curves["GRPO"][-1][1],
        },
        "DPO": {
            "models in memory": 1 + int(not dpo.precompute_ref_log_probs),
            "trainable parameters": trainable_parameters(out / "dpo" / "final"),
            "forward passes per step": f"{1 + int(not dpo.precompute_ref_log_probs)} (policy with grad, reference)",
            "data it needs": f"{pairs['pairs']:.0f} labelled pairs",
            "optimizer steps": dpo_steps,
            "samples generated": int(pairs["completions"]),
            "KV blocks saved by prefix sharing": int(pairs["prefix_blocks_shared"]),
            "peak memory (GiB)": stage["dpo"]["peak_memory_bytes"] / 2**30,
            "wall time (min)": stage["dpo"]["seconds"] / 60,
            "training time (min)": max((r["train_time"] for r in metrics["dpo"]), default=0.0) / 60,
            "accuracy before": base, "accuracy after": curves["DPO"][-1][1],
        },
        "RLHF": {
            "models in memory": ppo_models,
            "trainable parameters": trainable_parameters(out / "ppo" / "final")
            + trainable_parameters(out / "ppo" / "final" / "critic") + trainable_parameters(out / "rm" / "final"),
            "forward passes per step": f"{2 + int(ppo.kl_coef > 0) + int(ppo.reward_model_path is not None)} "
                                       "(policy+critic with grad; rollout's policy+critic, reference, reward model)",
            "data it needs": f"{pairs['pairs']:.0f} labelled pairs -> a reward model",
            "optimizer steps": rm_steps + ppo_steps,
            "samples generated": int(pairs["completions"]) + ppo_steps * ppo.per_device_train_batch_size
            * ppo.gradient_accumulation_steps * ppo.num_mini_batches,
            "KV blocks saved by prefix sharing": int(pairs["prefix_blocks_shared"])
            + int(summed(metrics["ppo"], "rollout/prefix_blocks_shared")),
            "peak memory (GiB)": max(stage["rm"]["peak_memory_bytes"], stage["ppo"]["peak_memory_bytes"]) / 2**30,
            "wall time (min)": (stage["rm"]["seconds"] + stage["ppo"]["seconds"]) / 60,
            "training time (min)": rm_minutes + max((r["train_time"] for r in metrics["ppo"]), default=0.0) / 60,
            "accuracy before": base, "accuracy after": curves["RLHF"][-1][1],
        },
    }
    base_outcomes = pairs["base_outcomes"]
    tests, outcomes = {}, {}
    for name, folder in (("GRPO", "grpo"), ("DPO", "dpo"), ("RLHF", "ppo")):
        after = final_outcomes(out / folder, metrics[folder])
        outcomes[name] = {"before": base_outcomes, "after": after}
        tests[name] = compare([v >= 1.0 for v in base_outcomes], [v >= 1.0 for v in after])
    significance = {name: t.to_dict() for name, t in tests.items()}
    budgets = {name: m["training time (min)"] for name, m in methods.items()} if plan.grpo_max_steps \
        else plan.budget_minutes
    verdict = verdict_lines(methods, tests, curves, budgets)
    n = len(base_outcomes)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{cpu_name()}, {os.cpu_count()} cores"
    return {"plan": json.loads(plan.to_json()), "paged": paged, "pairs": pairs, "methods": methods, "curves": curves,
            "curve_intervals": {name: intervals(points, n) for name, points in curves.items()},
            "significance": significance, "outcomes": outcomes, "rankings": rankings(methods, tests),
            "verdict": verdict,
            "stages": {k: {"seconds": v["seconds"], "peak_memory_bytes": v["peak_memory_bytes"]} for k, v in stage.items()},
            "machine": f"{platform.system()} {platform.machine()}, {device}, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads",
            "cpu_class": describe_isa(), "calibration": describe_calibration(plan)}


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def method_table(data: dict[str, Any]) -> list[list[str]]:
    methods = data["methods"]
    keys = [k for k in methods["GRPO"] if k not in ("accuracy before", "accuracy after")]
    rows = [["", *METHODS]]
    rows += [[k, *(fmt(methods[m][k]) for m in METHODS)] for k in keys]
    rows.append(["held-out accuracy", *(f"{fmt(methods[m]['accuracy before'])} -> {fmt(methods[m]['accuracy after'])}"
                                        for m in METHODS)])
    sig = data["significance"]
    rows.append(["95% interval (Wilson), before -> after", *(f"{ci(sig[m]['interval_before'])} -> "
                                                            f"{ci(sig[m]['interval_after'])}" for m in METHODS)])
    rows.append(["problems fixed / broken by training", *(f"{sig[m]['fixed']} / {sig[m]['broken']}" for m in METHODS)])
    rows.append(["McNemar exact test", *(f"p = {sig[m]['p_value']:.2g}: {sig[m]['verdict']}" for m in METHODS)])
    return rows


def ci(bounds: list[float] | tuple[float, float]) -> str:
    return f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def paged_table(p: dict[str, Any]) -> list[list[str]]:
    s = p["prefix"]
    return [
        ["", "transformers (static batches)", "pagedrl", "ratio"],
        ["output tokens/s", fmt(p["transformers_output_tps"]), fmt(p["pagedrl_output_tps"]),
         f"{p['throughput_ratio']:.2f}x"],
        ["KV slots holding live tokens", f"{p['transformers_kv_utilisation']:.1%}", f"{p['pagedrl_kv_utilisation']:.1%}",
         ""],
        [f"peak KV blocks, n={s['n']} samples of one {s['prompt_tokens']}-token prompt", f"{s['unshared']} (no sharing)",
         f"{s['shared']} (prompt blocks forked; ideal {s['ideal']})", f"{s['unshared'] / s['shared']:.2f}x"],
        *([["precision (both sides)", "", p["precision"], ""]] if "precision" in p and not p.get("quantization") else []),
        *([["weights", "float (not quantized)", f"--quantization {p['quantization']}: {p['precision']}", ""]]
          if p.get("quantization") else []),
    ]


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(plan: DemoPlan) -> Path:
    data = collect(plan)
    out = plan.out
    images = {"accuracy": accuracy_picture(data["curves"], data["curve_intervals"], out / "accuracy.png",
                                           data["plan"]["num_eval"]),
              "kv_cache": kv_picture(data["paged"]["snapshot"], out / "kv_cache.png"),
              "throughput": throughput_picture(data["paged"], out / "throughput.png")}
    p, pairs = data["paged"], data["pairs"]
    intro = (f"`pagedrl demo{' --quick' if plan.quick else ''}` on {plan.model}, {data['machine']}; CPU class "
             f"{data['cpu_class']}. Every number below was measured in this run.")
    part1 = (f"{p['num_requests']} requests ({p['num_sequences']} sequences: mixed lengths, plus {p['prefix']['n']} "
             f"samples of one long prompt), {p['prompt_tokens']} prompt and {p['output_tokens']} output tokens, "
             f"greedy with ignore_eos, through both engines in the same process.")
    budget = ("each method's optimizer steps chosen by the calibration below (the table gives the minutes they "
              "took; evaluations excluded)"
              if plan.grpo_max_steps else f"{plan.budget_minutes:g} training minutes per method (evaluations excluded")
    part2 = (f"From the same model, {budget}; RLHF's are shared by its reward model and PPO. Held-out accuracy on {data['plan']['num_eval']} "
             f"problems, greedy, with the engine, with 95% Wilson intervals; before -> after is tested on the same "
             f"problems with McNemar's exact test (p < 0.05: significant). The pairs for DPO and the reward model: "
             f"{pairs['completions']:.0f} completions sampled from the base model ({plan.pair_generations} per prompt "
             f"at temperature {plan.pair_temperature:g}), {round(pairs['correct_share'] * pairs['completions'])} of "
             f"them correct ({pairs['correct_share']:.1%}), {pairs['prompts_with_a_pair']:.0f} prompts with both a "
             f"correct and a wrong one, {pairs['pairs']:.0f} correct-over-wrong pairs (at most "
             f"{plan.pairs_per_prompt} per prompt).")
    sections = [
        ("Paged attention, measured", part1, [paged_table(p)], ["throughput", "kv_cache"]),
        ("Alignment, side by side: GRPO vs DPO vs RLHF", part2 + (f" Calibration: {data['calibration']}"
                                                                  if data["calibration"] else ""),
         [method_table(data)], ["accuracy"]),
        ("Verdict", "Computed from the numbers above.", [], []),
    ]
    md = [f"# pagedrl demo\n\n{intro}\n"]
    body = [f"<h1>pagedrl demo</h1><p>{html.escape(intro)}</p>"]
    for title, text, tables, pics in sections:
        md.append(f"## {title}\n\n{text}\n")
        body.append(f"<h2>{html.escape(title)}</h2><p>{html.escape(text)}</p>")
        for t in tables:
            md.append(markdown_table(t) + "\n")
            body.append(html_table(t))
        if title == "Verdict":
            md += [f"- {line}" for line in data["verdict"]] + [""]
            body.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in data["verdict"]) + "</ul>")
        for name in pics:
            md.append(f"![{name}]({images[name].name})\n")
            encoded = base64.b64encode(images[name].read_bytes()).decode("ascii")
            body.append(f'<p><img alt="{name}" src="data:image/png;base64,{encoded}"></p>')
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}td:first-child{text-align:left}"
             "img{max-width:100%}")
    (out / "report.html").write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>pagedrl demo</title>"
                                     f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n",
                                     encoding="utf-8")
    (out / "report.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return out / "report.md"
