"""vLLM's PoolingParams on the pooling runner (`use_activation` and its older spellings, `truncate_prompt_tokens`,
the embedding fields refused by name) offline and in /classify and /pooling bodies, and /pooling's base64
encoding, held to transformers' logits and to the float response."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from classifiers import saved_classifier
from server_process import running_server
from test_pooling_heads import hf_logits

import pagedrl
from pagedrl.engine.llm import LLM
from pagedrl.engine.pooling_params import PoolingParams

ATOL = 1e-5  # float32 on both sides, on the CPU
PROMPTS = [list(range(5, 25)), [7, 8, 9], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def three_labels(tiny_train_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 3-label LlamaForSequenceClassification saved by transformers with the tokenizer, its head drawn wide
    enough that the probabilities spread, and the model itself."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("pooling-params") / "three"
    hf = saved_classifier(tiny_train_model, folder, {0: "neg", 1: "neu", 2: "pos"})
    return folder, hf


def hf_token_scores(hf, ids: list[int]) -> torch.Tensor:
    """transformers' score head at every token, [tokens, labels]."""
    with torch.no_grad():
        return hf.score(hf.model(input_ids=torch.tensor([ids])).last_hidden_state)[0]


def test_use_activation_and_truncation_as_vllms_pooling_params(three_labels) -> None:
    folder, hf = three_labels
    llm = LLM(str(folder), runner="pooling", device="cpu")
    logits = torch.stack([hf_logits(hf, p) for p in PROMPTS])
    assert pagedrl.PoolingParams is PoolingParams

    def probs(outs) -> torch.Tensor:
        return torch.tensor([o.outputs.probs for o in outs])

    assert torch.allclose(probs(llm.classify(PROMPTS, use_tqdm=False)), torch.softmax(logits, -1), atol=ATOL)
    for raw in (PoolingParams(use_activation=False), PoolingParams(activation=False), PoolingParams(softmax=False)):
        assert torch.allclose(probs(llm.classify(PROMPTS, pooling_params=raw, use_tqdm=False)), logits, atol=ATOL)
    # vLLM reads the older spellings first (`get_use_activation`)
    older_first = PoolingParams(activation=True, use_activation=False)
    assert torch.allclose(probs(llm.classify(PROMPTS[:1], pooling_params=older_first, use_tqdm=False)),
                          torch.softmax(logits[:1], -1), atol=ATOL)
    # one PoolingParams per prompt
    mixed = llm.classify(PROMPTS[:2], pooling_params=[PoolingParams(use_activation=False), PoolingParams()],
                         use_tqdm=False)
    assert torch.allclose(torch.tensor(mixed[0].outputs.probs), logits[0], atol=ATOL)
    assert torch.allclose(torch.tensor(mixed[1].outputs.probs), torch.softmax(logits[1], -1), atol=ATOL)
    # truncate_prompt_tokens in the params: the prompt's last 3 tokens, scored as transformers scores them
    kept = llm.classify(PROMPTS[:1], pooling_params=PoolingParams(truncate_prompt_tokens=3, use_activation=False),
                        use_tqdm=False)[0]
    assert kept.prompt_token_ids == PROMPTS[0][-3:]
    assert torch.allclose(torch.tensor(kept.outputs.probs), hf_logits(hf, PROMPTS[0][-3:]), atol=ATOL)
    assert llm.classify(PROMPTS[:1], pooling_params=PoolingParams(truncate_prompt_tokens=3), truncate_prompt_tokens=3,
                        use_tqdm=False)[0].prompt_token_ids == PROMPTS[0][-3:]
    # reward: raw per token unless use_activation asks for the classifier's activation on every row
    per_token = hf_token_scores(hf, PROMPTS[0])
    assert torch.allclose(llm.reward(PROMPTS[:1], use_tqdm=False)[0].outputs.data, per_token, atol=ATOL)
    activated = llm.reward(PROMPTS[:1], pooling_params=PoolingParams(use_activation=True), use_tqdm=False)
    assert torch.allclose(activated[0].outputs.data, torch.softmax(per_token, -1), atol=ATOL)


