"""Models named by Hugging Face Hub id, resolved from a real huggingface_hub cache in a temporary
HF_HOME with HF_HUB_OFFLINE=1: a model folder, a revision (tag and commit), a GGUF file in a
repository, an adapter whose base is a Hub id, a trainer config naming one, the offline-miss error,
a machine without a network answered from the cache at once, and a local folder of the same name
winning over the cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hub_cache import cache_snapshot, commit_hash, folder_files
from tiny import randomise_adapter

from pagedrl.cli import main
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import read_adapter_config, save_adapter
from pagedrl.model.checkpoint import CheckpointError, load_causal_lm
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRAConfig, apply_lora
from pagedrl.model.resolve import HUB_FILES, HUB_PROBE_TIMEOUT_S, hub_cache_dir, resolve_model_path

REPO = "tinyorg/tiny-chat"
PROMPT = "the cat sat on the mat"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def same_weights(a: str | Path, b: str | Path, **kwargs) -> bool:
    """Whether two model arguments load the same tensors (`kwargs` go to loading `a`)."""
    x = load_model(a, device="cpu", dtype=torch.float32, load_tokenizer=False, **kwargs).model.state_dict()
    y = load_model(b, device="cpu", dtype=torch.float32, load_tokenizer=False).model.state_dict()
    return x.keys() == y.keys() and all(torch.equal(t, y[k]) for k, t in x.items())


def greedy(model: str | Path, **kwargs) -> list[int]:
    llm = LLM(str(model), kv_cache_tokens=512, **kwargs)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> tuple[Path, Path]:
    """Two different tiny models: the repository's main and its tag v2."""
    from tiny_train import build_model_dir

    root = tmp_path_factory.mktemp("hub-models")
    return build_model_dir(root / "v1", seed=1), build_model_dir(root / "v2", seed=2)


