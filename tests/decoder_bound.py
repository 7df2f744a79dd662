"""How far a float32 (or bf16) forward of the decoder can be from the exact one, on a given model and
batch: what the reference tests (pagedrl's dense, paged and kernel paths, transformers, PEFT, TRL)
compare their logits and log-probs within.

A worst-case bound through a whole model is useless: pushed through operator norms, element-wise
magnitudes and the cancellations of random weights it grows ~20x per layer (0.1 on logits of ~1 after
two layers, where float32 is 3e-7 off), too loose to catch a bug. So this follows the probabilistic
rounding error analysis of Higham and Mary (SIAM J. Sci. Comput. 41, 2019): every rounding is an
independent error of mean zero and at most a unit roundoff. A float32 sum of K terms then errs by
at most sqrt(K) U times its terms' magnitudes in standard deviation (its worst case, gamma(K) ~ K U,
needs every rounding to line up); a stored result by U of itself; a library function (exp, rsqrt,
cos) by its worst-case error, counted whole since it need not average out. Each step of a float64
forward over the model's own weights adds, per element, such an error with a random sign; `PROBES`
such forwards carry them through the model as it carries them (its own derivative, with signs, no
norms). A result's error is then a sum of independent bounded terms whose variance the probes bound
from above; by Hoeffding's inequality it exceeds `SIGMAS` times that standard deviation with
probability below 2 exp(-SIGMAS^2 / 2) = 3e-8 per value. Nothing depends on the CPU: a class that
sums in other orders draws other roundings from the same distribution.

On the tiny test models the bound is ~1e-5 of logits of ~1 in float32 (float32 is 3e-7 off); a wrong
sign, a dropped term or an off-by-one position moves logits by 1e-2 or more, so no bug hides in it.

Each step's own error (products, norms, rotations, additions, the feed-forward): `rounding_steps.py`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from float_bounds import EXP_ERROR, U, cut_decided, gamma, logprob_bounds
from rounding_steps import (
    FLOAT32,
    Precision,
    Rounding,
    add,
    cast,
    linear,
    rms_norm,
    rotate,
    silu_mul,
    summed,
    swiglu,
)

PROBES = 32  # perturbed forwards: an RMS over 32 is below 0.6 of the true deviation with probability 1e-3
SIGMAS = 6.0  # standard deviations a bound spans


class Probed:
    """A result on the exact forward (`exact`) and on the perturbed ones (`samples`, [PROBES, ...]):
    anything computed from it probe by probe (a log_softmax, a gather, a sum over tokens, a loss)
    carries its own error estimate."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values  # [1 + PROBES, ...], float64; row 0 unperturbed

    @property
    def exact(self) -> torch.Tensor:
        return self.values[0]

    def map(self, fn) -> Probed:  # type: ignore[no-untyped-def]
        return Probed(torch.stack([fn(v) for v in self.values]))

    def bound(self) -> torch.Tensor:
        """SIGMAS standard deviations of the perturbed results about the exact one, per value."""
        return SIGMAS * (self.values[1:] - self.values[0]).pow(2).mean(0).sqrt()


def logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
           precision: Precision = FLOAT32, freq_error: torch.Tensor | float = 0.0,
           head: torch.nn.Module | None = None, positions: torch.Tensor | None = None,
           allowed: torch.Tensor | None = None, seed: int = 0) -> Probed:
    """The logits [B, T, V] of a pagedrl `CausalLM` on a batch, exact and perturbed; or what another
    `head` makes of the last hidden states (a `SequenceScorer`'s `score`: [B, T, 1]). The batch is
    padded as `model(ids, attention_mask=...)` takes it, or packed as a trainer packs it (its
    `positions` and its attention mask `allowed` [B, T, T]). `freq_error`: how far an
    implementation's rotary frequencies may be from the model's buffer (transformers forms its own in
    float32)."""
    rounding = Rounding(precision, seed)
    with one_thread(), torch.no_grad():
        last = cast(hidden(model, input_ids, attention_mask, rounding, freq_error, positions, allowed), rounding)
        return Probed(linear(last, model.lm_head if head is None else head, rounding))


def hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  precision: Precision = FLOAT32, positions: torch.Tensor | None = None,
                  allowed: torch.Tensor | None = None, seed: int = 0) -> Probed:
    """The final normed hidden states [B, T, hidden], exact and perturbed (as `logits` takes a batch)."""
    with one_thread(), torch.no_grad():
        return Probed(hidden(model, input_ids, attention_mask, Rounding(precision, seed), 0.0, positions, allowed))


