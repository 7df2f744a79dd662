"""SamplingParams: vLLM defaults, normalisation, and a named ValueError for every bad value."""

import dataclasses
import math

import pytest

from pagedrl.engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs) == (False, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert p.logprobs_mode == "raw_logprobs"
    assert not p.is_greedy and not p.has_penalties


@pytest.mark.parametrize("stop, expected", [
    (None, []), ("###", ["###"]), (["a", "b"], ["a", "b"]), (("a",), ["a"])])
def test_stop_is_normalised_to_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_numbers_are_normalised_and_normalisation_is_idempotent():
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1, stop="x", stop_token_ids=(3, 4))
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float) and p.stop_token_ids == [3, 4]
    assert dataclasses.replace(p) == p and p.clone() == p


def test_frozen_and_clone_revalidates_without_sharing_lists():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], max_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 9  # type: ignore[misc]
    q = p.clone(max_tokens=32, temperature=0)
    assert q.max_tokens == 32 and q.is_greedy and q.stop == ["a"] and p.max_tokens == 8
    q.stop.append("b")
    assert p.stop == ["a"]
    with pytest.raises(ValueError, match="max_tokens"):
        p.clone(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0.0)


def test_valid_edges_are_accepted():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, max_tokens=None, min_tokens=100, temperature=0.0,
                   presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5, logprobs=0,
                   prompt_logprobs=0, seed=-3, logprobs_mode="processed_logprobs")
    SamplingParams(min_tokens=4, max_tokens=4)


@pytest.mark.parametrize("kwargs, name", [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": None}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 1.0}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 3.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": 3}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 3.0}, "truncate_prompt_tokens"),
    ({"detokenize": 0}, "detokenize"),
    ({"detokenize": False, "stop": ["\n"]}, "stop"),
])
def test_bad_values_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} .*got"):
        SamplingParams(**kwargs)


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_tiny_positive_temperature_is_raised_like_vllm():
    assert SamplingParams(temperature=1e-9).temperature == 0.01
    assert SamplingParams(temperature=0.02).temperature == 0.02
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7, 9])
    assert p.min_tokens_banned_ids(0, eos_token_ids=[2, 7]) == [7, 9, 2]
    assert p.min_tokens_banned_ids(2, eos_token_ids=[2]) == [7, 9, 2]
    assert p.min_tokens_banned_ids(3, eos_token_ids=[2]) == []
    # With ignore_eos, EOS is an ordinary token and needs no ban.
    assert p.clone(ignore_eos=True).min_tokens_banned_ids(0, eos_token_ids=[2]) == [7, 9]
    assert SamplingParams().min_tokens_banned_ids(0, eos_token_ids=[2]) == []
