"""Model configuration: a Hugging Face `config.json` read into one typed dataclass.

Every supported family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2, Phi-3 with its fused
projections, the mixture-of-experts Mixtral and Qwen3-MoE, Gemma 2/3 with the rules of
`model/gemma.py`, gpt-oss with those of `model/gpt_oss.py`, DeepSeek-V3 / Kimi K2 with latent attention and
the routing of `model/deepseek.py`) is the same decoder with a few
switches, so one dataclass holds them all; the switches are derived from the `architectures` entry
and the fields that family publishes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedrl.model.config_error import ConfigError
from pagedrl.model.deepseek import (
    DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_FIELDS,
    DeepseekRules,
    deepseek_dict,
    deepseek_fields,
)
from pagedrl.model.gemma import GEMMA_FIELDS, GemmaRules, gemma_dict, gemma_fields
from pagedrl.model.gpt_oss import GPT_OSS_FIELDS, GptOssRules, gpt_oss_dict, gpt_oss_fields
from pagedrl.model.qwen_windows import QWEN_LAYER_KINDS, qwen_window_fields
from pagedrl.model.rope_fields import phi3_fields, validate_longrope, validate_yarn

# architectures entry -> (model_type, q/k/v bias by default, q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "MixtralForCausalLM": ("mixtral", False, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "Phi3ForCausalLM": ("phi3", False, False),
    "Gemma2ForCausalLM": ("gemma2", False, False),
    "Gemma3ForCausalLM": ("gemma3_text", False, True),
    "GptOssForCausalLM": ("gpt_oss", True, False),
    "DeepseekV3ForCausalLM": ("deepseek_v3", False, False),
}
# Families whose sliding window applies only with `use_sliding_window` (transformers drops it otherwise).
SLIDING_WHEN_ASKED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Families whose config ties the output head to the embedding unless it says otherwise (transformers' default).
TIED_BY_DEFAULT = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Roles built on the same backbone; the suffix tells which head sits on top.
REWARD_ARCHITECTURE_SUFFIX = "ForSequenceClassification"


@dataclass
class ModelConfig:
    """What the decoder needs to know; field names are Hugging Face's."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # the share of each head the rotary embedding turns (Phi-4-mini: 0.75)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    # Mixture of experts (0 experts: every layer dense). Mixtral: every layer sparse, the top-k weights
    # renormalised, experts of `intermediate_size`; Qwen3-MoE: layers chosen by `decoder_sparse_step`
    # and `mlp_only_layers`, experts of `moe_intermediate_size`, renormalised if `norm_topk_prob`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    # Gemma 2/3: per-layer windows, attention scale, soft-capping, the sandwich norms (`model/gemma.py`).
    gemma: GemmaRules | None = None
    # gpt-oss: per-layer windows and the experts' clamped SwiGLU (`model/gpt_oss.py`); attention sinks.
    gpt_oss: GptOssRules | None = None
    # DeepSeek-V3: latent attention's shapes, the routing rule, the dense first layers (`model/deepseek.py`).
    deepseek: DeepseekRules | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.base_architecture][0]

    @property
    def base_architecture(self) -> str:
        """The causal-LM architecture under any head (reward models share the backbone)."""
        if self.architecture.endswith(REWARD_ARCHITECTURE_SUFFIX):
            return self.architecture.replace(REWARD_ARCHITECTURE_SUFFIX, "ForCausalLM")
        return self.architecture

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def rotary_dim(self) -> int:
        """The features of each head the rotary embedding turns (its first ones), as transformers rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fused_projections(self) -> bool:
        """Whether the layers hold one `qkv_proj` and one `gate_up_proj` (Phi-3, `model/fused.py`)."""
        return self.model_type == "phi3"

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's hidden width: Qwen3-MoE's `moe_intermediate_size`, Mixtral's `intermediate_size`."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def load_balancing_loss(self) -> bool:
        """Whether the family has the router's load-balancing loss: transformers' Mixtral, Qwen3-MoE and
        gpt-oss compute it, and their configs declare `output_router_logits`, which TRL's trainers take
        as the sign of a mixture of experts (whatever its value). DeepSeek-V3's config declares the field
        too, but neither its model nor its config holds the loss or a coefficient: none here either."""
        return self.num_experts > 0 and self.model_type in ("mixtral", "qwen3_moe", "gpt_oss")

    def sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes its tokens to experts, as transformers decides it."""
        if self.deepseek is not None:
            return layer >= self.deepseek.first_k_dense_replace
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_cache_layout(self) -> tuple[int, int, bool]:
        """(heads, features per head, whether values are cached apart from keys) of one layer's cache
        entry for one token: keys and values of every KV head; with latent attention, the latent alone."""
        if self.deepseek is not None:
            return 1, self.deepseek.latent_width, False
        return self.num_key_value_heads, self.head_dim, True

    @property
    def uniform_window(self) -> int | None:
        """The sliding window every layer applies (Mistral v0.1, Phi-3-mini, Qwen2/3 with
        `use_sliding_window` when every layer slides), or None. The engine applies it in attention and
        frees the blocks that fell out of it. Qwen's `max_window_layers` leaves its first layers full
        (transformers' rule: layer i slides when i >= max_window_layers, 28 by default): then the window is
        not uniform."""
        if not self.sliding_window:
            return None
        if self.architecture.replace(REWARD_ARCHITECTURE_SUFFIX, "ForCausalLM") in QWEN_LAYER_KINDS:
            return self.sliding_window if int(self.extra.get("max_window_layers", 28)) <= 0 else None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: it attends to every key): Gemma's and gpt-oss's per their
        layer kinds, or the uniform window in every layer."""
        rules = self.gemma or self.gpt_oss
        if rules is not None:
            return tuple(rules.window(i) for i in range(self.num_hidden_layers))
        return (self.uniform_window,) * self.num_hidden_layers

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine serves: the context. A model whose layers do not all share its
        window (Qwen's full first layers) is still capped at the window, which the engine cannot yet
        apply to some layers only (the dense training path would apply it to every one)."""
        if self.sliding_window and self.uniform_window is None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ConfigError(f"{source}: field 'architectures' is missing or empty")
        arch = archs[0]
        base = arch.replace(REWARD_ARCHITECTURE_SUFFIX, "ForCausalLM")
        if base not in ARCHITECTURES:
            raise ConfigError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        _, bias_default, qk_norm = ARCHITECTURES[base]

        def need(name: str, kind: type = int) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"{source}: required field {name!r} is missing")
            value = raw[name]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        if base in QWEN_LAYER_KINDS:  # (Qwen3-MoE has no layer kinds: with a window, every layer slides)
            raw = {**raw, **qwen_window_fields(raw, source)}
        sliding = raw.get("sliding_window")
        if base in SLIDING_WHEN_ASKED and not raw.get("use_sliding_window", False):
            sliding = None
        attention_bias = raw.get("attention_bias", bias_default) if base != "Qwen2ForCausalLM" else True
        if base in ("MixtralForCausalLM", "Phi3ForCausalLM"):
            attention_bias = False  # transformers' Mixtral and Phi-3 have no attention bias whatever the config says
        known = set(cls.__dataclass_fields__) | {
            "architectures", "rope_parameters", "use_sliding_window", "model_type", *MOE_FIELDS, *GEMMA_FIELDS,
            *(GPT_OSS_FIELDS if base == "GptOssForCausalLM" else ()),  # (another family keeps its quantization_config)
            *(DEEPSEEK_FIELDS if base in DEEPSEEK_ARCHITECTURES else ()),
        }
        phi3 = phi3_fields(raw, rope, scaling, source) if base == "Phi3ForCausalLM" else {}
        fields = dict(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", base in TIED_BY_DEFAULT)),
            attention_bias=bool(attention_bias),
            mlp_bias=bool(raw.get("mlp_bias", False)) and base != "Phi3ForCausalLM",
            qk_norm=qk_norm,
            sliding_window=sliding,
            hidden_act=raw.get("hidden_act", "silu"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            extra={k: v for k, v in raw.items() if k not in known},
            **moe_fields(raw, base, source),
            **phi3,
        )
        fields.update(gemma_fields(raw, base, source))
        fields.update(gpt_oss_fields(raw, base, source))
        fields.update(deepseek_fields(raw, base, scaling, source))
        cfg = cls(**fields)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        if self.hidden_act not in ("silu", "swish") and not (self.gemma and self.hidden_act == "gelu_pytorch_tanh"):
            raise ConfigError(f"{source}: hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{source}: head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.rope_scaling and self.rope_scaling["rope_type"] not in ("linear", "llama3", "longrope", "yarn"):
            raise ConfigError(f"{source}: rope type {self.rope_scaling['rope_type']!r} is not supported "
                              "(linear, llama3, longrope, yarn)")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' ({self.partial_rotary_factor!r}) must lie in "
                              f"(0, 1] and turn an even number of each head's {self.head_dim} features")
        if self.rope_scaling and self.rope_scaling["rope_type"] == "longrope":
            validate_longrope(self.rope_scaling, self.rotary_dim, source)
        if self.rope_scaling and self.rope_scaling["rope_type"] == "yarn":
            validate_yarn(self.rope_scaling, source)

        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"{source}: field 'num_experts_per_tok' must lie in 1..{self.num_experts}, "
                              f"got {self.num_experts_per_tok!r}")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: file not found")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, str(path))

    def to_dict(self) -> dict[str, Any]:
        """A config.json that transformers reads back as the same model."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {}),
                             **({"partial_rotary_factor": self.partial_rotary_factor}
                                if self.partial_rotary_factor != 1.0 else {})},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            hidden_act=self.hidden_act,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            dtype=self.torch_dtype,
        )
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
                out["use_sliding_window"] = True
        elif self.model_type in ("mistral", "mixtral"):
            out["sliding_window"] = None
        if self.model_type == "qwen3_moe" and self.sliding_window is None:
            out["use_sliding_window"] = False
        out.update(self.moe_dict())
        if self.gemma is not None:
            out.update(gemma_dict(self))
        if self.gpt_oss is not None:
            out.update(gpt_oss_dict(self))
        if self.deepseek is not None:
            out.update(deepseek_dict(self))
        if self.rope_scaling and self.rope_scaling["rope_type"] == "longrope":
            # transformers' Phi-3 takes the top-level field over the rope parameters' (default 4096).
            out["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        return out

    def moe_dict(self) -> dict[str, Any]:
        """The family's mixture-of-experts fields under its own names (none for a dense family)."""
        common = dict(num_experts_per_tok=self.num_experts_per_tok, router_aux_loss_coef=self.router_aux_loss_coef,
                      output_router_logits=self.output_router_logits)
        if self.model_type == "mixtral":
            return dict(common, num_local_experts=self.num_experts, router_jitter_noise=0.0)
        if self.model_type == "gpt_oss":
            return dict(common, num_local_experts=self.num_experts)
        if self.model_type == "qwen3_moe":
            return dict(common, num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                        norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                        mlp_only_layers=list(self.mlp_only_layers))
        return {}


