"""Adapters chosen per request on a real `pagedrl serve --enable-lora` process, through the `openai`
client: the request's `model` picks the adapter, concurrent requests to the base and two adapters
each answer with the merged checkpoint's greedy text, and `/v1/load_lora_adapter` /
`/v1/unload_lora_adapter` change what is served without a restart; an adapter with NaN is refused
at start and at run time, and one whose numbers overflow fails its own requests, no others."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from multi_lora_cases import (
    GREEDY,
    MAX_RANK,
    PROMPTS,
    make_adapters,
    merged_greedy,
    nan_in_first_lora_a,
    pagedrl_adapter,
    rewrite_adapter,
)
from server_process import pagedrl_command, running_server

from pagedrl.cli import main
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.server.errors import ApiError
from pagedrl.server.lora_routes import UnloadLoRAAdapterRequest, adapter_to_unload
from pagedrl.server.served_models import LoRAModule, ServedModels

BODY = {"ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tiny_train_model, tmp_path_factory) -> tuple[dict[str, Path], dict[str | None, list[str]]]:
    adapters = make_adapters(tiny_train_model, tmp_path_factory.mktemp("adapters"))
    tokenizer = Tokenizer.from_folder(tiny_train_model)
    texts = {name: [tokenizer.decode(t) for t in tokens]
             for name, tokens in merged_greedy(tiny_train_model, adapters).items()}
    return adapters, texts


@pytest.fixture(scope="module")
def server(tiny_train_model, setup, tmp_path_factory):
    adapters, _ = setup
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-lora"), "--kv-cache-tokens", "2048",
                        "--served-model-name", "base", "base-alias", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", str(MAX_RANK), "--allow-runtime-lora-updating", "--lora-modules",
                        f"qv2={adapters['qv2']}", f'{{"name": "all4", "path": "{adapters["all4"]}"}}') as s:
        yield s


def complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=GREEDY.max_tokens, temperature=0,
                                    extra_body=BODY)
    assert out.model == model
    return out.choices[0].text


def test_models_lists_each_adapter_with_its_parent(client, setup) -> None:
    adapters, _ = setup
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:4] == ["base", "base-alias", "qv2", "all4"]  # vLLM's several served names
    assert cards["qv2"].parent == "base" and cards["qv2"].root == str(adapters["qv2"])
    assert getattr(cards["base"], "parent", None) is None
    _, texts = setup
    assert complete(client, "base-alias", PROMPTS[0]) == texts[None][0]  # the base under either name


def test_concurrent_requests_each_get_their_adapters_merged_tokens(client, server, setup) -> None:
    _, texts = setup
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in (None, "qv2", "all4")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(client, job[0] or "base", PROMPTS[job[1]]), jobs))
    for (name, i), answer in zip(jobs, answers, strict=True):
        assert answer == texts[name][i], (name, i)
    info = [line for line in httpx.get(server.base_url + "/metrics").text.splitlines()
            if line.startswith("pagedrl:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    chat = client.chat.completions.create(model="qv2", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "qv2" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        complete(client, "nope", PROMPTS[0])


def test_adapters_load_and_unload_at_run_time(client, server, setup, tmp_path, tiny_train_model) -> None:
    adapters, texts = setup
    url = server.base_url + "/v1"
    doc = httpx.get(server.base_url + "/openapi.json").json()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(doc["paths"])
    assert {"LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest"} <= set(doc["components"]["schemas"])
    with pytest.raises(openai.NotFoundError):
        complete(client, "peft8", PROMPTS[0])
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "peft8", "lora_path": str(adapters["peft8"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'peft8' added successfully."
    assert [complete(client, "peft8", p) for p in PROMPTS] == texts["peft8"]
    assert "peft8" in {m.id for m in client.models.list().data}
    again = httpx.post(url + "/load_lora_adapter", json={"lora_name": "peft8", "lora_path": str(adapters["peft8"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = httpx.post(url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 404 and "'x'" in missing.json()["error"]["message"]
    big = pagedrl_adapter(tiny_train_model, tmp_path / "r16", 16, ["q_proj"], seed=5)
    refused = httpx.post(url + "/load_lora_adapter", json={"lora_name": "r16", "lora_path": str(big)})
    assert refused.status_code == 400
    assert "rank 16 exceeds max_lora_rank 8" in refused.json()["error"]["message"]

    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "qv2"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'qv2' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(client, "qv2", PROMPTS[0])
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "qv2"}).status_code == 404
    # loaded again under the same name: a new id, served as before
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "qv2", "lora_path": str(adapters["qv2"])})
    assert r.status_code == 200
    assert complete(client, "qv2", PROMPTS[1]) == texts["qv2"][1]
    assert complete(client, "base", PROMPTS[1]) == texts[None][1]


def test_adapter_names_are_checked_and_a_bad_config_names_its_file(server, setup, tmp_path) -> None:
    adapters, _ = setup
    url = server.base_url + "/v1"
    for name in ("x" * 10_000, "two words", "a,b", "-flag", ""):
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters["peft8"])})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", name
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "org/peft8-v1.2", "lora_path": str(adapters["peft8"])})
    assert r.status_code == 200  # a Hub-style id is a fine name
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "org/peft8-v1.2"}).status_code == 200
    latin1 = shutil.copytree(adapters["peft8"], tmp_path / "latin1")
    config = json.loads((latin1 / "adapter_config.json").read_text())
    (latin1 / "adapter_config.json").write_bytes(json.dumps({**config, "revision": "café"},
                                                            ensure_ascii=False).encode("latin-1"))
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "latin1", "lora_path": str(latin1)})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and str(latin1 / "adapter_config.json") in message and "not UTF-8" in message


def test_an_adapter_is_unloaded_by_name_or_by_id(server) -> None:
    url = server.base_url + "/v1"
    assert httpx.post(url + "/unload_lora_adapter", json={}).status_code == 400
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_int_id": 999})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_int_id"
    served = ServedModels("base", read=lambda lora: None)
    a, b = served.load(LoRAModule("a", "/a")), served.load(LoRAModule("b", "/b"))
    assert adapter_to_unload(served, UnloadLoRAAdapterRequest(lora_int_id=b.lora_int_id)) == "b"
    assert adapter_to_unload(served, UnloadLoRAAdapterRequest(lora_name="a", lora_int_id=a.lora_int_id)) == "a"
    with pytest.raises(ApiError, match="'a' cannot be found"):  # both given: they must agree
        adapter_to_unload(served, UnloadLoRAAdapterRequest(lora_name="a", lora_int_id=b.lora_int_id))


def test_an_adapter_that_does_not_fit_stops_the_server_at_start(tiny_train_model, setup, tmp_path) -> None:
    big = pagedrl_adapter(tiny_train_model, tmp_path / "r16", 16, ["q_proj"], seed=5)
    cmd = [*pagedrl_command(), "serve", str(tiny_train_model), "--enable-lora", "--max-lora-rank", "8",
           "--lora-modules", f"big={big}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "LoRA adapter 'big'" in done.stderr and "rank 16 exceeds max_lora_rank 8" in done.stderr

def test_lora_flags_are_checked_before_loading(capsys) -> None:
    assert main(["serve", "--lora-modules", "a=/x"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--lora-modules", "a=/x", "a=/y"]) == 2
    assert "a name is given twice" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--lora-modules", "no-equals-sign"]) == 2
    assert "'no-equals-sign' is not name=path" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--lora-modules", "two words=/x"]) == 2
    assert "LoRA adapter name 'two words'" in capsys.readouterr().err
    assert main(["serve", "--enable-lora", "--max-loras", "0"]) == 2
    assert "--max-loras must be positive" in capsys.readouterr().err


def test_adapters_with_nan_are_refused_at_start_and_at_run_time(server, setup, tmp_path, tiny_train_model) -> None:
    adapters, _ = setup
    diverged = rewrite_adapter(adapters["qv2"], tmp_path / "diverged", nan_in_first_lora_a)
    cmd = [*pagedrl_command(), "serve", str(tiny_train_model), "--enable-lora", "--max-loras", "2",
           "--max-lora-rank", str(MAX_RANK), "--lora-modules", f"good={adapters['qv2']}", f"bad={diverged}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    named = [line for line in done.stderr.splitlines() if "LoRA adapter 'bad'" in line]
    assert len(named) == 1 and "lora_A holds 1 NaN or infinite values" in named[0], done.stderr

    url = server.base_url + "/v1/load_lora_adapter"
    r = httpx.post(url, json={"lora_name": "diverged", "lora_path": str(diverged)})
    assert r.status_code == 400
    assert "LoRA adapter 'diverged'" in r.json()["error"]["message"]
    assert "lora_A holds 1 NaN or infinite values" in r.json()["error"]["message"]
    alpha = rewrite_adapter(adapters["qv2"], tmp_path / "alpha", lora_alpha=math.nan)
    r = httpx.post(url, json={"lora_name": "alpha", "lora_path": str(alpha)})
    assert r.status_code == 400
    assert "'alpha'" in r.json()["error"]["message"]
    assert "lora_alpha: must be a finite number > 0, got nan" in r.json()["error"]["message"]
    assert {"diverged", "alpha"}.isdisjoint(m["id"] for m in httpx.get(server.base_url + "/v1/models").json()["data"])


def test_requests_whose_logits_overflow_fail_alone(server, setup, tmp_path) -> None:
    """An adapter of finite numbers too large for float32 passes the load check, and its requests' logits
    go NaN: each answers an error naming it (500, or an error event that ends its stream), never a 200 of
    garbage, while requests to the base and to another adapter beside it answer as ever."""
    adapters, texts = setup
    huge = rewrite_adapter(adapters["qv2"], tmp_path / "huge", lambda name, t: t * 1e30)
    url = server.base_url + "/v1"
    assert httpx.post(url + "/load_lora_adapter", json={"lora_name": "huge", "lora_path": str(huge)}).status_code == 200
    errors_before = server.metrics().get('pagedrl:request_success_total{finished_reason="error"}', 0.0)

    def ask(model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": GREEDY.max_tokens, "temperature": 0, **BODY}
        return httpx.post(url + "/completions", json=body, timeout=120)

    with ThreadPoolExecutor(3) as pool:  # side by side, in the same steps
        base, good, bad = pool.map(ask, ["base", "qv2", "huge"])
    assert base.status_code == 200 and base.json()["choices"][0]["text"] == texts[None][0]
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == texts["qv2"][0]
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "generation_error"
    assert "with LoRA adapter 'huge' are NaN or infinite at output token 0" in error["message"]

    body = {"model": "huge", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as stream:
        assert stream.status_code == 200  # the headers went out before the first step
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "generation_error" and "'huge'" in error["message"]
    assert not any('"finish_reason":"error"' in event for event in events)
    assert server.metrics()['pagedrl:request_success_total{finished_reason="error"}'] == errors_before + 2
