"""From a request's sequences to the `RequestOutput` its output kind asks for, at a cost that follows
the step's new tokens.

vLLM's three kinds (`SamplingParams.output_kind`): CUMULATIVE repeats everything so far each step (a
consumer that only keeps the latest output loses nothing), DELTA carries only what is new since the
last output (a streaming server), FINAL_ONLY gives one output when the request is done (offline
generation and rollouts). A DELTA or FINAL_ONLY output costs work proportional to what it carries:
a log-prob entry (with its decoded token names) is built once, when its token is sampled, and a
delta is a slice of what each sequence has not delivered yet.

A DELTA output holds back the last `len(longest stop string) - 1` characters of text until the
sequence finishes: a stop string arriving over several tokens is cut from the final text, and text
already delivered could not be taken back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedrl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrl.engine.sampling_params import RequestOutputKind
from pagedrl.engine.sequence import Request, Sequence

TokenName = Callable[[int], str | None]
# read for every request every step: module constants, not an enum class's attribute lookups
_FINAL_ONLY, _DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


def _unnamed(token: int) -> None:
    """The name of every token of a request with `detokenize=False` (vLLM's: `decoded_token` None)."""
    return None


def logprob_entry(token: int, chosen: float, top: dict[int, float] | None,
                  name: TokenName | None, rank: int | None = None,
                  top_ranks: list[int] | None = None) -> dict[int, Logprob]:
    """The sampled token's log-prob (and its `rank` in that distribution) and its ranked alternatives,
    each with its name (built once per token; None: no names). `top` holds the most likely tokens, best
    first, so an alternative's rank is its place there; or, with `top_ranks`, the ids a request named
    (`logprob_token_ids`), each with its own rank in the whole distribution."""
    name = name or _unnamed
    entry = {token: Logprob(chosen, rank=rank, decoded_token=name(token))}
    if top:
        for r, (t, v) in enumerate(top.items(), start=1):
            if top_ranks is not None:
                r = top_ranks[r - 1]
            if t == token:
                entry[token].rank = r if rank is None else rank
            else:
                entry[t] = Logprob(v, rank=r, decoded_token=name(t))
    return entry


def logits_error(seq: Sequence, finite: bool = False) -> str:
    """Why `seq` cannot go on: its logits hold NaN or infinities (overflow, or NaN weights, e.g. its
    LoRA adapter's), so the token drawn from them would be garbage and its log-prob NaN; or (`finite`
    logits) its own settings refuse every token: a structured output whose allowed tokens the request's
    allowed_token_ids, bad_words or min_tokens all ban."""
    if finite:
        return (f"nothing is left to sample at output token {seq.num_output_tokens}: the request's structured "
                "output, allowed_token_ids, bad_words and min_tokens together refuse every token")
    lora = "" if seq.lora is None else f" with LoRA adapter {seq.lora.lora_name!r}"
    return (f"the model's logits{lora} are NaN or infinite at output token {seq.num_output_tokens}; "
            "no token can be sampled from them")


def record_prompt_logprob(seq: Sequence, pos: int, logits: torch.Tensor, name: TokenName) -> None:
    """The entry of prompt token `pos + 1` from the logits of row `pos`: its log-prob and rank (1 +
    the tokens strictly more likely), and the `prompt_logprobs` best alternatives when asked for, each
    with its name (none with `detokenize=False`), as vLLM's."""
    name = name if seq.params.detokenize else _unnamed
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] * seq.num_prompt_tokens
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = seq.prompt_token_ids[pos + 1]
    value = logp[target]
    entry = {target: Logprob(float(value), rank=int((logp > value).sum()) + 1, decoded_token=name(target))}
    k = seq.params.prompt_logprobs or 0
    if k:
        vals, idx = logp.topk(k)
        for rank, (t, v) in enumerate(zip(idx.tolist(), vals.tolist(), strict=True), start=1):
            if t != target:
                entry[t] = Logprob(v, rank=rank, decoded_token=name(t))
    seq.prompt_logprobs[pos + 1] = entry


def _holdback(seq: Sequence) -> int:
    stop = seq.params.stop
    return max(len(s) for s in stop) - 1 if stop else 0


def _cumulative(seq: Sequence) -> float | None:
    """The sampled tokens' summed log-prob where log-probs were asked for; None otherwise, as vLLM."""
    return seq.cumulative_logprob if seq.params.num_logprobs is not None else None


def completion_output(seq: Sequence, delta: bool) -> CompletionOutput | None:
    """Everything so far, or (delta) what this sequence has not delivered yet; None when a delta is empty.

    Built for every streaming request every step, so it reads each field once and passes them by position."""
    if not delta:
        return CompletionOutput(seq.index, seq.text, seq.token_ids[seq.num_prompt_tokens:], _cumulative(seq),
                                seq.logprobs[:] if seq.params.num_logprobs is not None else None, seq.finish_reason,
                                seq.stop_reason, seq.processed_logprobs[:], seq.raw_logprobs[:], seq.error)
    if seq.finish_sent:
        return None
    finished = seq.finish_reason is not None
    text, chars_sent, start = seq.text, seq.num_chars_sent, seq.num_tokens_sent
    num_prompt = len(seq.prompt_token_ids)
    num_output = len(seq.token_ids) - num_prompt
    end_chars = len(text) if finished else max(chars_sent, len(text) - _holdback(seq))
    if end_chars == chars_sent and start == num_output and not finished:
        return None
    seq.num_chars_sent, seq.num_tokens_sent, seq.finish_sent = end_chars, num_output, finished
    return CompletionOutput(seq.index, text[chars_sent:end_chars], seq.token_ids[num_prompt + start:],
                            _cumulative(seq), seq.logprobs[start:] if seq.params.num_logprobs is not None else None,
                            seq.finish_reason, seq.stop_reason, seq.processed_logprobs[start:],
                            seq.raw_logprobs[start:], seq.error)


def make_output(req: Request) -> RequestOutput | None:
    """This step's output of `req` in its kind, or None when that kind has nothing to say now."""
    params = req.params
    kind = params.output_kind
    finished = req.is_finished
    if kind is _FINAL_ONLY and not finished:
        return None
    delta = kind is _DELTA
    seqs = req.seqs
    if len(seqs) == 1:  # most requests: no comprehension to build (50 of 450 us at 256 DELTA requests)
        c = completion_output(seqs[0], delta)
        if c is None:
            if not finished:
                return None
            outs = []
        else:
            outs = [c]
    else:
        outs = [c for seq in seqs if (c := completion_output(seq, delta)) is not None]
        if delta and not outs and not finished:
            return None
    first = seqs[0]
    prompt_lp = None
    if params.prompt_logprobs is not None and first.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        prompt_lp = [None if e is None else dict(e) for e in first.prompt_logprobs]
        req.prompt_logprobs_sent = delta  # a delta stream sends them once, with its first output
    metrics = {"arrival": req.arrival}
    if first.first_token_time:
        metrics["ttft"] = first.first_token_time - req.arrival
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, prompt_lp,
                         first.num_cached_tokens, metrics)