def sampled_logprobs(rows: Probed, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, min_p: float = 0.0, allowed: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of logits [N, V] (exact and perturbed) and a token each [N]: the token's exact
    log-prob under the distribution the sampler draws from (its own `processed_logprobs`, run in
    float64 on each probe), and the bound of a float32 one's (an engine's or a trainer's): the
    logits' errors as the probes carry them, plus the division's and log_softmax's own roundings.
    `allowed` [N, V]: a structured output's mask, applied first. Where the truncation is not decided (float32 rounding may keep other tokens: logits of a tiny
    random model are nearly tied) the bound is infinite."""
    from pagedrl.engine.logits_processing import process_logits, processed_logprobs

    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, allowed=allowed)
    logit_error = rows.bound()
    scaled = rows.exact / temperature
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, -math.inf)
        logit_error = logit_error.masked_fill(~allowed, 0)
    decided = cut_decided(scaled, logit_error / temperature + U * scaled.abs().nan_to_num(posinf=0), top_k, top_p, min_p)
    values = rows.map(lambda v: processed_logprobs(v, tokens, **settings))
    kept = torch.isfinite(process_logits(rows.exact, **settings))
    own = logprob_bounds(rows.exact.masked_fill(~kept, -math.inf), 0.0, temperature).gather(1, tokens[:, None])[:, 0]
    return values.exact, (values.bound() + own).masked_fill(~decided, math.inf)


def completion_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], precision: Precision = FLOAT32,
                        **sampling: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampled_logprobs` of a completion's tokens after its prompt, one forward of the two."""
    probed = logits(model, torch.tensor([prompt + completion]), precision=precision)
    rows = probed.map(lambda v: v[0, len(prompt) - 1:-1])
    return sampled_logprobs(rows, torch.tensor(completion), **sampling)  # type: ignore[arg-type]


