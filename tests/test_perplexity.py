"""Perplexity through the engine (`train/perplexity.py`): its windows score every token once, and
its sum equals the one transformers' model gives on the same windows, computed in float64."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrl.train.perplexity import perplexity, windows

TEXT = ("the cat sat on the mat and a dog ran in the park; what is two plus three? "
        "the answer is five, one two three four five six, red green blue yellow. ") * 3


@pytest.mark.parametrize("num_tokens,window,stride", [(2, 4, 2), (10, 4, 1), (10, 4, 3), (37, 16, 5), (100, 32, 31)])
def test_windows_score_each_token_once_with_the_context_they_promise(num_tokens, window, stride) -> None:
    spans = windows(num_tokens, window, stride)
    scored = [pos for _, end, first in spans for pos in range(first, end)]
    assert scored == list(range(1, num_tokens))
    for i, (begin, end, first) in enumerate(spans):
        assert end - begin <= window and begin <= first - 1
        if i:  # a later window gives its tokens window - stride tokens of context, or all there are
            assert end - first <= stride and first - begin >= min(window - stride, first)


def test_windows_refuse_what_cannot_be_cut() -> None:
    with pytest.raises(ValueError, match="stride in 1..window-1"):
        windows(10, 4, 4)
    with pytest.raises(ValueError, match="window must be >= 2"):
        windows(10, 1, 1)


def test_engine_perplexity_equals_transformers_on_the_same_windows(tiny_train_model) -> None:
    import transformers

    from pagedrl.engine.llm import LLM

    llm = LLM(str(tiny_train_model), dtype="float32", max_num_batched_tokens=24)  # chunked prompts too
    window, stride = 40, 16
    result = perplexity(llm, TEXT, window=window, stride=stride)
    ids = llm.tokenizer.encode(TEXT)
    assert result.tokens == len(ids) - 1 and result.windows > 2 and result.words == len(TEXT.split())

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_train_model), dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for begin, end, first in windows(len(ids), window, stride):
            logits = ref(torch.tensor([ids[begin:end]])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            nll -= sum(float(logp[pos - begin - 1, ids[pos]]) for pos in range(first, end))
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.token_perplexity == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-5)
