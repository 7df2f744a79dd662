"""Sampling parameters of one request, with vLLM's names and meanings.

The dataclass is frozen so that a request's settings cannot drift while it is being
scheduled; derive a variant with `params.clone(max_tokens=...)` (or `dataclasses.replace`),
which runs the same validation again. Normalisation is idempotent for that reason: `stop`
and `stop_token_ids` always end up as lists, numbers as `int` / `float`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pagedrl.engine.structured_outputs import StructuredOutputsParams

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "processed_logprobs")
# As vLLM: a positive temperature below this is raised to it, since dividing float32 logits by
# a vanishing temperature overflows; temperature 0 (greedy) is the way to ask for the argmax.
MIN_TEMPERATURE = 1e-2
# Seeds are 64-bit, as torch's generators (and vLLM's protocol) take them.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# vLLM's bound on `logprob_token_ids`: a short list scored every step, not a vocabulary's worth.
MAX_LOGPROB_TOKEN_IDS = 128

logger = logging.getLogger(__name__)


class RequestOutputKind(enum.Enum):
    """What each step's output of a request carries (vLLM's kinds and names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request is done (offline use, rollouts)


def _bad(name: str, value: Any, requirement: str) -> ValueError:
    return ValueError(f"SamplingParams.{name} {requirement}, got {value!r}")