def answer_logprob_sums(model: torch.nn.Module, batch: Any, freq_error: torch.Tensor | float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair batch's (`train/algorithms/pair_batch.py`) per-answer sums of log-probs, exact (on its
    packed rows) and float32's bound on any computation of them: each token's bound, and the sum's
    own (any order: gamma(tokens) of the terms' magnitudes)."""
    probed = logits(model, batch.input_ids, positions=batch.positions, allowed=batch.meta.mask, freq_error=freq_error)
    rows = probed.map(lambda v: v.reshape(-1, v.shape[-1])[batch.predict_at])
    logp, bound = sampled_logprobs(rows, batch.targets)
    answers = 2 * batch.num_pairs
    sums = logp.new_zeros(answers).index_add(0, batch.answer_of, logp)
    sizes = logp.new_zeros(answers).index_add(0, batch.answer_of, logp.abs())
    return sums, logp.new_zeros(answers).index_add(0, batch.answer_of, bound) + gamma(len(logp)) * sizes


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tensors of a few hundred thousand float64s: one thread is fastest, most of all on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           rounding: Rounding, freq_error: torch.Tensor | float = 0.0,
           positions: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The final normed hidden states [1 + PROBES, B, T, hidden]: what the head (or a value head) reads."""
    cfg = model.config
    inner = model.model
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    B, T = ids.shape
    index = torch.arange(T)
    if allowed is None:
        keep = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
        allowed = (index[None, :] <= index[:, None])[None] & keep[:, None, :]
        if cfg.sliding_window is not None:
            allowed &= (index[:, None] - index[None, :] < cfg.sliding_window)[None]
        allowed |= torch.diag_embed(~keep)  # a padding query sees itself alone (its output is ignored)
    assert positions is not None and bool((positions <= index).all())
    freq = inner.inv_freq.double()
    longrope = getattr(inner, "longrope", None)
    if longrope is not None:  # LongRoPE: each position's frequency set (short, then long from the original length on)
        freq = torch.where((positions >= longrope.original_max_position_embeddings)[..., None], freq[1], freq[0])
    # An implementation's angle is pos * freq in float32 (a rounding) at a position up to the token's
    # index (transformers counts from the row's start, pagedrl from its first real token: rotary
    # attention depends only on differences) with its own frequencies; its cos and sin are each
    # within a library function's error of the exact ones, or rounded to the store dtype.
    angles = (positions.double()[..., None] * freq).expand(1 + PROBES, B, T, -1)
    turn = index[:, None].double() * (torch.as_tensor(freq_error, dtype=torch.float64) + U * freq)
    angles = rounding(angles, turn)
    table = rounding(angles.cos(), EXP_ERROR + rounding.keep), rounding(angles.sin(), EXP_ERROR + rounding.keep)
    if longrope is not None:  # cos and sin scaled by the attention factor (a product, kept)
        table = tuple(rounding(t * longrope.attention_factor, U * t.abs() * longrope.attention_factor) for t in table)
    x = inner.embed_tokens.weight.double()[ids].expand(1 + PROBES, B, T, -1)
    for layer in inner.layers:
        h = rms_norm(x, layer.input_layernorm, rounding)
        x = add(x, attention(cast(h, rounding), layer.self_attn, table, allowed, rounding), rounding)
        h = cast(rms_norm(x, layer.post_attention_layernorm, rounding), rounding)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            x = add(x, sparse_mlp(h, mlp, rounding), rounding)
        elif hasattr(mlp, "gate_up_proj"):  # Phi-3's fused gate and up rows
            gate, up = linear(h, mlp.gate_up_proj, rounding).chunk(2, dim=-1)
            x = add(x, linear(silu_mul(gate, up, rounding), mlp.down_proj, rounding), rounding)
        else:
            x = add(x, swiglu(h, mlp.gate_proj, mlp.up_proj, mlp.down_proj, rounding), rounding)
    return rms_norm(x, inner.norm, rounding)


class RoutingUndecided(AssertionError):
    """A token's k-th and (k+1)-th router probabilities lie within float rounding of each other, so
    implementations may pick different experts for it: no bound holds for this draw."""


def sparse_mlp(h: torch.Tensor, block: torch.nn.Module, rounding: Rounding) -> torch.Tensor:
    """A mixture-of-experts block (`model/moe.py`): the router's float32 softmax (each exponential within
    its argument's rounding and an exp's error, the sum summed(E) of itself, the division a unit), the
    exact forward's top k (a float32 forward makes the same choice where the k-th and (k+1)-th
    probabilities are further apart than their bounds; `RoutingUndecided` where not), the weights
    renormalised (a sum of k and a division) and, for Qwen3-MoE, stored; each chosen expert's SwiGLU,
    its product with the weight (stored in float32 for Mixtral, in the product's dtype for
    Qwen3-MoE), cast to the input's dtype and added up (a kept rounding per add)."""
    logits = linear(h, block.gate, rounding)
    shifted = logits - logits.amax(-1, keepdim=True)
    terms = shifted.exp()
    terms = rounding(terms, terms * (EXP_ERROR + U * shifted.abs()))
    total = terms.sum(-1, keepdim=True)
    total = rounding(total, total * summed(logits.shape[-1]))
    probs = terms / total
    probs = rounding(probs, U * probs)
    k = block.top_k
    ranked = probs[0].sort(-1, descending=True)
    error = Probed(probs).bound().gather(-1, ranked.indices)
    gap = ranked.values[..., k - 1] - ranked.values[..., k]
    # A zero row (the padding token's embedding, which transformers zeroes) gives zero whichever
    # experts it goes to, so its ties decide nothing.
    undecided = (gap <= error[..., k - 1] + error[..., k]) & (h[0] != 0).any(-1)
    if bool(undecided.any()):
        raise RoutingUndecided(f"a token's top-{k} experts are within rounding of the next (gap {gap.min():.2e})")
    chosen = ranked.indices[..., :k].expand(probs.shape[0], *ranked.indices.shape[:-1], k)
    w = probs.gather(-1, chosen)
    if block.renormalise:
        w = w / w.sum(-1, keepdim=True)
        w = rounding(w, w * (summed(k) + U))
    if block.weights_in_input_dtype:
        w = rounding(w, w * rounding.store)
    experts = block.experts
    size = experts.intermediate_size
    outputs = []
    for e in range(experts.num_experts):
        gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]
        gate, up = (expert_weight(experts, "gate_up_proj", e, gate_up, rows) for rows in (slice(0, size),
                                                                                           slice(size, None)))
        down = expert_weight(experts, "down_proj", e, down, slice(None))
        outputs.append(swiglu(h, gate, up, down, rounding))
    every = torch.stack(outputs, -2)  # [P, B, T, E, hidden]
    picked = every.gather(-2, chosen[..., None].expand(*chosen.shape, every.shape[-1]))
    product = picked * w[..., None]
    product_unit = rounding.store if block.weights_in_input_dtype else U
    product = rounding(product, product.abs() * (product_unit + rounding.keep))
    out = product[..., 0, :]
    for j in range(1, k):
        out = out + product[..., j, :]
        out = rounding(out, rounding.keep * out.abs())
    return out