def test_pooling_params_that_do_not_apply_are_refused_by_name(three_labels) -> None:
    folder, _ = three_labels
    llm = LLM(str(folder), runner="pooling", device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match=r"^dimensions: task classify only supports \['use_activation'\]"):
        llm.classify(PROMPTS, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^normalize: task token_classify only supports .*embedding parameter"):
        llm.reward(PROMPTS, pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^use_activation: must be a boolean or None, got 'no'"):
        PoolingParams(use_activation="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^pooling_params: the list has 1 entries for 3 prompts"):
        llm.classify(PROMPTS, pooling_params=[PoolingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^pooling_params: a PoolingParams or a list of them, got dict"):
        llm.classify(PROMPTS, pooling_params={"use_activation": False}, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens: given as 4 and as pooling_params.truncate_prompt"):
        llm.classify(PROMPTS, pooling_params=PoolingParams(truncate_prompt_tokens=3), truncate_prompt_tokens=4)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens: 33 is greater than .* \(32 tokens\)"):
        llm.classify(PROMPTS, pooling_params=PoolingParams(truncate_prompt_tokens=33), use_tqdm=False)
    with pytest.raises(TypeError):
        PoolingParams(False)  # type: ignore[misc]  # keywords only, as vLLM's


def decoded(data: str, num_labels: int, dtype: str = "<f4") -> torch.Tensor:
    """A base64 /pooling item read back as vLLM's clients read it."""
    return torch.from_numpy(np.frombuffer(base64.b64decode(data), dtype=dtype).astype(np.float32)).view(-1, num_labels)


def test_the_server_takes_pooling_params_and_base64(three_labels, tmp_path) -> None:
    folder, hf = three_labels
    logits = torch.stack([hf_logits(hf, p) for p in PROMPTS])
    texts = ["the cat sat", "hello there, world"]
    with running_server(folder, tmp_path, "--runner", "pooling", "--max-model-len", "32", "--device", "cpu") as server:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(server.base_url + path, json=body, timeout=60)

        raw = post("/pooling", {"input": PROMPTS, "task": "classify", "use_activation": False})
        assert raw.status_code == 200, raw.text
        assert torch.allclose(torch.tensor([d["data"] for d in raw.json()["data"]]), logits, atol=ATOL)
        activated = post("/pooling", {"input": PROMPTS, "task": "classify"}).json()["data"]
        assert torch.allclose(torch.tensor([d["data"] for d in activated]), torch.softmax(logits, -1), atol=ATOL)
        per_token = post("/pooling", {"input": PROMPTS[0], "use_activation": True}).json()["data"][0]["data"]
        assert torch.allclose(torch.tensor(per_token), torch.softmax(hf_token_scores(hf, PROMPTS[0]), -1), atol=ATOL)
        kept = post("/pooling", {"input": PROMPTS[0], "truncate_prompt_tokens": 3}).json()
        assert kept["usage"]["prompt_tokens"] == 3
        assert torch.allclose(torch.tensor(kept["data"][0]["data"]), hf_token_scores(hf, PROMPTS[0][-3:]), atol=ATOL)
        # base64: float32, row-major, little-endian (this machine's order, vLLM's "native"), as the float answer
        floats = post("/pooling", {"input": PROMPTS}).json()["data"]
        for endianness, dtype in (("native", "<f4"), ("little", "<f4"), ("big", ">f4")):
            body = post("/pooling", {"input": PROMPTS, "encoding_format": "base64", "endianness": endianness}).json()
            for item, want in zip(body["data"], floats, strict=True):
                assert isinstance(item["data"], str) and torch.equal(decoded(item["data"], 3, dtype),
                                                                     torch.tensor(want["data"]))
        classify = post("/pooling", {"input": PROMPTS[:1], "task": "classify", "encoding_format": "base64"}).json()
        assert torch.equal(decoded(classify["data"][0]["data"], 3)[0], torch.tensor(activated[0]["data"]))
        # /classify: use_activation, and activation (its older spelling, read first as vLLM reads it)
        probs = post("/classify", {"input": texts}).json()["data"]
        for body in ({"use_activation": False}, {"activation": False}, {"use_activation": True, "activation": False}):
            scores = post("/classify", {"input": texts, **body}).json()["data"]
            for p, s in zip(probs, scores, strict=True):
                assert torch.allclose(torch.softmax(torch.tensor(s["probs"]), -1), torch.tensor(p["probs"]), atol=ATOL)
                assert s["label"] == p["label"]  # the label of the highest score, with or without the activation
        assert post("/classify", {"input": texts[0], "truncate_prompt_tokens": 2}).json()["usage"]["prompt_tokens"] == 2
        for field, value in (("dimensions", 8), ("normalize", False)):
            refused = post("/pooling", {"input": texts, field: value})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
            assert refused.json()["error"]["message"].startswith(f"{field}: task ")
            # vLLM's ClassificationRequest has no such field: ignored there, as any field it does not know
            assert post("/classify", {"input": texts, field: value}).json()["data"] == probs
        for body, param in (({"encoding_format": "bytes"}, "encoding_format"),
                            ({"embed_dtype": "float16"}, "embed_dtype"), ({"task": "embed"}, "task"),
                            ({"task": ""}, "task"), ({"use_activation": "no"}, "use_activation")):
            refused = post("/pooling", {"input": texts, **body})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        for task in ("embed", ""):
            message = post("/pooling", {"input": texts, "task": task}).json()["error"]["message"]
            assert message.startswith(f"task: {task!r} is not one of classify, token_classify"), message
        # a prompt's problem names the body's field, `input`, and the item
        for path, body, start in (("/pooling", {"input": [[5], []]}, "input[1]: "),
                                  ("/pooling", {"input": [[10 ** 6]]}, "input[0]: "),
                                  ("/pooling", {"input": [list(range(5, 45))]}, "input[0]: This model's maximum"),
                                  ("/classify", {"input": ["a", "a " * 40]}, "input[1]: This model's maximum")):
            refused = post(path, body)
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == "input", refused.text
            assert error["message"].startswith(start), error
            assert (error["code"] == "context_length_exceeded") == ("maximum" in start), error
