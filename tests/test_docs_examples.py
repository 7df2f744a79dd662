"""Every shell and Python example in README.md and docs/*.md either runs here or is listed in EXCLUDED
with the reason it cannot: a page that shows a command keeps showing one that works.

A block is named by its page and a piece of its text. RUN lists the blocks that run offline in seconds
(on the embedded default model, whose weights `make setup` installs); EXCLUDED the rest. A block in
neither list, or an entry that names no block (the page changed), fails the suite, so a new example
is sorted into one of the two when it is written.

Shell blocks run with `bash -e` and the environment's `bin/` first on PATH; Python blocks in a fresh
interpreter. A block that names `.venv/bin/...`, `bench/` or `examples/` runs from the repository root
(`"root"`), the others from an empty folder (`"tmp"`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(bash|sh|shell|console|python|py)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
PYTHON = ("python", "py")

# (page, a piece of the block's text) -> where the block runs from.
RUN: dict[tuple[str, str], str] = {
    ("docs/benchmarks.md", "bench/bench_engine.py --help"): "root",
    ("docs/cpu.md", "pagedrl.kernels.isa below"): "root",
    ("docs/serving.md", "llm = LLM()  # the embedded default"): "tmp",
    ("docs/serving.md", 'generate --prompt "What is the capital of France?" --max-tokens 32'): "root",
    ("docs/serving.md", "StructuredOutputsParams(json=schema)"): "tmp",
    ("docs/serving.md", "BeamSearchParams(beam_width=3, max_tokens=8)"): "tmp",
    ("docs/serving.md", 'bad_words=["Paris"]'): "tmp",
}

TRAINS = "trains for minutes (the trainers' tests run each algorithm on a tiny model: tests/test_sft.py, " \
         "test_grpo.py, test_dpo.py, test_ppo.py, test_lora_training.py)"
TRAINED = "needs the adapters that the training commands above write to runs/ " \
          "(tests/test_multi_lora.py and tests/test_server_lora.py serve adapters made on a tiny model)"
RM_TRAINED = "needs the reward model `pagedrl rm` writes to runs/rm/final (tests/test_pooling.py makes the same " \
             "calls on a classifier transformers wrote, offline and through a server)"
# (page, a piece of the block's text) -> why it does not run in the test suite.
EXCLUDED: dict[tuple[str, str], str] = {
    ("README.md", "make demo"): "reinstalls if the environment is stale, then runs the demo for about 7 minutes; "
                                "tests/test_demo.py runs every stage of it on a tiny model",
    ("README.md", "pagedrl grpo examples/grpo_arithmetic.yaml"): TRAINS + "; eval and serve read its checkpoint",
    ("docs/benchmarks.md", "--no-fit --parts throughput,kv"): "a benchmark: minutes on a 2-core CPU",
    ("docs/cpu.md", "make test-isa CPU_CLASSES=avx2"): "`make test` runs it itself after the suite (the isa tests again as every "
                                      "lower CPU class, minutes)",
    ("docs/demo.md", ".venv/bin/pagedrl demo --quick"): "the demo runs for 7 to 40 minutes; tests/test_demo.py "
                                                        "runs its stages on a tiny model",
    ("docs/distributed.md", "torchrun --nproc_per_node 2"): TRAINS + "; config.yaml is the reader's own "
                                                            "(tests/test_trainer_ddp.py runs two processes)",
    ("docs/getting-started.md", "make setup"): "reinstalls the environment the suite runs in",
    ("docs/gpu.md", "pip install torch"): "a GPU machine's set-up: downloads and replaces torch",
    ("docs/lora.md", "use_peft=true learning_rate=1e-4"): TRAINS,
    ("docs/lora.md", "use_peft=true load_in_4bit=true"): TRAINS,
    ("docs/lora.md", "lora_target_parameters=[mlp.experts"): TRAINS + "; config.yaml is the reader's own "
                                                               "(tests/test_expert_lora.py trains tiny mixtures of experts)",
    ("docs/lora.md", "--adapter runs/grpo/final"): TRAINED + "; `serve` runs until stopped",
    ("docs/lora.md", 'adapter="runs/grpo/final"'): TRAINED,
    ("docs/lora.md", "--lora-modules math="): TRAINED + "; a server that runs until stopped",
    ("docs/lora.md", 'LoRARequest("math", 1'): TRAINED,
    ("docs/serving.md", "generate Qwen/Qwen2.5-0.5B-Instruct"): "downloads a model from the Hub",
    ("docs/serving.md", "pagedrl serve --port 8000"): "a server that runs until stopped (tests/test_server_*.py "
                                                      "start one and send it these requests)",
    ("docs/serving.md", "message.reasoning, r.choices[0]"): "a client of a running Qwen3 server "
                                                            "(tests/test_server_reasoning.py runs the same calls)",
    ("docs/serving.md", 'instructions="Answer in one sentence."'): "a client of a running server "
                                                                     "(tests/test_server_responses.py starts one and "
                                                                     "sends it such requests)",
    ("docs/serving.md", "background=True)"): "a client of a running server with --enable-responses-store "
                                             "(tests/test_server_responses.py runs background responses)",
    ("docs/serving.md", 'LLM("runs/rm/final", runner="pooling")'): RM_TRAINED,
    ("docs/serving.md", "serve runs/rm/final --runner pooling"): RM_TRAINED + "; a server that runs until stopped",
    ("docs/serving.md", "lm_eval --model local-completions"): "needs lm-evaluation-harness (not a dependency) "
                                                              "and a running server",
    ("docs/training.md", "pagedrl sft  config.yaml dataset=data.jsonl"): TRAINS,
}


@dataclass(frozen=True)
class Block:
    page: str
    lang: str
    text: str
    line: int

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            found.append(Block(path.relative_to(ROOT).as_posix(), m.group(1), m.group(2),
                               text.count("\n", 0, m.start()) + 1))
    return found


def entries_for(block: Block, table: dict[tuple[str, str], str]) -> list[tuple[str, str]]:
    return [key for key in table if key[0] == block.page and key[1] in block.text]


def runnable() -> list[tuple[Block, str]]:
    out = []
    for block in blocks():
        keys = entries_for(block, RUN)
        if keys:
            out.append((block, RUN[keys[0]]))
    return out


def test_every_example_runs_or_is_excluded_with_a_reason() -> None:
    problems = []
    for block in blocks():
        run, excluded = entries_for(block, RUN), entries_for(block, EXCLUDED)
        if len(run) + len(excluded) != 1:
            first = block.text.strip().splitlines()[0] if block.text.strip() else ""
            problems.append(f"{block} ({first!r}): in RUN {run}, in EXCLUDED {excluded}; list it in one, once")
    named = [(b.page, b.text) for b in blocks()]
    for key in [*RUN, *EXCLUDED]:
        if not any(page == key[0] and key[1] in text for page, text in named):
            problems.append(f"{key}: names no example (the page changed?)")
    assert all(reason.strip() for reason in EXCLUDED.values())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("block", "where"), runnable(), ids=lambda v: str(v) if isinstance(v, Block) else v)
def test_example_runs(block: Block, where: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")  # the examples that run need nothing from the network
    cwd = ROOT if where == "root" else tmp_path
    command = [sys.executable, "-c", block.text] if block.lang in PYTHON else ["bash", "-e", "-c", block.text]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block} failed:\n{block.text}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