# config.json fields the mixture-of-experts families publish (read by `moe_fields`, not kept as extras).
MOE_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
              "router_jitter_noise")


def moe_fields(raw: dict[str, Any], base: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json (none for a dense family),
    each checked; what pagedrl does not compute is refused by name rather than silently ignored."""
    if base not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return {}

    def count(name: str, value: Any, least: int = 1) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{source}: field {name!r} must be an integer >= {least}, got {value!r}")
        return value

    mixtral = base == "MixtralForCausalLM"
    # Qwen3-MoE's is `num_experts` (transformers also writes `num_local_experts` beside it), Mixtral's the other.
    name = "num_local_experts" if mixtral or "num_experts" not in raw else "num_experts"
    experts = count(name, raw.get(name, 8 if mixtral else 128), least=0 if not mixtral else 1)
    fields: dict[str, Any] = dict(
        num_experts=experts,
        num_experts_per_tok=count("num_experts_per_tok", raw.get("num_experts_per_tok", 2 if mixtral else 8)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(raw.get("output_router_logits", False)),
    )
    if mixtral:
        if float(raw.get("router_jitter_noise") or 0.0) != 0.0:
            raise ConfigError(f"{source}: field 'router_jitter_noise' ({raw['router_jitter_noise']!r}) is not "
                              "supported (only 0: no noise on the router's input in training)")
        return fields
    layers = raw.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ConfigError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    return dict(fields, moe_intermediate_size=count("moe_intermediate_size", raw.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=count("decoder_sparse_step", raw.get("decoder_sparse_step", 1)),
                mlp_only_layers=list(layers))
