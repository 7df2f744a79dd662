"""Ctrl-C and SIGTERM sent to real `pagedrl sft` / `pagedrl grpo` processes mid-run: each stop
finishes its step, leaves a complete checkpoint, prints the command that resumes and exits with
128 + the signal number; resuming with that command twice ends bit-identical to a run that never
stopped. A second Ctrl-C stops at once and leaves nothing that looks complete."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_train import arithmetic_rows

from pagedrl.train import checkpointing as ckpt
from pagedrl.train.logging import read_metrics

SRC = Path(__file__).resolve().parents[1] / "src"
TIME_KEYS = {"wall_time", "train_time", "step_time", "rollout/seconds", "rollout/tokens_per_second"}
REWARDS = ("def token_sum(prompts, completions, completion_ids, **kw):\n"
           "    return [(sum(ids) % 7) / 7.0 for ids in completion_ids]\n")


def command(args: list[str]) -> list[str]:
    """`pagedrl ...` as this interpreter runs it, on this checkout's sources."""
    assert args[0] == "pagedrl"
    return [sys.executable, "-m", "pagedrl.cli", *args[1:]]


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    with log.open("w") as f:
        return subprocess.Popen(command(args), stdout=f, stderr=subprocess.STDOUT, env=env)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 120) -> tuple[int, str]:
    rc = proc.wait(timeout)
    return rc, log.read_text()


def logged_steps(output_dir: Path) -> int:
    try:
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)
    except (OSError, ValueError):
        return 0


def stop_after(proc: subprocess.Popen, output_dir: Path, step: int, signum: int) -> None:
    """Send `signum` once the run has logged `step` (it is running a later one by then)."""
    deadline = time.monotonic() + 60
    while logged_steps(output_dir) < step:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.005)
    proc.send_signal(signum)


def resume_args(output: str) -> list[str]:
    """The command the stopped run printed."""
    lines = output.splitlines()
    i = next(i for i, line in enumerate(lines) if line.endswith("to resume, run:"))
    return shlex.split(lines[i + 1])


def metric_rows(output_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIME_KEYS} for row in read_metrics(output_dir / "metrics.jsonl")]


def looks_complete(output_dir: Path) -> list[str]:
    """Folder names a loader could take for a finished save."""
    return sorted(p.name for p in output_dir.iterdir() if p.is_dir() and ckpt.is_complete(p))


def interrupted_twice_then_finished(args: list[str], out: Path, tmp_path: Path) -> None:
    """Run, SIGINT it, resume with the printed command, SIGTERM that, resume again to the end."""
    proc = start(args, tmp_path / "1.log")
    stop_after(proc, out, 3, signal.SIGINT)
    rc, output = finish(proc, tmp_path / "1.log")
    assert rc == 130, output
    assert "Traceback" not in output
    first = ckpt.latest_checkpoint(out)
    step = int(first.name.split("-")[1])
    assert step >= 3 and (first / ckpt.TRAINER_STATE_PT).is_file()
    assert f"stopped by SIGINT after step {step}; saved {first}" in output
    again = resume_args(output)
    assert again[-1] == f"resume_from_checkpoint={first.resolve()}" and again[2:-1] == args[2:]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no staging left behind

    proc = start(again, tmp_path / "2.log")
    stop_after(proc, out, step + 3, signal.SIGTERM)
    rc, output = finish(proc, tmp_path / "2.log")
    assert rc == 143, output
    second = ckpt.latest_checkpoint(out)
    assert int(second.name.split("-")[1]) >= step + 3
    assert f"stopped by SIGTERM after step {second.name.split('-')[1]}; saved {second}" in output

    rc, output = finish(start(resume_args(output), tmp_path / "3.log"), tmp_path / "3.log")
    assert rc == 0, output


