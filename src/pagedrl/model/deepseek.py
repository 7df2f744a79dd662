"""What DeepSeek-V3 (and Kimi K2, the same architecture) adds to the decoder, read from its config.json.

Attention is multi-head latent attention (`model/mla.py`): each token's keys and values are
up-projected from one compressed latent per layer, which is what the engine caches. The feed-forward
of every layer from `first_k_dense_replace` on is a mixture of experts with DeepSeek's routing rule,
as transformers' `DeepseekV3TopkRouter` computes it, in float32:

  scores  = sigmoid(x Wᵀ)                                  (one per routed expert)
  choice  = scores + e_score_correction_bias               (the bias steers the choice only)
  groups  = the experts cut into `n_group` groups; a group's score is the sum of its 2 best choices;
            only the `topk_group` best groups stay eligible
  chosen  = the `num_experts_per_tok` best choices among the eligible experts
  weights = their scores (not the biased ones), over their sum (+1e-20) if `norm_topk_prob`,
            times `routed_scaling_factor`

and `n_shared_experts` shared experts (one SwiGLU of `n_shared_experts × moe_intermediate_size`) see
every token, their output added to the routed experts'. transformers' DeepSeek-V3 computes no
load-balancing loss (the correction bias is what balances the experts, updated outside the
gradient), so none is recorded here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model.config_error import ConfigError

DEEPSEEK_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# config.json fields the family publishes that `deepseek_fields` reads (not kept as extras).
DEEPSEEK_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "rope_interleave", "n_routed_experts", "n_shared_experts", "n_group", "topk_group",
                   "routed_scaling_factor", "first_k_dense_replace", "qk_head_dim")


@dataclass(frozen=True)
class DeepseekRules:
    """The latent attention's shapes and the routing rule of a DeepSeek-V3 model, under transformers' names."""

    q_lora_rank: int | None  # None: queries from one `q_proj`, no compression
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int
    first_k_dense_replace: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """What one layer caches per token: the normed latent and the rotated shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """qk_head_dim^-1/2, times yarn's mscale(factor, mscale_all_dim)² under a rope scaling (transformers'
    `yarn_apply_mscale`: the longer context's sharper softmax)."""
    scale = qk_head_dim ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


def deepseek_fields(raw: dict[str, Any], base: str, scaling: dict[str, Any] | None, source: str) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 config.json (none for another family), each checked."""
    if base not in DEEPSEEK_ARCHITECTURES:
        return {}

    def count(name: str, default: Any, least: int = 1) -> int:
        value = raw.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{source}: field {name!r} must be an integer >= {least}, got {value!r}")
        return value

    quantized = raw.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ConfigError(f"{source}: field 'quantization_config' ({method!r}) is not supported: pagedrl reads "
                          "float weights (load a bf16 conversion of the checkpoint)")
    q_lora = raw.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = count("q_lora_rank", 1536)
    nope, rope = count("qk_nope_head_dim", 128), count("qk_rope_head_dim", 64)
    if rope % 2:
        raise ConfigError(f"{source}: field 'qk_rope_head_dim' ({rope}) must be even for rotary embeddings")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(f"{source}: field 'num_key_value_heads' ({kv_heads}) must equal num_attention_heads "
                          f"({heads}): latent attention up-projects keys and values for every head")
    experts = count("n_routed_experts", 256)
    groups, top_groups = count("n_group", 8), count("topk_group", 4)
    per_token = count("num_experts_per_tok", 8)
    if experts % groups or experts // groups < 2:
        raise ConfigError(f"{source}: field 'n_group' ({groups}) must divide n_routed_experts ({experts}) into "
                          "groups of at least 2 experts")
    if top_groups > groups or per_token > top_groups * (experts // groups):
        raise ConfigError(f"{source}: fields 'topk_group' ({top_groups}) and 'num_experts_per_tok' ({per_token}) "
                          f"must choose within {groups} groups of {experts // groups} experts")
    if scaling is not None and scaling["rope_type"] == "yarn":
        for name in ("factor", "original_max_position_embeddings"):
            if not isinstance(scaling.get(name), int | float) or scaling[name] <= 0:
                raise ConfigError(f"{source}: rope field {name!r} must be a positive number for rope type 'yarn', "
                                  f"got {scaling.get(name)!r}")
    rules = DeepseekRules(
        q_lora_rank=q_lora, kv_lora_rank=count("kv_lora_rank", 512), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=count("v_head_dim", 128), rope_interleave=bool(raw.get("rope_interleave", True)),
        softmax_scale=softmax_scale(nope + rope, scaling), n_group=groups, topk_group=top_groups,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        n_shared_experts=count("n_shared_experts", 1, least=0),
        first_k_dense_replace=count("first_k_dense_replace", 3, least=0),
    )
    return dict(deepseek=rules, head_dim=rope, num_key_value_heads=heads, num_experts=experts,
                num_experts_per_tok=per_token, moe_intermediate_size=count("moe_intermediate_size", 2048),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)), mlp_bias=False, output_router_logits=False)


def deepseek_dict(cfg: Any) -> dict[str, Any]:
    """The family's own config.json fields, as transformers writes them (for `ModelConfig.to_dict`)."""
    rules: DeepseekRules = cfg.deepseek
    return dict(
        q_lora_rank=rules.q_lora_rank, kv_lora_rank=rules.kv_lora_rank, qk_nope_head_dim=rules.qk_nope_head_dim,
        qk_rope_head_dim=rules.qk_rope_head_dim, v_head_dim=rules.v_head_dim, rope_interleave=rules.rope_interleave,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
        n_group=rules.n_group, topk_group=rules.topk_group, routed_scaling_factor=rules.routed_scaling_factor,
        n_shared_experts=rules.n_shared_experts, first_k_dense_replace=rules.first_k_dense_replace,
    )


# The router's tensors, held in float32 in a model of any precision (transformers'
# `_keep_in_fp32_modules_strict`): the correction bias moves choices by differences bf16 cannot hold.
ROUTER_FLOAT32 = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


class TopkRouter(nn.Module):
    """DeepSeek's router (transformers' `mlp.gate`): a float32 weight and the correction bias, a buffer
    that the checkpoint carries and no gradient moves. Both stay float32 when the model is cast."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        rules: DeepseekRules = cfg.deepseek
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.n_group, self.topk_group = rules.n_group, rules.topk_group
        self.renormalise, self.scaling = cfg.norm_topk_prob, rules.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """`.to(torch.bfloat16)` moves the router's tensors but leaves them float32 (`ROUTER_FLOAT32`)."""
        kept = [t.data if t.dtype == torch.float32 else None for t in (self.weight, self.e_score_correction_bias)]
        super()._apply(fn, recurse)
        for name, before in zip(("weight", "e_score_correction_bias"), kept, strict=True):
            now = getattr(self, name)
            if before is not None and now.dtype != torch.float32 and now.is_floating_point():
                now.data = before.to(now.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] → (router logits [N, E], chosen experts [N, k], their weights [N, k]), in float32."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        eligible = eligible.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        chosen = choice.masked_fill(~eligible, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, chosen, weights * self.scaling
