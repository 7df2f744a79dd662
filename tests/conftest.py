"""Session fixtures: a private cache directory, the real default model converted into it once, and
float32 as the CPU's default precision unless a test asks for bf16 (the parity tests against
transformers, TRL and float64 hand computations are float32 ones; `test_precision.py` and the bf16
tests choose bf16 themselves).

`make test` runs the suite in two processes (pytest-xdist, `-n 2 --dist loadfile`: a module's tests and
its server stay in one): most of a serial run's time is one core waiting on a process starting, a
server answering, a subprocess importing torch. Each worker then runs torch on its share of the cores
(one thread on a 2-core machine), as do the servers and scripts it starts: two workers of two OpenMP
threads each on 2 cores stall at every barrier (the suite took 7m35s so, the threads sleeping when idle
and the kernels already built, against 7m06s at one thread each, building them). The tests whose point is a second thread set it themselves, and `make test-isa`
runs the kernels' tests again in one process at the machine's threads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's share of the cores as its torch threads, and those of every process it starts
    (see the module's text)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def float32_by_default() -> Iterator[None]:
    """The suite runs as on a CPU without native bf16 (servers and torchrun workers inherit it)."""
    from pagedrl.model.precision import FORCE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FORCE_ENV, "0")
        yield


@pytest.fixture(scope="session", autouse=True)
def threads_unbound() -> Iterator[None]:
    """Engines leave torch's threads where the kernel puts them: a bound test process would hand its
    narrowed core set to every server and torchrun worker it starts (`test_cpu_threads.py` binds in
    processes of its own)."""
    from pagedrl.kernels.threads import ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "nobind")
        yield


# Set by a test run for the pytest runs it starts in processes of its own (the Triton interpreter's).
SUITE_CACHE_ENV = "PAGEDRL_SUITE_CACHE_DIR"


@pytest.fixture(scope="session", autouse=True)
def pagedrl_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test run converts into its own cache, never into the user's ~/.cache/pagedrl. A run
    started by another takes that one's cache, and xdist's workers share one (beside their own temporary
    folders): a fresh one rebuilds the C++ kernels (a minute each). The kernels' builder and the model's
    conversion hold locks, so one worker builds while the other waits."""
    inherited = os.environ.get(SUITE_CACHE_ENV)
    if inherited:
        cache = Path(inherited)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        cache = tmp_path_factory.getbasetemp().parent / "pagedrl-cache"
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("pagedrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDRL_CACHE_DIR", str(cache))
        mp.setenv(SUITE_CACHE_ENV, str(cache))
        yield cache


@pytest.fixture(scope="session")
def default_model_dir(pagedrl_cache_dir: Path) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct, converted from its GGUF once per run."""
    from pagedrl.model.default import resolve_default_model

    return resolve_default_model()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path):
    from pagedrl.model.tokenizer import Tokenizer

    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="session")
def tiny_train_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model folder with a byte-level BPE tokenizer and a ChatML chat template
    (see tests/tiny_train.py); read-only: tests write their runs elsewhere."""
    from tiny_train import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny-train-model") / "model")


@pytest.fixture(scope="module")
def tok(tiny_train_model: Path):
    """`tiny_train_model`'s tokenizer, as pagedrl reads it."""
    from pagedrl.model.tokenizer import Tokenizer

    return Tokenizer.from_folder(tiny_train_model)


@pytest.fixture(scope="module")
def hf_tok(tiny_train_model: Path):
    """`tiny_train_model`'s tokenizer, as transformers reads it (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_train_model))


@pytest.fixture(scope="session")
def wide_train_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_train_model` four times wider (hidden 256, MLP 768, head_dim 64) and less flat
    (weights of std 0.05): wide enough that this CPU's bf16 matmuls and attention round a token's
    numbers differently in a decode batch and in a packed batch."""
    from tiny_train import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("wide-train-model") / "model", hidden_size=256,
                           intermediate_size=768, std=0.05)


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client on the module's `server` fixture (a real `pagedrl serve` process);
    no retries, so a refused request fails the test at once. Modules that need an API key define their own."""
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    """The id the server answers to (its first /v1/models entry)."""
    return client.models.list().data[0].id
