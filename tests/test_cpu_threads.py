"""The engine's OpenMP threads bound to cores (`kernels/threads.py`): the plan for each setting,
bad settings named, and a real engine in a process of its own, whose threads end up on the planned
cores (read back from /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedrl.kernels.threads import ENV, parse_cores, planned_cores


def test_the_plan_for_each_setting() -> None:
    cores = {0, 1, 2, 3}
    assert planned_cores("auto", 2, cores) == [0, 1]
    assert planned_cores("", 4, cores) is None  # unset: not bound (see the module)
    assert planned_cores("auto", 4, cores) == [0, 1, 2, 3]
    assert planned_cores("auto", 8, cores) is None  # fewer cores than threads: leave them
    assert planned_cores("auto", 1, cores, local_rank=1, local_world=2) == [1]  # torchrun's rank 1 of 2
    assert planned_cores("auto", 2, cores, local_rank=1, local_world=2) == [2, 3]
    assert planned_cores("auto", 2, cores, local_rank=1, local_world=4) is None
    assert planned_cores("nobind", 2, cores) is None
    assert planned_cores("1-2", 2, cores) == [1, 2]
    assert parse_cores("0-2,5") == [0, 1, 2, 5]
    for bad in ("x", "3-1", "0,0", "1-"):
        with pytest.raises(ValueError, match=ENV):
            parse_cores(bad)
    with pytest.raises(ValueError, match=r"cores \[7\] are not among"):
        planned_cores("0,7", 2, cores)


CHILD = """
import json, os, torch
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from tiny import FAMILIES
torch.manual_seed(0)
llm = LLM.from_module(CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])), kv_cache_tokens=256)
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
torch.ones(1 << 20).sum()  # a parallel region: every thread of the team exists
tasks = {}
for t in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{t}/status").read()
    tasks[t] = status.split("Cpus_allowed_list:")[1].split()[0]
print("RESULT " + json.dumps({"main": tasks[str(os.getpid())], "all": sorted(tasks.values())}))
"""


def child_threads(setting: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **{ENV: setting})
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_an_engine_binds_its_threads_in_a_process_of_its_own() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    threads = min(2, len(allowed))
    bound = child_threads("auto", threads)
    assert bound["main"] == str(allowed[0])  # the thread that ran the steps: OpenMP thread 0
    assert sorted(c for c in bound["all"] if c in {str(c) for c in allowed[:threads]}) == \
        sorted(str(c) for c in allowed[:threads])  # one thread on each planned core
    last = child_threads(str(allowed[-1]), 1)  # a list: thread 0 on the core given
    assert last["main"] == str(allowed[-1])
    free = child_threads("nobind", threads)
    mine = open("/proc/self/status").read().split("Cpus_allowed_list:")[1].split()[0]
    assert free["main"] == mine and set(free["all"]) == {mine}  # every thread left as it was
