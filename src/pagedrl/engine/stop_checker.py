"""When a sampled token ends its sequence, and why (vLLM's stop checker): EOS, a stop token, a stop
string, a finished structured output, max_tokens or the context length, checked in that order after
the token's text is detokenized."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from pagedrl.engine.sequence import Sequence
from pagedrl.model.tokenizer import find_stop_string


class Stop(NamedTuple):
    """How a sequence finishes: vLLM's finish_reason, its stop_reason (the stop token or string that
    matched) and whether the detokenizer's held-back text is still added (not after a stop string,
    which already cut the text where it matched)."""

    reason: str
    stop_reason: int | str | None = None
    flush: bool = True


def check_stop(seq: Sequence, token: int, eos_token_ids: Collection[int], max_model_len: int) -> Stop | None:
    """Add `token`'s text to `seq.text` (cut at a stop string that matched) and say whether `seq`
    ends with it; `token` is already appended to `seq`. As vLLM's: a stop token's own text (EOS's, a
    stop id's) stays out of the text unless `include_stop_str_in_output`, and stop strings count only
    once the output is longer than `min_tokens`."""
    p = seq.params
    eos = not p.ignore_eos and token in eos_token_ids
    delta = ""
    if seq.detokenizer is not None and (p.include_stop_str_in_output or not (eos or token in p.stop_token_ids)):
        delta = seq.detokenizer.step(token)
        seq.text += delta
    if eos:
        return Stop("stop")
    if token in p.stop_token_ids:
        return Stop("stop", token)
    if p.stop and delta and seq.num_output_tokens > p.min_tokens and (
            hit := find_stop_string(seq.text, p.stop, len(delta))) is not None:
        at, stop = hit
        seq.text = seq.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
        return Stop("stop", stop, flush=False)
    if seq.grammar is not None and seq.grammar.is_stopped:
        return Stop("stop")  # the structured output is complete: only EOS could follow
    if p.max_tokens is not None and len(seq.token_ids) - len(seq.prompt_token_ids) >= p.max_tokens:
        return Stop("length")
    if len(seq.token_ids) >= max_model_len:
        return Stop("length")
    return None