def _check_int(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, value, "must be an int" + (" or None" if optional else ""))


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, "must be a number")
    if not math.isfinite(value):  # inf and NaN would turn every probability into NaN or 0
        raise _bad(name, value, "must be a finite number")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to draw the completion tokens of one request.

    temperature 0 means greedy decoding (top_k/top_p/min_p are then ignored and no randomness
    is consumed). top_k 0 or -1 disables top-k; top_p 1.0 and min_p 0.0 disable theirs.
    `logprobs=k` returns the k most likely alternatives of every sampled token besides the
    sampled one; `logprobs_mode` says whether those come from the raw model distribution
    (vLLM's default) or from the processed one the token was drawn from. `max_tokens=None`
    means "until the context is full". `output_kind` says what each step's output carries
    (`LLM.generate` asks for FINAL_ONLY, a streaming server for DELTA). `structured_outputs`
    constrains the completion to a JSON schema, regex, choice or grammar (a `StructuredOutputsParams`
    or the dict of its fields); the constraint masks the processed distribution (see sampler.py).

    Three token choices, as vLLM's: `logit_bias` adds a bias to the logits of the token ids it names
    (keys may be ints or their decimal strings, as JSON carries them; each bias is clamped to
    [-100, 100], OpenAI's range, as vLLM does), `allowed_token_ids` restricts sampling to the ids it
    lists, and `bad_words` forbids each word's last token wherever the output already ends with the
    word's other tokens (with and without a leading space, as vLLM tokenizes them). All three act on
    the processed distribution before the penalties; raw log-probs stay the model's own.
    `logprob_token_ids` (vLLM's) asks for the log-probs of exactly these ids at every output token, in
    place of the `logprobs` most likely ones: a small label set (A/B/C/D, Yes/No) is scored whether or
    not it ranks among the top; each entry keeps the id's rank in the whole distribution. At most
    MAX_LOGPROB_TOKEN_IDS of them; `logprobs`, when also set, must equal their number (as vLLM checks).
    `truncate_prompt_tokens=k` keeps only the prompt's last k tokens (-1: as many as the context holds).
    `detokenize=False` (vLLM's, for callers that read token ids only, such as rollouts) leaves the
    text empty and log-prob entries unnamed, saving the decoding; stop strings then cannot be seen.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs_mode: LogprobsMode = "raw_logprobs"
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through the back door, once, here
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            _check_int(name, getattr(self, name), optional=True)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            set_(self, name, _as_float(name, getattr(self, name)))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be a bool")

        if self.seed == -1:  # vLLM's spelling of "no seed"
            set_(self, "seed", None)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise _bad("seed", self.seed, f"must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.n < 1:
            raise _bad("n", self.n, "must be at least 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise _bad("temperature", self.temperature, "must be non-negative (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s and is raised to it; use 0 for greedy",
                           self.temperature, MIN_TEMPERATURE)
            set_(self, "temperature", MIN_TEMPERATURE)
        if self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be -1 or 0 (disabled) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise _bad("max_tokens", self.max_tokens, "must be at least 1 (or None: up to the context)")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1):
            raise _bad("truncate_prompt_tokens", self.truncate_prompt_tokens,
                       "must be at least 1, or -1 (the context's length), or None")
        if self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise _bad(name, getattr(self, name), "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be greater than 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise _bad(name, value, "must be non-negative (or None)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _bad("output_kind", self.output_kind, "must be a RequestOutputKind")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _bad("logprobs_mode", self.logprobs_mode, f"must be one of {LOGPROBS_MODES}")

        if isinstance(self.structured_outputs, dict):
            set_(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise _bad("structured_outputs", self.structured_outputs,
                       "must be a StructuredOutputsParams, a dict of its fields, or None")
        set_(self, "stop", _normalise_stop(self.stop))
        if self.stop and not self.detokenize:
            raise _bad("stop", self.stop, "stop strings are matched in the text, which detokenize=False does not "
                                          "make; use stop_token_ids, or detokenize=True")
        set_(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        set_(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        set_(self, "allowed_token_ids", _normalise_allowed_token_ids(self.allowed_token_ids))
        set_(self, "bad_words", _normalise_bad_words(self.bad_words))
        named = self.logprob_token_ids
        set_(self, "logprob_token_ids", _normalise_logprob_token_ids(named))
        if self.logprob_token_ids is not None and self.logprobs is not None and self.logprobs != len(named):
            raise _bad("logprobs", self.logprobs, f"must equal len(logprob_token_ids) = {len(named)} "
                                                  "when both are set (or be None)")

    @property
    def num_logprobs(self) -> int | None:
        """How many log-probs each output token's entry carries besides the sampled one's (vLLM's):
        `logprobs`, else the number of `logprob_token_ids`; None when neither asks for any."""
        if self.logprobs is not None:
            return self.logprobs
        return None if self.logprob_token_ids is None else len(self.logprob_token_ids)

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the argmax and never draw from a generator."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs this request's token history at all."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def chooses_tokens(self) -> bool:
        """Whether `logit_bias` or `allowed_token_ids` change this request's logits at every step."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    def min_tokens_banned_ids(self, num_output_tokens: int, eos_token_ids: Iterable[int] = (),
                              vocab_size: int | None = None) -> list[int]:
        """Token ids the sampler must not draw next, so that no stop token ends the request
        before `min_tokens` outputs exist (as vLLM: EOS unless `ignore_eos`, plus `stop_token_ids`).
        A stop id at or above `vocab_size` is never drawn, so it needs no ban (any id may stop)."""
        if num_output_tokens >= self.min_tokens:
            return []
        banned = [i for i in self.stop_token_ids if vocab_size is None or i < vocab_size]
        if not self.ignore_eos:
            banned.extend(i for i in eos_token_ids if i not in banned)
        return banned

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy (with `changes` applied and validated); list fields are not shared."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["stop"] = list(self.stop)
        fields["stop_token_ids"] = list(self.stop_token_ids)
        for name in ("logit_bias", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            fields[name] = None if value is None else type(value)(value)
        fields.update(changes)
        return SamplingParams(**fields)


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", stop, "must be a str, a list of str, or None")
    if any(s == "" for s in stop):
        raise _bad("stop", stop, "must not contain the empty string")
    return list(stop)


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _bad("stop_token_ids", ids, "must be a list of int or None")
    if any(i < 0 for i in ids):
        raise _bad("stop_token_ids", ids, "must hold non-negative token ids")
    return list(ids)


# OpenAI's range for a logit bias; vLLM clamps to it too.
LOGIT_BIAS_LIMIT = 100.0


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", bias, "must be a dict of token id to bias, or None")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("+").isdigit():
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise _bad("logit_bias", bias, f"must have token ids (ints or decimal strings) as keys; {key!r} is not")
        if token < 0:
            raise _bad("logit_bias", bias, f"must have non-negative token ids as keys; {key!r} is not")
        value = _as_float(f"logit_bias[{key!r}]", value)
        if token in out:
            raise _bad("logit_bias", bias, f"names token {token} twice")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
    return out


def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _bad("allowed_token_ids", ids, "must be a list of int or None")
    if not ids:
        raise _bad("allowed_token_ids", ids, "must not be empty (None allows every token)")
    if any(i < 0 for i in ids):
        raise _bad("allowed_token_ids", ids, "must hold non-negative token ids")
    return list(dict.fromkeys(ids))


def _normalise_logprob_token_ids(ids: Any) -> list[int] | None:
    """None or an empty list: the top `logprobs` as usual (vLLM's server passes `ids or None`)."""
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _bad("logprob_token_ids", ids, "must be a list of int or None")
    if not ids:
        return None
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise _bad("logprob_token_ids", f"<{len(ids)} ids>", f"must hold at most {MAX_LOGPROB_TOKEN_IDS} ids")
    if any(i < 0 for i in ids):
        raise _bad("logprob_token_ids", ids, "must hold non-negative token ids")
    return list(dict.fromkeys(ids))


def _normalise_bad_words(words: Any) -> list[str] | None:
    if words is None:
        return None
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise _bad("bad_words", words, "must be a str, a list of str, or None")
    if any(not w.strip() for w in words):
        raise _bad("bad_words", words, "must not contain an empty or blank word")
    return list(words)
