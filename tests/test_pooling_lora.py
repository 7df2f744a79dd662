"""SEQ_CLS LoRA adapters chosen per request on the pooling runner (`enable_lora`, `lora_request`, and
`--lora-modules` with the request's `model`), each scored as transformers scores the folder `pagedrl merge`
writes of base and adapter."""

from __future__ import annotations

import gc
import json
import logging
import shutil
import weakref
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_process import running_server
from test_pooling_heads import mistral_classifier
from tiny import randomise_adapter

from pagedrl.engine import pooling_loras
from pagedrl.engine.llm import LLM
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.model.adapter import save_adapter
from pagedrl.model.heads import load_sequence_scorer
from pagedrl.model.lora import LoRAConfig, apply_lora
from pagedrl.model.merge import merge_adapter
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.server.pooling_app import build_pooling_app
from pagedrl.server.serve import build_parser, build_server
from pagedrl.server.served_models import LoRAModule

TEXTS = ["the cat sat", "hello there, world", "a"]
ATOL = 1e-5  # float32 on both sides, on the CPU


def seq_cls_adapter(base: Path, folder: Path, seed: int) -> tuple[Path, torch.nn.Module]:
    """A rank-4 SEQ_CLS adapter on `base` with its own `score` head, as `pagedrl rm --use_peft` writes it, and
    transformers' classifier of the folder `pagedrl merge` writes of the two."""
    import transformers

    scorer = load_sequence_scorer(base, generator=torch.Generator().manual_seed(seed))
    apply_lora(scorer, LoRAConfig(r=4, task_type="SEQ_CLS", modules_to_save=["score"],
                                  base_model_name_or_path=str(base)), torch.Generator().manual_seed(seed))
    randomise_adapter(scorer, seed, scale=0.5)
    with torch.no_grad():
        scorer.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    save_adapter(scorer, folder / "adapter", Tokenizer.from_folder(base))
    merged = merge_adapter(base, folder / "adapter", folder / "merged")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(merged), dtype=torch.float32).eval()
    return folder / "adapter", hf


def misfit_adapter(tmp_path: Path) -> Path:
    """A SEQ_CLS adapter on `up_proj` of a 128-wide MLP, where the tiny model's is 96 wide."""
    mistral_classifier(tmp_path / "other")
    other = load_sequence_scorer(tmp_path / "other")
    apply_lora(other, LoRAConfig(r=4, task_type="SEQ_CLS", target_modules=["up_proj"], modules_to_save=["score"]))
    return save_adapter(other, tmp_path / "other-adapter")


@pytest.fixture(scope="module")
def adapters(tiny_train_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two reward adapters on the tiny causal LM, each with its transformers reference."""
    root = tmp_path_factory.mktemp("pooling-lora")
    return [seq_cls_adapter(tiny_train_model, root / name, seed) for name, seed in (("a1", 1), ("a2", 2))]


def hf_scores(hf, ids: list[int]) -> torch.Tensor:
    """transformers' score head at every token of one sequence, [tokens, labels]."""
    with torch.no_grad():
        return hf.score(hf.model(input_ids=torch.tensor([ids])).last_hidden_state)[0]


def test_adapters_per_prompt_score_as_their_merged_folders(adapters, tiny_train_model, tmp_path) -> None:
    (a1, hf1), (a2, hf2) = adapters
    llm = LLM(str(tiny_train_model), runner="pooling", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    r1, r2 = LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2))
    ids = llm.encode_prompts(TEXTS)
    want = {name: torch.tensor([float(torch.sigmoid(hf_scores(hf, x)[-1, 0])) for x in ids])
            for name, hf in (("a1", hf1), ("a2", hf2))}
    assert (want["a1"] - want["a2"]).abs().max() > 0.01
    for lora in (r1, r2, r1):  # one adapter kept at a time (max_loras=1): a2 replaces a1, then a1 is folded again
        got = torch.tensor([o.outputs.probs[0] for o in llm.classify(TEXTS, lora_request=lora, use_tqdm=False)])
        assert torch.allclose(got, want[lora.lora_name], atol=ATOL), lora
    mixed = llm.classify(TEXTS, lora_request=[r1, r2, r1], use_tqdm=False)
    assert torch.allclose(torch.tensor([o.outputs.probs[0] for o in mixed]),
                          torch.tensor([want["a1"][0], want["a2"][1], want["a1"][2]]), atol=ATOL)
    reward = llm.reward(TEXTS[1], lora_request=r2, use_tqdm=False)[0].outputs.data
    assert torch.allclose(reward, hf_scores(hf2, ids[1]), atol=ATOL)

    with pytest.raises(ValueError, match=r"^lora_request: the model is a causal LM, whose head scores nothing"):
        llm.classify(TEXTS, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^lora_request: got 1 for 3 prompts"):
        llm.classify(TEXTS, lora_request=[r1], use_tqdm=False)
    causal = tmp_path / "causal"
    shutil.copytree(a1, causal)
    config = json.loads((causal / "adapter_config.json").read_text())
    (causal / "adapter_config.json").write_text(json.dumps({**config, "task_type": "CAUSAL_LM"}))
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'c' is a CAUSAL_LM adapter; the pooling runner "
                                         r"serves SEQ_CLS"):
        llm.classify(TEXTS, lora_request=LoRARequest("c", 3, str(causal)), use_tqdm=False)
    misfit = misfit_adapter(tmp_path)
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'o' does not fit the base .*up_proj"):
        llm.classify(TEXTS, lora_request=LoRARequest("o", 4, str(misfit)), use_tqdm=False)
    narrow = LLM(str(tiny_train_model), runner="pooling", device="cpu", enable_lora=True, max_lora_rank=2)
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'a1' has rank 4, above max_lora_rank 2"):
        narrow.classify(TEXTS, lora_request=r1, use_tqdm=False)
    plain = LLM(str(a1), runner="pooling", device="cpu")  # the adapter itself as the model, as before
    assert torch.allclose(torch.tensor([o.outputs.probs[0] for o in plain.classify(TEXTS, use_tqdm=False)]),
                          want["a1"], atol=ATOL)
    with pytest.raises(ValueError, match=r"^lora_request: adapters per request need LLM\(.*enable_lora=True\)"):
        plain.classify(TEXTS, lora_request=r1, use_tqdm=False)


