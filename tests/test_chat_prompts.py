"""The chat route's prompt: vLLM's `continue_final_message` against transformers' own rendering of it,
`chat_template_kwargs` reaching the template, and the requests refused rather than ignored."""

from __future__ import annotations

import pytest

from pagedrl.server.errors import ApiError
from pagedrl.server.inputs import chat_inputs, chat_prompt_ids
from pagedrl.server.protocol import ChatCompletionRequest, ChatMessage

PARTIAL = [ChatMessage(role="user", content="What is the capital of France?"),
           ChatMessage(role="assistant", content="The capital of France is")]


def test_continuing_the_final_message_matches_transformers(default_model_dir, default_tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    dicts = [m.model_dump(exclude_none=True) for m in PARTIAL]
    expected = hf.apply_chat_template(dicts, continue_final_message=True, tokenize=True, return_dict=False)
    got = chat_prompt_ids(default_tokenizer, PARTIAL, False, continue_final_message=True)
    assert got == list(expected)
    assert default_tokenizer.decode(got, skip_special_tokens=False).endswith("assistant\nThe capital of France is")


def test_an_empty_final_message_cannot_be_continued(default_tokenizer) -> None:
    with pytest.raises(ApiError) as e:
        chat_prompt_ids(default_tokenizer, [*PARTIAL[:1], ChatMessage(role="assistant", content="")], False,
                        continue_final_message=True)
    assert e.value.param == "continue_final_message"


def test_template_kwargs_reach_the_template_but_not_its_own_arguments(default_tokenizer) -> None:
    from pagedrl.model.tokenizer import Tokenizer

    tok = Tokenizer(default_tokenizer.backend, chat_template=(
        "{{ greeting | default('none') }}|{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"))
    text = tok.decode(chat_prompt_ids(tok, PARTIAL[:1], False, template_kwargs={"greeting": "hi",
                                                                                "add_generation_prompt": True}))
    assert text == "hi|What is the capital of France?"  # the route's add_generation_prompt wins
    assert tok.decode(chat_prompt_ids(tok, PARTIAL[:1], True)) == "none|What is the capital of France?>"


@pytest.mark.parametrize("extra,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"echo": True}, "echo"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_the_route_does_not_do_is_refused_by_name(default_tokenizer, extra, param) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [m.model_dump() for m in PARTIAL], **extra})
    with pytest.raises(ApiError) as e:
        chat_inputs(req, default_tokenizer)
    assert e.value.status == 400 and e.value.param == param
