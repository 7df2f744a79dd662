"""Grammar matchers for structured outputs (llguidance), and the token masks they produce.

Why llguidance (bench/bench_grammar.py, recorded in bench/RESULTS.md): on one CPU thread it compiles
a JSON schema for a 49k-token vocabulary in about a millisecond, where xgrammar and outlines-core
take hundreds (a cost every new request would pay on the engine's thread), its mask costs tens of
microseconds per token, and it is a single wheel with no dependencies (xgrammar needs transformers
and triton at run time, outlines-core has no general grammars).

One `GrammarCompiler` per engine turns `StructuredOutputsParams` into a checked grammar (cached by
the constraint's text, so equal constraints compile once) and hands each constrained sequence its
own `TokenMatcher`. A constraint that compiles but could never be met (a schema no finite value
matches, a grammar that fails at its first mask) is refused here too, before any request holds it.
The matcher lives on the sequence and advances on every token it appends; a preempted sequence keeps
its tokens and therefore its matcher, so recompute needs no replay.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedrl.engine.structured_outputs import StructuredOutputsParams, grammar_text, unenforceable

CACHE_SIZE = 256  # compiled constraints kept (a few kilobytes each)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask: bit `t % 32` of word `t // 32` is 1 when token t is allowed."""
    return (vocab_size + 31) // 32


# Byte value -> its 8 bits (little-endian, as the words' bytes are laid out on every supported machine),
# as 0 for an allowed token and -inf for a refused one: adding that bias to logits masks them with one
# table lookup and one add, several times cheaper on a CPU than unpacking bits and `masked_fill`.
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
_BYTE_BIAS = torch.zeros(256, 8).masked_fill(_BYTE_BITS == 0, float("-inf"))


def unpack_bitmask(bits: Tensor, vocab_size: int) -> Tensor:
    """[N, W] int32 bitmasks -> [N, vocab_size] bool, True where a token is allowed."""
    return F.embedding(bits.view(torch.uint8).long(), _BYTE_BITS.to(bits.device)).flatten(1)[:, :vocab_size].bool()


def bitmask_bias(bits: Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """[N, W] int32 bitmasks -> [N, vocab_size] additive bias: 0 where allowed, -inf where refused
    (adding 0 leaves a logit bit for bit as it was)."""
    table = _BYTE_BIAS.to(device=bits.device, dtype=dtype)
    return F.embedding(bits.view(torch.uint8).long(), table).flatten(1)[:, :vocab_size]


class TokenMatcher:
    """One sequence's place in its grammar. With `waits_for` (a thinking model's end-of-reasoning token)
    the grammar starts only after one of those tokens: until then the sequence is unconstrained (no
    mask, nothing advanced, never stopped by the grammar), as vLLM's structured outputs wait for the
    reasoning to end."""

    def __init__(self, matcher: Any, constraint: str, waits_for: frozenset[int] = frozenset()) -> None:
        self._matcher = matcher
        self.constraint = constraint  # for error messages
        self.waits_for = waits_for

    @property
    def waiting(self) -> bool:
        """True while the reasoning before the grammar goes on."""
        return bool(self.waits_for)

    def fill_bitmask(self, row: Tensor) -> None:
        """Write the allowed next tokens into `row`, a contiguous CPU int32 tensor of `bitmask_words`."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._matcher.is_error():
            raise RuntimeError(f"the grammar of {self.constraint} failed: {self._matcher.get_error()}")

    def accept(self, token: int) -> None:
        """Advance past a sampled token (which the mask allowed, so a refusal is a bug, not bad input)."""
        if self.waiting:
            if token in self.waits_for:
                self.waits_for = frozenset()
            return
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar of {self.constraint} refused token {token}: {self._matcher.get_error()}")

    @property
    def is_stopped(self) -> bool:
        """True when the grammar is complete and nothing but EOS may follow."""
        return not self.waiting and self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """True when the text so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    def copy(self) -> TokenMatcher:
        return TokenMatcher(self._matcher.deep_copy(), self.constraint, self.waits_for)


class StepBitmasks:
    """The grammar masks of one step's sequences, written into rows of a buffer kept across steps."""

    def __init__(self, vocab_size: int) -> None:
        self.words = bitmask_words(vocab_size)
        self._rows = torch.empty(0, self.words, dtype=torch.int32)

    def fill(self, grammars: list[TokenMatcher | None]) -> tuple[list[Tensor | None], dict[int, str]]:
        """Per sequence its allowed next tokens (None when unconstrained), and the sequences whose
        grammar failed (an llguidance limit hit mid-way), by index, with the reason: those are ended
        on their own, so one request's grammar never takes down the step of the others."""
        grammars = [None if g is None or g.waiting else g for g in grammars]
        picked = sum(g is not None for g in grammars)
        if self._rows.shape[0] < picked:
            self._rows = torch.empty(max(picked, 2 * self._rows.shape[0]), self.words, dtype=torch.int32)
        masks: list[Tensor | None] = [None] * len(grammars)
        failed: dict[int, str] = {}
        j = 0
        for i, grammar in enumerate(grammars):
            if grammar is None:
                continue
            try:
                grammar.fill_bitmask(self._rows[j])
            except RuntimeError as e:
                failed[i] = str(e)
                continue
            masks[i] = self._rows[j]
            j += 1
        return masks, failed


class GrammarCompiler:
    """Checked grammars for one tokenizer and vocabulary. Safe to call from two threads (the server
    checks a request on its event loop, the engine builds matchers on its own thread)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's: masks cover every id it can produce
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the compiled templates
        self._tokenizer_lock = threading.Lock()

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def _llg_tokenizer(self) -> Any:
        """Built on first use (a fraction of a second for a 50k vocabulary), then shared."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance

                try:
                    self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                             eos_token=self.eos_token_ids or None)
                except Exception as e:  # e.g. a tokenizer with more tokens than the model's vocabulary
                    raise ValueError(f"structured outputs are not available for this tokenizer: {e}") from None
            return self._tokenizer

    def matcher(self, params: StructuredOutputsParams) -> TokenMatcher:
        """A fresh matcher at the start of the constraint; ValueError (naming the field, e.g.
        `structured_outputs.json`) when the schema, regex or grammar is invalid. The lock is not held
        while compiling, so a long compile on the server's side never stalls the engine's thread."""
        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._compile(params)
            with self._lock:
                self._cache[key] = template
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        with self._lock:
            return TokenMatcher(template.deep_copy(), f"structured_outputs.{params.kind}",
                                frozenset(params.reasoning_end_token_ids))

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError if the constraint does not compile (and cache it if it does)."""
        self.matcher(params)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        kind = params.kind
        tokenizer = self._llg_tokenizer()
        try:
            grammar = grammar_text(params)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            reason = unenforceable(params)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a panic in the Rust library is a BaseException; it is still bad input
            message = str(e)
            if isinstance(e, ValueError) and message.startswith("structured_outputs."):
                raise
            raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} is invalid: {matcher.get_error().strip()}")
        if reason is None:
            reason = _first_mask_fails(matcher)
        if reason is not None:
            raise ValueError(f"structured_outputs.{kind} cannot be enforced: {reason}")
        return matcher


def _first_mask_fails(matcher: Any) -> str | None:
    """Why the grammar cannot even start (an llguidance limit hit at once, e.g. a grammar too large
    for its parser), or None: asked now, so such a constraint is a 400 and not a request ended in
    the engine at its first step."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if not probe.is_error():
        return None
    error = probe.get_error().strip().splitlines()
    return f"its grammar fails before the first token ({error[0] if error else 'no reason given'})"