def counted_folds(monkeypatch: pytest.MonkeyPatch) -> tuple[list[weakref.ref], list[int]]:
    """Each folded copy (a weak reference) and, at each fold, how many earlier copies were alive."""
    made: list[weakref.ref] = []
    alive_at_fold: list[int] = []
    fold = pooling_loras.merged_scorer

    def counting(*args, **kwargs):
        gc.collect()
        alive_at_fold.append(sum(ref() is not None for ref in made))
        assert kwargs["device"] == "cpu"  # folded on the CPU, only the result moved to the engine's device
        scorer = fold(*args, **kwargs)
        made.append(weakref.ref(scorer))
        return scorer

    monkeypatch.setattr(pooling_loras, "merged_scorer", counting)
    return made, alive_at_fold


def test_the_least_recently_used_copy_is_dropped_before_a_fold(adapters, tiny_train_model, monkeypatch) -> None:
    """With max_loras=1 the device holds one merged copy at most, even while the next is folded (the cache
    and encode's own reference both let the old one go first); max_cpu_loras keeps more."""
    (a1, _), (a2, _) = adapters
    r1, r2 = LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2))
    made, alive_at_fold = counted_folds(monkeypatch)
    llm = LLM(str(tiny_train_model), runner="pooling", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    assert all(p.is_meta for p in llm.network.parameters())  # the causal LM base: its config read, no weights
    llm.classify(TEXTS, lora_request=r1, use_tqdm=False)
    llm.classify(TEXTS, lora_request=[r1, r2, r1], use_tqdm=False)  # a1 held by the call when a2 comes
    assert len(made) == 2 and alive_at_fold == [0, 0]
    gc.collect()
    assert [ref() is not None for ref in made] == [False, True]  # the evicted copy is freed

    made.clear(), alive_at_fold.clear()
    kept = LLM(str(tiny_train_model), runner="pooling", device="cpu", enable_lora=True, max_loras=1,
               max_cpu_loras=2, max_lora_rank=8)
    for lora in (r1, r2, r1, r2):
        kept.classify(TEXTS, lora_request=lora, use_tqdm=False)
    assert len(made) == 2 and alive_at_fold == [0, 1]  # both kept: each folded once


def test_start_up_checks_adapters_without_folding_them(adapters, tiny_train_model, tmp_path, monkeypatch,
                                                      caplog) -> None:
    """`--lora-modules` are checked (config, tensor shapes) at start-up, not folded; more of them than the
    copies kept is a warning. A /classify response's labels then read no adapter config per prompt."""
    (a1, _), (a2, _) = adapters
    made, _ = counted_folds(monkeypatch)
    llm = LLM(str(tiny_train_model), runner="pooling", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    with caplog.at_level(logging.WARNING, logger="pagedrl.server"):
        build_pooling_app(llm, served_model_name="base", lora_modules=[LoRAModule("a1", str(a1)),
                                                                       LoRAModule("a2", str(a2))])
    assert made == []
    assert "2 --lora-modules and 1 folded copies kept" in caplog.text
    misfit = misfit_adapter(tmp_path)
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'o' does not fit the base .*up_proj"):
        build_pooling_app(llm, served_model_name="base", lora_modules=[LoRAModule("o", str(misfit))])
    mistral_classifier(tmp_path / "three", num_labels=3)  # the adapter's shapes, a head of three labels
    three = LLM(str(tmp_path / "three"), runner="pooling", device="cpu", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"^lora_request: adapter 'o' does not fit the base .*has 3 labels; a reward "
                                         r"model has one"):
        build_pooling_app(three, served_model_name="three", lora_modules=[LoRAModule("o", str(misfit))])
    assert made == []

    # a response's labels come from memory: as many adapter configs read for three prompts as for one
    app = build_pooling_app(llm, served_model_name="base", lora_modules=[LoRAModule("a1", str(a1))])
    reads = []
    read = pooling_loras.read_adapter_config
    monkeypatch.setattr(pooling_loras, "read_adapter_config", lambda folder: reads.append(folder) or read(folder))
    with TestClient(app) as client:
        def reads_of(body: dict) -> int:
            reads.clear()
            data = client.post("/classify", json=body).json()["data"]
            assert [d["label"] for d in data] == ["LABEL_0"] * len(body["input"])
            return len(reads)

        reads_of({"model": "a1", "input": TEXTS[:1]})  # folds a1
        assert reads_of({"model": "a1", "input": TEXTS}) == reads_of({"model": "a1", "input": TEXTS[:1]})


def test_a_classifier_base_answers_beside_its_adapters(tiny_train_model, adapters, tmp_path) -> None:
    """A classifier base (vLLM's usual case) answers requests that name no adapter, with its own head."""
    (a1, hf1), _ = adapters
    base_hf = hf1  # the merged a1 folder: a classifier written by transformers, serving here as a base
    base = tmp_path / "base"
    base_hf.save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_train_model / name, base / name)
    adapter, hf = seq_cls_adapter(base, tmp_path / "b", 5)
    llm = LLM(str(base), runner="pooling", device="cpu", enable_lora=True, max_lora_rank=4)
    ids = llm.encode_prompts(TEXTS)
    own = torch.tensor([o.outputs.probs[0] for o in llm.classify(TEXTS, use_tqdm=False)])
    assert torch.allclose(own, torch.tensor([float(torch.sigmoid(hf_scores(base_hf, x)[-1, 0])) for x in ids]),
                          atol=ATOL)
    got = llm.classify(TEXTS, lora_request=LoRARequest("b", 1, str(adapter)), use_tqdm=False)
    want = torch.tensor([float(torch.sigmoid(hf_scores(hf, x)[-1, 0])) for x in ids])
    assert torch.allclose(torch.tensor([o.outputs.probs[0] for o in got]), want, atol=ATOL)
    assert (want - own).abs().max() > 0.01


def test_the_server_serves_adapters_by_model_name(adapters, tiny_train_model, tmp_path) -> None:
    (a1, hf1), (a2, hf2) = adapters
    ids = LLM(str(a1), runner="pooling", device="cpu").encode_prompts(TEXTS)
    with running_server(tiny_train_model, tmp_path, "--runner", "pooling", "--device", "cpu", "--max-model-len", "32",
                        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                        "--lora-modules", f"a1={a1}", f"a2={a2}") as server:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(server.base_url + path, json=body, timeout=60)

        cards = {c["id"]: c for c in httpx.get(server.base_url + "/v1/models").json()["data"]}
        assert cards["a1"]["root"] == str(a1) and cards["a2"]["parent"] == str(tiny_train_model)
        for name, hf in (("a1", hf1), ("a2", hf2)):
            body = post("/classify", {"model": name, "input": TEXTS}).json()
            assert body["model"] == name
            got = torch.tensor([d["probs"][0] for d in body["data"]])
            want = torch.tensor([float(torch.sigmoid(hf_scores(hf, x)[-1, 0])) for x in ids])
            assert torch.allclose(got, want, atol=ATOL), name
            pooled = post("/pooling", {"model": name, "input": TEXTS[1]}).json()["data"][0]["data"]
            assert torch.allclose(torch.tensor(pooled), hf_scores(hf, ids[1]), atol=ATOL)
        base = post("/classify", {"input": TEXTS})
        assert base.status_code == 400 and base.json()["error"]["param"] == "model"
        assert base.json()["error"]["message"].startswith("model: the model is a causal LM, whose head scores nothing")
        missing = post("/pooling", {"model": "a3", "input": TEXTS})
        assert missing.status_code == 404 and "'a1', 'a2'" in missing.json()["error"]["message"]


def test_runtime_adapter_loading_is_refused_only_with_lora(adapters, tiny_train_model, monkeypatch) -> None:
    """$VLLM_ALLOW_RUNTIME_LORA_UPDATING (the default of --allow-runtime-lora-updating) set for another
    server does not stop one without --enable-lora; with LoRA the flag is refused by name."""
    (a1, _), _ = adapters
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    options = ["--runner", "pooling", "--device", "cpu", "--max-model-len", "32"]
    server = build_server(build_parser().parse_args([str(a1), *options]))
    assert server.config.app.state.served.lora_enabled is False
    with pytest.raises(ValueError, match=r"^--allow-runtime-lora-updating: the pooling runner serves the adapters "
                                         r"named at start-up"):
        build_server(build_parser().parse_args([str(tiny_train_model), *options, "--enable-lora"]))
