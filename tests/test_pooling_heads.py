"""The pooling runner's reading of a classifier's head, held to transformers: a sliding window past the
prompt's start (Mistral), the folder's own labels, several labels, and the head's precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedrl.engine.llm import LLM
from pagedrl.engine.pooling_params import PoolingParams
from pagedrl.model.heads import last_scores

ATOL = 1e-5  # float32 on both sides, on the CPU
RAW = PoolingParams(use_activation=False)  # the scores themselves, no activation


def mistral_classifier(folder: Path, num_labels: int = 1, **config) -> torch.nn.Module:
    """A tiny `MistralForSequenceClassification` written by transformers (window 4 unless told), its head drawn
    wide enough that the scores spread."""
    import transformers

    cfg = transformers.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                     max_position_embeddings=256, num_labels=num_labels,
                                     **{"sliding_window": 4, **config})
    torch.manual_seed(0)
    hf = transformers.MistralForSequenceClassification(cfg).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0.0, 0.5)
    hf.save_pretrained(str(folder))
    return hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0]


def test_a_sliding_window_is_applied_as_transformers_applies_it(tmp_path) -> None:
    hf = mistral_classifier(tmp_path / "mistral")
    llm = LLM(str(tmp_path / "mistral"), runner="pooling", device="cpu")
    assert llm.network.config.sliding_window == 4
    prompts = [list(range(5, 25)), [7, 8, 9], list(range(30, 41))]  # 20 and 11 tokens: past the window of 4
    want = torch.stack([hf_logits(hf, p)[0] for p in prompts])
    for alone in (True, False):  # unpadded (one prompt a batch) and right-padded batches
        runner = LLM(str(tmp_path / "mistral"), runner="pooling", device="cpu", max_num_seqs=1) if alone else llm
        raw = [o.outputs.data[0] for o in runner.encode(prompts, RAW, pooling_task="classify",
                                                        use_tqdm=False)]
        assert torch.allclose(torch.stack(raw), want, atol=ATOL), (alone, raw, want)
    assert torch.allclose(last_scores(llm.network, prompts, 0), want, atol=ATOL)  # RewardModel.score's read
    with torch.no_grad():
        states = hf.model(input_ids=torch.tensor([prompts[0]])).last_hidden_state
        per_token = hf.score(states)[0, :, 0]
    assert torch.allclose(llm.reward([prompts[0]], use_tqdm=False)[0].outputs.data[:, 0], per_token, atol=ATOL)


def test_the_folders_own_labels_are_kept(tmp_path) -> None:
    import json

    from pagedrl.model.heads import save_sequence_scorer

    mistral_classifier(tmp_path / "named", id2label={0: "helpful"}, label2id={"helpful": 0})
    network = LLM(str(tmp_path / "named"), runner="pooling", device="cpu").network
    assert network.config.extra["id2label"] == {"0": "helpful"}
    saved = json.loads((save_sequence_scorer(network, tmp_path / "again") / "config.json").read_text())
    assert (saved["id2label"], saved["label2id"]) == ({"0": "helpful"}, {"helpful": 0})
    mistral_classifier(tmp_path / "plain")  # transformers' default name for one label
    assert LLM(str(tmp_path / "plain"), runner="pooling", device="cpu").network.config.extra["id2label"] == \
        {"0": "LABEL_0"}


def test_a_bf16_model_scores_in_float32(tmp_path) -> None:
    """vLLM keeps a pooling model's head in float32 (`score(x.float())`): the states are bf16, the head's
    weights and its product are not rounded."""
    import torch.nn.functional as F

    from pagedrl.model.checkpoint import read_state_dict
    from pagedrl.model.heads import padded_hidden, score_index

    mistral_classifier(tmp_path / "m", sliding_window=None)
    llm = LLM(str(tmp_path / "m"), runner="pooling", device="cpu", dtype="bfloat16")
    assert llm.network.model.embed_tokens.weight.dtype == torch.bfloat16
    head = read_state_dict(tmp_path / "m")["score.weight"].float()  # as written: float32
    prompts = [list(range(5, 25)), [7, 8, 9]]
    with torch.no_grad():
        hidden = padded_hidden(llm.network, prompts, 0)
        assert hidden.dtype == torch.bfloat16
        at = [score_index(p, 0) for p in prompts]
        want = F.linear(hidden[torch.arange(2), at].float(), head)[:, 0]
        per_token = F.linear(hidden[0].float(), head)[:, 0]
    raw = torch.stack([o.outputs.data[0] for o in llm.encode(prompts, RAW, pooling_task="classify",
                                                             use_tqdm=False)])
    assert raw.dtype == torch.float32 and torch.allclose(raw, want, atol=1e-6, rtol=0)
    assert not torch.equal(raw, raw.bfloat16().float())  # not rounded to bf16 anywhere
    probs = torch.tensor([o.outputs.probs[0] for o in llm.classify(prompts, use_tqdm=False)])
    assert torch.allclose(probs, torch.sigmoid(want), atol=1e-6, rtol=0)
    assert torch.allclose(llm.reward(prompts[:1], use_tqdm=False)[0].outputs.data[:, 0], per_token, atol=1e-6, rtol=0)


def test_a_classifier_of_several_labels_is_classified_as_transformers_classifies(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from pagedrl.model.checkpoint import CheckpointError
    from pagedrl.model.merge import load_reward_model
    from pagedrl.server.pooling_app import build_pooling_app, label_of

    names = {0: "negative", 1: "neutral", 2: "positive"}
    hf = mistral_classifier(tmp_path / "three", num_labels=3, id2label=names,
                            label2id={v: k for k, v in names.items()})
    llm = LLM(str(tmp_path / "three"), device="cpu")  # "auto": the pooling runner
    prompts = [list(range(5, 25)), [7, 8, 9], [40, 41, 42, 43, 44]]
    logits = torch.stack([hf_logits(hf, p) for p in prompts])
    want = torch.softmax(logits, dim=-1)  # vLLM's classify over several labels (PoolerClassify)
    outs = llm.classify(prompts, use_tqdm=False)
    assert [o.outputs.num_classes for o in outs] == [3, 3, 3]
    got = torch.tensor([o.outputs.probs for o in outs])
    assert torch.allclose(got, want, atol=ATOL) and len(set(want.argmax(-1).tolist())) > 1
    reward = llm.reward(prompts[:1], use_tqdm=False)[0].outputs.data
    assert reward.shape == (20, 3) and torch.allclose(reward[-1], logits[0], atol=ATOL)
    assert [label_of(llm.id2label(), i) for i in range(3)] == ["negative", "neutral", "positive"]  # /classify's labels
    body = TestClient(build_pooling_app(llm, served_model_name="m")).post("/pooling", json={"input": prompts}).json()
    assert torch.allclose(torch.tensor(body["data"][0]["data"]), reward, atol=ATOL)
    with pytest.raises(CheckpointError, match="has 3 labels; a reward model has one"):
        load_reward_model(tmp_path / "three")  # the trainers and RewardModel take one label, as before
    cfg = json.loads((tmp_path / "three" / "config.json").read_text())
    cfg["problem_type"] = "multi_label_classification"
    (tmp_path / "three" / "config.json").write_text(json.dumps(cfg))
    multi = LLM(str(tmp_path / "three"), runner="pooling", device="cpu").classify(prompts, use_tqdm=False)
    assert torch.allclose(torch.tensor([o.outputs.probs for o in multi]), torch.sigmoid(logits), atol=ATOL)


def test_truncate_prompt_tokens_past_the_context_is_refused(tmp_path) -> None:
    """vLLM refuses truncate_prompt_tokens greater than max_model_len (a 400), rather than keeping the prompt."""
    from fastapi.testclient import TestClient

    from pagedrl.server.pooling_app import build_pooling_app

    mistral_classifier(tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), runner="pooling", device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens: 33 is greater than .* \(32 tokens\)"):
        llm.classify([[5, 6, 7]], truncate_prompt_tokens=33, use_tqdm=False)
    client = TestClient(build_pooling_app(llm, served_model_name="m"))
    reply = client.post("/pooling", json={"input": [5, 6, 7], "truncate_prompt_tokens": 100})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "truncate_prompt_tokens"
    assert reply.json()["error"]["message"].startswith("truncate_prompt_tokens: 100 is greater than the model's "
                                                       "maximum context length (32 tokens)")
    kept = client.post("/pooling", json={"input": list(range(5, 45)), "truncate_prompt_tokens": 32})
    assert kept.status_code == 200 and len(kept.json()["data"][0]["data"]) == 32
