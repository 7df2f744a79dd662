"""Serving an adapter: `LLM(model, adapter=...)`, `pagedrl serve MODEL --adapter PATH` and
`pagedrl merge BASE ADAPTER OUT` all give what the live adapter gives; a reward-model adapter
merges into a classifier and scores as the live one."""

from __future__ import annotations

from pathlib import Path

import decoder_bound
import httpx
import pytest
import torch
from server_process import running_server
from tiny import randomise_adapter

from pagedrl.cli import main
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.adapter import save_adapter
from pagedrl.model.heads import load_sequence_scorer
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRAConfig, apply_lora
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.rl.reward_model import RewardModel

PROMPT = "the cat sat on the mat"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_train_model, tmp_path_factory) -> tuple[Path, list[int]]:
    """An adapter folder written as a trainer writes `final/`, and the live adapter's greedy tokens."""
    loaded = load_model(tiny_train_model, device="cpu", dtype=torch.float32)
    apply_lora(loaded.model, LoRAConfig(r=4, target_modules=["all-linear"], base_model_name_or_path=str(tiny_train_model)),
               torch.Generator().manual_seed(0))
    randomise_adapter(loaded.model, 1, scale=0.5)
    folder = save_adapter(loaded.model, tmp_path_factory.mktemp("adapter") / "final", loaded.tokenizer)
    live = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=1024)
    tokens = live.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    base = LLM(str(tiny_train_model), kv_cache_tokens=1024).generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert base.outputs[0].token_ids != tokens  # the adapter changes what is generated
    return folder, tokens


def test_llm_with_an_adapter_generates_as_the_live_adapter(tiny_train_model, adapter) -> None:
    folder, live = adapter
    llm = LLM(str(tiny_train_model), adapter=str(folder), kv_cache_tokens=1024)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == live
    by_name = LLM(adapter=str(folder), kv_cache_tokens=1024)  # the base the adapter names
    assert by_name.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == live
    alone = LLM(str(folder), kv_cache_tokens=1024)  # a LoRA run's final/ given as the model
    assert alone.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == live


def test_merge_command_writes_a_checkpoint_that_generates_the_same(tiny_train_model, adapter, tmp_path) -> None:
    folder, live = adapter
    out = tmp_path / "merged"
    assert main(["merge", str(tiny_train_model), str(folder), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= \
        {p.name for p in out.iterdir()}
    merged = LLM(str(out), kv_cache_tokens=1024)
    assert merged.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == live
    assert main(["merge", str(tiny_train_model), str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
    # the output may replace a model folder (the merge before), never the adapter nor someone's files
    assert main(["merge", str(tiny_train_model), str(folder), str(out)]) == 0
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep")
    for bad in (folder, notes, tmp_path):
        assert main(["merge", str(tiny_train_model), str(folder), str(bad)]) == 2
    assert (notes / "todo.txt").read_text() == "keep" and (folder / "adapter_config.json").is_file()


def test_serve_with_an_adapter_answers_as_the_live_adapter(tiny_train_model, adapter, tmp_path) -> None:
    folder, live = adapter
    with running_server(tiny_train_model, tmp_path, "--adapter", str(folder), "--kv-cache-tokens", "1024") as s:
        name = httpx.get(s.base_url + "/v1/models").json()["data"][0]["id"]
        assert name == str(folder)
        body = {"model": name, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        text = httpx.post(s.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert text == Tokenizer.from_folder(folder).decode(live)


def test_a_reward_model_adapter_merges_into_a_classifier(tiny_train_model, tmp_path) -> None:
    scorer = load_sequence_scorer(tiny_train_model, generator=torch.Generator().manual_seed(0))
    apply_lora(scorer, LoRAConfig(r=4, task_type="SEQ_CLS", modules_to_save=["score"],
                                  base_model_name_or_path=str(tiny_train_model)), torch.Generator().manual_seed(1))
    randomise_adapter(scorer, 2, scale=0.5)
    save_adapter(scorer, tmp_path / "rm", Tokenizer.from_folder(tiny_train_model))
    ids = torch.tensor([[5, 17, 42, 9, 77, 31, 8]])
    with torch.no_grad():
        live = scorer.eval().scores(scorer(ids))[0, -1]
    # Every score within float32's bound of the live adapter's exact one (`decoder_bound`, ~6e-6 here);
    # merging rounds each weight once, less than any product's own allowance in that bound.
    probed = decoder_bound.logits(scorer, ids, head=scorer.score)
    exact, bound = float(probed.exact[0, -1, 0]), float(probed.bound()[0, -1, 0])
    assert abs(float(live) - exact) <= bound
    assert main(["merge", str(tiny_train_model), str(tmp_path / "rm"), str(tmp_path / "merged")]) == 0
    merged = load_sequence_scorer(tmp_path / "merged", new_head=False)
    with torch.no_grad():
        assert abs(float(merged.scores(merged(ids))[0, -1]) - exact) <= bound
    reward_model = RewardModel.from_pretrained(tmp_path / "rm", device="cpu")  # the adapter folder itself
    with torch.no_grad():
        net = reward_model.network
        assert abs(float(net.scores(net(ids))[0, -1]) - exact) <= bound