@dataclass(frozen=True)
class Weight:
    """An expert's projection as `linear` reads a layer: a weight, no bias."""

    weight: torch.Tensor
    bias: None = None


def expert_weight(experts: torch.nn.Module, name: str, e: int, w: torch.Tensor, rows: slice) -> Any:
    """Expert e's projection `w` (the `rows` of its weight `name`), with that weight's LoRA update if one is
    on (`model/expert_lora.py`), as `linear` reads a LoRA layer."""
    adapters = getattr(experts, "adapters", {})
    if name not in adapters or adapters[name].disabled:
        return Weight(w[rows])
    a, b = adapters[name].factors(e)
    return SimpleNamespace(weight=w[rows], bias=None, lora_A=Weight(a), lora_B=Weight(b[rows]),
                           scaling=adapters[name].scaling, disabled=False)


def attention(x: torch.Tensor, attn: torch.nn.Module, table: tuple[torch.Tensor, torch.Tensor],
              allowed: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per head, then o_proj."""
    P, B, T, _ = x.shape
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if hasattr(attn, "qkv_proj"):  # Phi-3's fused query, key and value rows
        q, k, v = linear(x, attn.qkv_proj, rounding).split((H * D, Hkv * D, Hkv * D), dim=-1)
        q, k, v = q.reshape(P, B, T, H, D), k.reshape(P, B, T, Hkv, D), v.reshape(P, B, T, Hkv, D)
    else:
        q = linear(x, attn.q_proj, rounding).view(P, B, T, H, D)
        k = linear(x, attn.k_proj, rounding).view(P, B, T, Hkv, D)
        v = linear(x, attn.v_proj, rounding).view(P, B, T, Hkv, D)
    if attn.q_norm is not None:
        q, k = rms_norm(q, attn.q_norm, rounding, stored=True), rms_norm(k, attn.k_norm, rounding, stored=True)
    q, k = cast(rotate(q, *table, rounding), rounding), cast(rotate(k, *table, rounding), rounding)
    groups = H // Hkv
    k, v = k.repeat_interleave(groups, 3), v.repeat_interleave(groups, 3)
    scale = D**-0.5
    mask = allowed[None, :, None]  # [1, B, 1, T, T]
    store = rounding.store
    # A dot product of D terms and the scaling: summed(D + 1) of the terms' magnitudes, bounded by the
    # norms' product (which a rotary position shift keeps).
    scores = scale * torch.einsum("pbihd,pbjhd->pbhij", q, k)
    norms = torch.einsum("pbih,pbjh->pbhij", q.norm(dim=-1), k.norm(dim=-1))
    scores = rounding(scores, summed(D + 1) * scale * norms).masked_fill(~mask, -math.inf)
    keys = mask.sum(-1, keepdim=True)
    shifted = scores - scores.amax(-1, keepdim=True)
    spread = shifted.abs().masked_fill(~mask, 0)
    # Each exponential: its argument s_j - m (U |s_j - m|), the exp, and a rescale of the running sums
    # per later key (an online softmax in blocks as small as one key: an exp of the max's change, U of
    # that change, a product). The sum of them (summed(keys - 1)) and the division err alike for the
    # whole row; p rounds for the product with v.
    rescales = keys - 1
    terms = shifted.exp()
    terms = rounding(terms, terms * (U * spread + EXP_ERROR + rescales * (EXP_ERROR + U) + U * spread.amax(-1, keepdim=True)))
    total = terms.sum(-1, keepdim=True)
    total = rounding(total, total * (summed(keys - 1) + U))
    p = terms / total
    p = rounding(p, store * p)
    out = p @ v.transpose(2, 3)  # [P, B, H, T, D]
    out = rounding(out, (summed(keys) + store) * (p @ v.transpose(2, 3).abs()) + store * out.abs())
    return linear(out.transpose(2, 3).reshape(P, B, T, H * D), attn.o_proj, rounding)