@pytest.fixture
def hub(tmp_path, monkeypatch, versions) -> Path:
    """HF_HOME with REPO cached at two commits (main -> the first, tag v2 -> the second), offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    cache_snapshot(cache, REPO, folder_files(versions[0]), commit_hash("v1"), refs=("main",))
    cache_snapshot(cache, REPO, folder_files(versions[1]), commit_hash("v2"), refs=("v2",))
    return cache


def test_the_cache_is_in_huggingface_hubs_own_layout(hub) -> None:
    from huggingface_hub import scan_cache_dir

    assert hub_cache_dir() == hub
    info = scan_cache_dir(hub)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO
    refs = {rev.commit_hash: set(rev.refs) for rev in repo.revisions}
    assert refs == {commit_hash("v1"): {"main"}, commit_hash("v2"): {"v2"}}


def test_a_hub_id_loads_offline_from_the_cache_as_its_folder_does(hub, versions) -> None:
    loaded = load_model(REPO, device="cpu", dtype=torch.float32)
    assert loaded.path == hub / "models--tinyorg--tiny-chat" / "snapshots" / commit_hash("v1")
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template is not None
    assert greedy(REPO) == greedy(versions[0])


def test_a_revision_picks_the_tag_or_the_commit(hub, versions) -> None:
    assert not same_weights(versions[0], versions[1])  # the two revisions differ
    assert same_weights(REPO, versions[1], revision="v2") and same_weights(REPO, versions[0])
    assert LLM(REPO, revision="v2", kv_cache_tokens=512).engine  # the engine builds on it
    assert resolve_model_path(REPO, revision=commit_hash("v1")).name == commit_hash("v1")
    assert main(["eval", REPO, "--revision", "v2", "--num-problems", "2", "--max-tokens", "4"]) == 0
    with pytest.raises(CheckpointError, match=r"tinyorg/tiny-chat at revision 'nope'.*not in the Hugging Face cache"):
        resolve_model_path(REPO, revision="nope")


def test_an_uncached_id_offline_is_one_error_naming_the_id_and_the_cache(hub) -> None:
    with pytest.raises(CheckpointError) as e:
        LLM("someorg/not-cached")
    message = str(e.value)
    assert "someorg/not-cached" in message and str(hub) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(CheckpointError, match="no such folder or file"):
        resolve_model_path("./not/a/folder")  # a path, not an id: the folder error as before


def test_without_a_network_the_cache_answers_at_once(hub, monkeypatch) -> None:
    """HF_HUB_OFFLINE unset on a machine whose name lookups hang (no network): a cached id resolves and
    an uncached one fails after the Hub probe's timeout, not after huggingface_hub's timeouts and retries."""
    import socket
    import threading
    import time

    import huggingface_hub.constants

    released = threading.Event()

    def hanging_lookup(*args, **kwargs):
        released.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "no network")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", hanging_lookup)
    try:
        start = time.monotonic()
        assert resolve_model_path(REPO).name == commit_hash("v1")
        with pytest.raises(CheckpointError, match="someorg/not-cached.*the Hub could not be reached"):
            resolve_model_path("someorg/not-cached")
        assert time.monotonic() - start < 2 * HUB_PROBE_TIMEOUT_S + 3
    finally:
        released.set()


def test_a_local_folder_of_the_same_name_wins(hub, versions, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(versions[1], tmp_path / REPO)
    assert resolve_model_path(REPO) == Path(REPO)
    assert same_weights(REPO, versions[1])


def test_a_gguf_file_in_a_hub_repository(hub, tmp_path) -> None:
    from gguf_files import TINY, write_tiny_gguf
    from tiny import hf_model

    local = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", hf_model(TINY, seed=3))
    cache_snapshot(hub, "tinyorg/tiny-gguf", {"tiny.Q8_0.gguf": local}, commit_hash("gguf"))
    from_hub = load_causal_lm(resolve_model_path("tinyorg/tiny-gguf/tiny.Q8_0.gguf"), dtype=torch.float32)
    from_file = load_causal_lm(resolve_model_path(local), dtype=torch.float32)
    assert from_hub.state_dict().keys() == from_file.state_dict().keys()
    assert all(torch.equal(a, from_file.state_dict()[k]) for k, a in from_hub.state_dict().items())
    with pytest.raises(CheckpointError, match=r"tinyorg/tiny-gguf/missing.gguf.*not in the Hugging Face cache"):
        resolve_model_path("tinyorg/tiny-gguf/missing.gguf")


def test_an_adapter_on_a_hub_base_and_an_adapter_in_the_hub(hub, versions, tmp_path) -> None:
    """`base_model_name_or_path` a Hub id (as PEFT writes it) resolves through the cache, at the
    revision the adapter records; an adapter repository in the cache loads by its own id."""
    loaded = load_model(versions[1], device="cpu", dtype=torch.float32)
    apply_lora(loaded.model, LoRAConfig(r=2, target_modules=["all-linear"], base_model_name_or_path=REPO,
                                        revision="v2"), torch.Generator().manual_seed(0))
    randomise_adapter(loaded.model, 1, scale=0.5)
    folder = save_adapter(loaded.model, tmp_path / "adapter", None)
    assert json.loads((folder / "adapter_config.json").read_text())["revision"] == "v2"
    live = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=512)
    expected = live.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert expected != greedy(versions[1])  # the adapter changes what is generated
    assert greedy(folder) == expected  # the base comes from the cache at v2
    cache_snapshot(hub, "tinyorg/tiny-lora", folder_files(folder), commit_hash("lora"))
    assert greedy("tinyorg/tiny-lora") == expected
    assert main(["merge", REPO, "tinyorg/tiny-lora", str(tmp_path / "merged"), "--revision", "v2"]) == 0
    assert greedy(tmp_path / "merged") == expected


def test_a_trainer_config_names_a_hub_id_and_revision(hub, versions, tmp_path) -> None:
    from tiny_train import arithmetic_rows

    from pagedrl.train.algorithms.sft import run_sft
    from pagedrl.train.offline_config import SFTConfig

    config = SFTConfig(model=REPO, revision="v2", output_dir=str(tmp_path / "run"), max_steps=1, use_peft=True,
                       per_device_train_batch_size=2, save_steps=1000, seed=0)
    final = run_sft(config, arithmetic_rows(4), progress=False)
    adapter = read_adapter_config(final)
    assert (adapter.base_model_name_or_path, adapter.revision) == (REPO, "v2")
    assert greedy(final) == greedy(versions[1], adapter=str(final))  # the adapter resumes on the v2 base


def test_only_what_pagedrl_reads_is_fetched() -> None:
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "additional_chat_templates/tool_use.jinja", "adapter_config.json",
            "adapter_model.safetensors", "pytorch_model.bin", "flax_model.msgpack", "onnx/model.onnx",
            "onnx/model.safetensors", "README.md", "vocab.json", "merges.txt", ".gitattributes", "LICENSE"]
    fetched = set(filter_repo_objects(repo, allow_patterns=list(HUB_FILES)))
    assert fetched == set(repo[:12])