def assert_same_run(a: Path, b: Path) -> None:
    assert metric_rows(a) == metric_rows(b)  # every step once, equal floats
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def sft_args(tiny_train_model, tmp_path_factory) -> list[str]:
    data = tmp_path_factory.mktemp("sft-data") / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows()))
    return ["pagedrl", "sft", f"model={tiny_train_model}", f"dataset={data}", "max_steps=60",
            "per_device_train_batch_size=4", "learning_rate=3e-3", "lr_scheduler_type=cosine", "warmup_steps=5",
            "weight_decay=0.1", "logging_steps=1", "save_steps=20", "save_total_limit=2", "report_to=[jsonl]"]


@pytest.fixture(scope="module")
def grpo_args(tiny_train_model, tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("grpo-data")
    (folder / "rewards.py").write_text(REWARDS)
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"what is {a} plus {b}"}) + "\n"
                                                  for a in range(4) for b in range(4)))
    return ["pagedrl", "grpo", f"model={tiny_train_model}", f"dataset={folder / 'prompts.jsonl'}",
            f"reward_funcs=[{folder / 'rewards.py'}:token_sum]", "num_generations=4", "temperature=1.0",
            "per_device_train_batch_size=8", "gradient_accumulation_steps=2", "max_completion_length=8",
            "learning_rate=1e-3", "max_steps=30", "logging_steps=1", "save_steps=1000", "report_to=[jsonl]"]


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_sigint_then_sigterm_save_and_resume_bit_for_bit(algorithm, sft_args, grpo_args, tmp_path) -> None:
    args = sft_args if algorithm == "sft" else grpo_args
    straight = tmp_path / "straight"
    rc, output = finish(start([*args, f"output_dir={straight}"], tmp_path / "0.log"), tmp_path / "0.log")
    assert rc == 0, output
    stopped = tmp_path / "stopped"
    interrupted_twice_then_finished([*args, f"output_dir={stopped}"], stopped, tmp_path)
    assert_same_run(straight, stopped)
    # sft: save_total_limit=2 also applies to the stops' saves; grpo (no limit): the two stops' and the last step's
    assert len(ckpt.list_checkpoints(stopped)) <= (2 if algorithm == "sft" else 3)


def test_second_sigint_stops_at_once_leaving_nothing_that_looks_complete(sft_args, tmp_path) -> None:
    """Steps long enough (16 micro-batches) that the second Ctrl-C, sent once the first one is
    acknowledged, lands before the step and its save are done."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    args = [a for a in sft_args if not a.startswith("max_steps=")]
    proc = start([*args, "max_steps=100000", "gradient_accumulation_steps=16", f"output_dir={out}"], log)
    stop_after(proc, out, 2, signal.SIGINT)
    deadline = time.monotonic() + 30
    while "SIGINT received: finishing step" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    rc, output = finish(proc, log, timeout=30)
    assert time.monotonic() - t0 < 8
    assert rc == 130 and "Traceback" not in output
    assert "stopped at once; nothing saved since the last checkpoint" in output
    assert "to resume" not in output
    assert looks_complete(out) == [] and not (out / "final").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_grpo_run_stopped_mid_rollout_gives_back_the_engine(tiny_train_model, grpo_args, tmp_path) -> None:
    """An exception inside generation (a second Ctrl-C) leaves no request running and no KV cache held."""
    from pagedrl.model.loader import load_model
    from pagedrl.train.algorithms.grpo import GRPO
    from pagedrl.train.cli import split_args
    from pagedrl.train.config import load_config
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.rl.config import GRPOConfig
    from pagedrl.train.trainer import Trainer

    _, overrides = split_args([*grpo_args[2:], f"output_dir={tmp_path}"])
    config = load_config(GRPOConfig, None, overrides)
    loaded = load_model(config.model)
    algorithm = GRPO(config, loaded.model, loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)
    engine = algorithm.llm.engine
    real_step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 20:  # the second rollout, mid-way
            assert engine.has_unfinished_requests() and engine.kv_cache.allocated
            raise KeyboardInterrupt
        return real_step()

    engine.step = step_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        Trainer(config, algorithm, progress=False).train()
    assert not engine.has_unfinished_requests() and not engine.kv_cache.allocated
    assert engine.kv_manager.num_blocks_used == 0
