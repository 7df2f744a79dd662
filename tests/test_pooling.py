"""The pooling runner (`LLM(folder, runner="pooling")`, `pagedrl serve --runner pooling`): a sequence
classifier written by transformers (and a SEQ_CLS LoRA adapter) classified and rewarded as transformers
scores it, offline and through a real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from classifiers import saved_classifier
from server_process import running_server
from tiny import randomise_adapter

from pagedrl.engine.llm import LLM
from pagedrl.engine.pooling import PoolingLLM
from pagedrl.model.adapter import save_adapter
from pagedrl.model.heads import load_sequence_scorer
from pagedrl.model.lora import LoRAConfig, apply_lora
from pagedrl.model.merge import merge_adapter
from pagedrl.model.tokenizer import Tokenizer

TEXTS = ["the cat sat", "hello there, world", "a"]
ATOL = 1e-5  # float32 on both sides (on the CPU), one sequence alone there and a padded batch here


@pytest.fixture(scope="module")
def classifier(tiny_train_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A `LlamaForSequenceClassification` (one label, named "helpful") saved by transformers, with the
    tokenizer; its head drawn wide enough that the probabilities spread."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("classifier") / "rm"
    hf = saved_classifier(tiny_train_model, folder, {0: "helpful"})
    return folder, hf


def token_scores(hf, ids: list[int]) -> torch.Tensor:
    """transformers' raw score at every token of one sequence (its `score` over the backbone's states)."""
    with torch.no_grad():
        return hf.score(hf.model(input_ids=torch.tensor([ids])).last_hidden_state)[0, :, 0]


def hf_probs(hf, ids: list[int]) -> float:
    """transformers' classification of one sequence, through vLLM's one-label activation (a sigmoid)."""
    with torch.no_grad():
        return float(torch.sigmoid(hf(input_ids=torch.tensor([ids])).logits[0, 0]))


def test_classify_and_reward_equal_transformers(classifier, tiny_train_model) -> None:
    folder, hf = classifier
    llm = LLM(str(folder), runner="pooling", device="cpu")
    assert isinstance(llm, PoolingLLM)
    assert isinstance(LLM(str(folder), device="cpu"), PoolingLLM)  # "auto" on a classifier
    pad = Tokenizer.from_folder(folder).pad_token_id
    padded = [5, 17, 42, 9, pad]  # read at 9, the last token that is not the pad token, as transformers reads it
    prompts = [*TEXTS, padded, {"prompt_token_ids": [7, 8, 9]}]
    outs = llm.classify(prompts, use_tqdm=False)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    assert [o.prompt_token_ids for o in outs[:3]] == [hf_tok(t)["input_ids"] for t in TEXTS]
    assert outs[3].prompt_token_ids == padded and len({o.request_id for o in outs}) == len(outs)
    got = torch.tensor([o.outputs.probs[0] for o in outs])
    want = torch.tensor([hf_probs(hf, o.prompt_token_ids) for o in outs])
    assert all(o.outputs.num_classes == 1 for o in outs)
    assert torch.allclose(got, want, atol=ATOL) and want.std() > 0.01
    assert [o.outputs.data.tolist() for o in llm.encode(prompts, pooling_task="classify")] == \
        [o.outputs.probs for o in outs]
    rewards = llm.reward(prompts, use_tqdm=False)
    for out in rewards:  # the raw score at every token, no activation
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 1)
        assert torch.allclose(out.outputs.data[:, 0], token_scores(hf, out.prompt_token_ids), atol=ATOL)
    assert torch.allclose(torch.sigmoid(rewards[3].outputs.data[3, 0]), got[3], atol=ATOL)


def test_batches_give_what_one_batch_gives(classifier) -> None:
    folder, _ = classifier
    prompts = [t * k for k in (1, 3, 5) for t in TEXTS]
    whole = LLM(str(folder), runner="pooling", device="cpu").classify(prompts, use_tqdm=False)
    split = LLM(str(folder), runner="pooling", device="cpu", max_num_seqs=2, max_num_batched_tokens=40)
    split = split.classify(prompts, use_tqdm=False)
    for a, b in zip(whole, split, strict=True):
        assert abs(a.outputs.probs[0] - b.outputs.probs[0]) <= ATOL


def test_each_runner_refuses_the_others_calls(classifier, tiny_train_model) -> None:
    folder, _ = classifier
    llm = LLM(str(folder), runner="pooling", device="cpu", max_model_len=16)
    for call in (lambda: llm.generate("hi"), lambda: llm.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(ValueError, match=r"^LLM\.\w+\(\) is only supported for generative models; "
                                             r".*use classify\(\) or reward"):
            call()
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt is empty"):
        llm.classify(["ok", ""])
    with pytest.raises(ValueError, match=r"^prompts\[0\]: This model's maximum context length is 16 tokens "
                                         r"\(max_model_len\)"):
        llm.classify([list(range(5, 22))])
    assert len(llm.classify([list(range(5, 22))], truncate_prompt_tokens=16)[0].prompt_token_ids) == 16
    with pytest.raises(ValueError, match="^pooling_task: 'embed' is not one of classify, token_classify"):
        llm.encode("hi", pooling_task="embed")
    with pytest.raises(ValueError, match=r"^pooling_task: 'encode' \(vLLM 0.10's default\) gives a classifier's hidden "
                                         r"states, not its scores, .*use one of classify, token_classify"):
        llm.encode("hi", pooling_task="encode")
    with pytest.raises(ValueError, match="^runner: 'embed' is not one of auto, generate, pooling"):
        LLM(str(folder), runner="embed", device="cpu")
    generating = LLM(str(tiny_train_model), device="cpu", kv_cache_tokens=256)
    for name in ("classify", "reward", "encode"):
        with pytest.raises(ValueError, match=rf"^LLM.{name}\(\) is only supported for pooling models.*"
                                             r"runner='pooling'"):
            getattr(generating, name)(["hi"])


@pytest.fixture(scope="module")
def reward_adapter(tiny_train_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A SEQ_CLS LoRA adapter on the tiny causal LM (what `pagedrl rm --use_peft` writes) and its merge."""
    root = tmp_path_factory.mktemp("reward-adapter")
    scorer = load_sequence_scorer(tiny_train_model, generator=torch.Generator().manual_seed(0))
    apply_lora(scorer, LoRAConfig(r=4, task_type="SEQ_CLS", modules_to_save=["score"],
                                  base_model_name_or_path=str(tiny_train_model)), torch.Generator().manual_seed(1))
    randomise_adapter(scorer, 2, scale=0.5)
    with torch.no_grad():
        scorer.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
    save_adapter(scorer, root / "adapter", Tokenizer.from_folder(tiny_train_model))
    return root / "adapter", merge_adapter(None, root / "adapter", root / "merged")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_server_classifies_as_transformers_and_refuses_generation(classifier, tmp_path) -> None:
    folder, hf = classifier
    with running_server(folder, tmp_path, "--runner", "pooling", "--max-model-len", "32", "--device", "cpu") as server:
        assert httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"] == str(folder)
        reply = post(server, "/classify", {"input": TEXTS})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == str(folder)
        llm_ids = LLM(str(folder), runner="pooling", device="cpu").encode_prompts(TEXTS)
        for i, item in enumerate(body["data"]):
            assert (item["index"], item["label"], item["num_classes"]) == (i, "helpful", 1)  # the folder's own label
            assert abs(item["probs"][0] - hf_probs(hf, llm_ids[i])) <= ATOL
        assert body["usage"] == {"prompt_tokens": sum(map(len, llm_ids)), "completion_tokens": 0,
                                 "total_tokens": sum(map(len, llm_ids))}
        single = post(server, "/classify", {"input": TEXTS[0], "model": str(folder)}).json()
        assert single["data"][0]["probs"] == body["data"][0]["probs"]
        raw = post(server, "/classify", {"input": TEXTS[0], "activation": False}).json()["data"][0]["probs"][0]
        assert abs(raw - float(token_scores(hf, llm_ids[0])[-1])) <= ATOL
        pooled = post(server, "/pooling", {"input": TEXTS[1]}).json()["data"][0]["data"]
        assert torch.allclose(torch.tensor(pooled)[:, 0], token_scores(hf, llm_ids[1]), atol=ATOL)
        empty = post(server, "/classify", {"input": ""})
        assert empty.status_code == 400 and "cannot be empty" in empty.json()["error"]["message"]
        long = post(server, "/classify", {"input": "word " * 40})
        assert long.status_code == 400 and long.json()["error"]["param"] == "input"
        assert long.json()["error"]["message"].startswith("input[0]: This model's maximum context length is 32 tokens")
        for path in ("/v1/completions", "/v1/chat/completions"):
            refused = post(server, path, {"model": str(folder), "prompt": "hi", "messages": []})
            assert refused.status_code == 400
            assert "does not support" in refused.json()["error"]["message"]
            assert "--runner pooling" in refused.json()["error"]["message"]
        assert post(server, "/classify", {"input": TEXTS}).json()["data"] == body["data"]  # still serving


def test_a_lora_reward_adapter_serves_as_its_merged_folder(reward_adapter, tmp_path) -> None:
    import transformers

    adapter, merged = reward_adapter
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(merged), dtype=torch.float32).eval()
    offline = LLM(str(merged), runner="pooling", device="cpu")
    ids = offline.encode_prompts(TEXTS)
    want = [hf_probs(hf, x) for x in ids]
    assert max(want) - min(want) > 0.01
    for got in (offline, LLM(str(adapter), runner="pooling", device="cpu")):
        assert [abs(o.outputs.probs[0] - w) <= ATOL for o, w in zip(got.classify(TEXTS, use_tqdm=False), want,
                                                                      strict=True)] == [True] * len(TEXTS)
    # "auto": a SEQ_CLS adapter is served by the pooling runner
    with running_server(adapter, tmp_path, "--device", "cpu") as server:
        data = post(server, "/classify", {"input": TEXTS}).json()["data"]
    assert [abs(d["probs"][0] - w) <= ATOL for d, w in zip(data, want, strict=True)] == [True] * len(TEXTS)
