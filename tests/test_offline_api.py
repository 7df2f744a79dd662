"""The offline API as a vLLM user writes it: prompt dicts, stop-token text, `min_tokens` against stop
strings, `cumulative_logprob`, `seed=-1`, `num_cached_tokens`, the package's top-level names, and the
commands' one-line refusals."""

from __future__ import annotations

import pytest

import pagedrl
from pagedrl.cli import main
from pagedrl.engine.llm import LLM
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model

PROMPT = "the cat sat on the mat"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=2048)


def test_text_and_token_prompt_dicts_are_prompts(llm):
    ids = llm.tokenizer.encode(PROMPT)
    plain = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    for form in ({"prompt": PROMPT}, [{"prompt": PROMPT}], {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]):
        (out,) = llm.generate(form, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids and out.prompt_token_ids == ids
    assert llm.generate({"prompt": PROMPT}, GREEDY, use_tqdm=False)[0].prompt == PROMPT
    with pytest.raises(ValueError, match=r"prompts\[1\]: a prompt dict holds exactly one of prompt, prompt_token_ids"):
        llm.generate([PROMPT, {"prompt": PROMPT, "multi_modal_data": {}}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate(PROMPT, {"max_tokens": 2}, use_tqdm=False)


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm):
    tokens = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = tokens[2]
    end = tokens.index(stop) + 1
    for include in (False, True):
        out = llm.generate(PROMPT, GREEDY.clone(stop_token_ids=[stop], include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[:end] and out.stop_reason == stop
        assert out.text == llm.tokenizer.decode(tokens[:end] if include else tokens[:end - 1])


def test_stop_strings_wait_for_min_tokens(llm):
    out = llm.generate(PROMPT, GREEDY.clone(max_tokens=16), use_tqdm=False)[0].outputs[0]
    first = llm.tokenizer.decode(out.token_ids[:1])
    assert first.strip()
    stop = first.strip()[0]
    early = llm.generate(PROMPT, GREEDY.clone(max_tokens=16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    held = llm.generate(PROMPT, GREEDY.clone(max_tokens=16, stop=[stop], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) == 1 and len(held.token_ids) > 4
    assert held.token_ids == out.token_ids[:len(held.token_ids)]


def test_cumulative_logprob_is_reported_with_logprobs_in_their_mode(llm):
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=6, ignore_eos=True, logprobs=0)
    for mode in ("raw_logprobs", "processed_logprobs"):
        out = llm.generate(PROMPT, sampled.clone(logprobs_mode=mode), use_tqdm=False)[0].outputs[0]
        chosen = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs, strict=True)]
        assert out.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-9)


def test_seed_minus_one_means_no_seed():
    assert SamplingParams(seed=-1).seed is None


def test_num_cached_tokens_counts_the_prompts_prefix_hits(llm):
    long = llm.tokenizer.encode(" ".join([PROMPT] * 12))
    first = llm.generate([long], GREEDY, use_tqdm=False)[0]
    second = llm.generate([long], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert 0 < second.num_cached_tokens < len(long) and second.num_cached_tokens % llm.block_size == 0


def test_vllms_top_level_names():
    from pagedrl.engine.outputs import CompletionOutput, RequestOutput
    from pagedrl.engine.sampling_params import RequestOutputKind
    from pagedrl.engine.structured_outputs import StructuredOutputsParams

    assert (pagedrl.RequestOutput, pagedrl.CompletionOutput, pagedrl.RequestOutputKind) == (
        RequestOutput, CompletionOutput, RequestOutputKind)
    assert pagedrl.GuidedDecodingParams is pagedrl.StructuredOutputsParams is StructuredOutputsParams
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = pagedrl.Nope


@pytest.mark.parametrize("argv,words", [
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be non-negative"),
    (["eval", "--operations", "/"], "operations: choose from"),
    (["eval", "--num-problems", "0"], "nothing to evaluate"),
])
def test_bad_command_arguments_are_one_line_before_the_model_loads(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_missing_model_is_one_line(tmp_path, capsys):
    for command in (["generate", str(tmp_path / "none"), "--prompt", "hi"], ["eval", str(tmp_path / "none")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "no such folder or file" in err and "Traceback" not in err


def test_chat_takes_vllms_arguments(llm):
    conv = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "the answer is"}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nthe answer is") and "what is\ntwo" in out.prompt
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}{{ greeting }}"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    (out,) = llm.chat(conv[:1], GREEDY, use_tqdm=False, chat_template=template, tools=tools,
                      chat_template_kwargs={"greeting": "!"})
    assert out.prompt == "[add]what is\ntwo!"
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(conv, GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], GREEDY, use_tqdm=False)


def test_chat_template_content_format_shapes_the_content_as_the_server_does(llm):
    """vLLM's `chat_template_content_format`: `auto` gives a template that loops over a message's content
    the list of parts, any other the joined text; `string` and `openai` force a shape; a tool's answer
    stays a string."""
    probe = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}S:{{ m['content'] }}"
             "{% else %}L:{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}|{% endfor %}")
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "tool", "content": "c"}]

    def prompt(template: str, fmt: str = "auto", messages: list | None = None) -> str:
        (out,) = llm.chat(messages or conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                          add_generation_prompt=False, chat_template_content_format=fmt)
        return out.prompt

    assert prompt(probe) == prompt(probe, "openai") == "<user>L:[a][b]|<tool>S:c|"
    assert prompt(probe, "string") == "<user>S:a\nb|<tool>S:c|"
    assert prompt(plain) == "user: a\nb|tool: c|"
    # a content of None (an assistant turn that only called tools) is no text parts, as the server shapes it
    calls = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]
    assert prompt(probe, "openai", calls) == "<user>L:[a]|<assistant>L:|"
    assert prompt(probe, "string", calls) == "<user>S:a|<assistant>S:|"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        prompt(plain, "list")


def test_the_models_generation_config_gives_the_default_sampling(tiny_train_model, tmp_path):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_train_model, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(folder), kv_cache_tokens=1024)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    (out,) = llm.generate(PROMPT, use_tqdm=False)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids and len(out.outputs[0].token_ids) <= 3
    assert LLM(str(folder), kv_cache_tokens=1024, generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()
    (folder / "generation_config.json").write_text(json.dumps({**config, "top_p": 2.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.top_p must be in \(0, 1\]"):
        LLM(str(folder), kv_cache_tokens=1024)


def test_the_server_fills_unset_fields_from_the_models_defaults():
    from pagedrl.server.inputs import completion_inputs
    from pagedrl.server.protocol import CompletionRequest

    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}
    _, params = completion_inputs(CompletionRequest(prompt="hi"), defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 16)  # the route's 16, as vLLM's
    _, params = completion_inputs(CompletionRequest(prompt="hi", temperature=1.0, max_tokens=9), defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 20, 9)  # what the request says wins
    assert completion_inputs(CompletionRequest(prompt="hi"))[1].max_tokens == 16  # OpenAI's default without them


def test_a_tokenizer_folder_stands_in_for_the_models(tiny_train_model, tmp_path):
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        LLM(str(tiny_train_model), tokenizer=str(tmp_path), kv_cache_tokens=1024)
    llm = LLM(str(tiny_train_model), tokenizer=str(tiny_train_model), kv_cache_tokens=1024)
    assert llm.get_tokenizer().encode(PROMPT) == llm.llm_engine.tokenizer.encode(PROMPT)


def test_sleep_levels_and_prefix_cache_reset(llm):
    with pytest.raises(ValueError, match="level 2 is not supported"):
        llm.sleep(level=2)
    long = llm.tokenizer.encode(" ".join([PROMPT] * 12))
    llm.generate([long], GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    assert llm.generate([long], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([long], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep(level=1)  # the cache's memory goes, and the prefixes it held with it
    llm.wake_up(tags=["kv_cache"])
    assert llm.generate([long], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_vllms_model_arguments(tiny_train_model):
    llm = LLM(str(tiny_train_model), kv_cache_tokens=1024, trust_remote_code=True, tensor_parallel_size=1)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="tensor_parallel_size 2: one model is served on one device"):
        LLM(str(tiny_train_model), tensor_parallel_size=2)


def test_a_generation_config_folder_and_override_give_the_defaults_and_the_cap(tmp_path):
    """vLLM's `generation_config=FOLDER` and `override_generation_config`: the folder's keys, the
    override's over them; a max_new_tokens the operator chose caps served requests, the model's does not."""
    import json

    from pagedrl.engine.generation_defaults import generation_defaults

    model = {"temperature": 0.7, "max_new_tokens": 50}
    auto = generation_defaults("auto", model, "m/generation_config.json", {"top_k": 5})
    assert auto.params == {"temperature": 0.7, "top_k": 5, "max_tokens": 50} and auto.max_tokens_cap is None
    assert generation_defaults("vllm", model, "m", {"max_new_tokens": 9}).params == {"max_tokens": 9}
    assert generation_defaults("vllm", model, "m", {"max_new_tokens": 9}).max_tokens_cap == 9
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 7}))
    folder = generation_defaults(str(tmp_path), model, "m", {"top_p": 0.9})
    assert folder.params == {"top_p": 0.9, "max_tokens": 7} and folder.max_tokens_cap == 7
    with pytest.raises(ValueError, match="does not exist"):
        generation_defaults(str(tmp_path / "none"), model, "m")


def test_a_cache_salt_keeps_prefix_hits_to_prompts_of_the_same_salt(llm):
    """vLLM's `cache_salt` (a prompt dict's key) is mixed into the first block's hash: the same prompt under
    another salt (or none) finds nothing cached, under the same salt it does; the output is the same."""
    long = llm.tokenizer.encode("salted " + " ".join([PROMPT] * 11))  # a start no other test's prompt has

    def run(**salt: str) -> RequestOutput:
        return llm.generate({"prompt_token_ids": long, **salt}, GREEDY, use_tqdm=False)[0]

    plain = run()
    assert plain.num_cached_tokens == 0
    assert run(cache_salt="alice").num_cached_tokens == 0 and run(cache_salt="bob").num_cached_tokens == 0
    again = run(cache_salt="alice")
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == plain.outputs[0].token_ids
    assert run().num_cached_tokens > 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string, got ''"):
        run(cache_salt="")
