"""Phi-3 (`Phi3ForCausalLM`): what the family-parametrized reference tests do not cover on their own.
LongRoPE past the original length against transformers' cached decoding, the config's rules as
transformers' Phi3Config reads them, the first SFT and DPO batches' losses and gradients against
transformers, the log-prob contract, and `pagedrl serve` on a Phi-3 folder."""

from __future__ import annotations

import decoder_bound
import pytest
import torch
import transformers
from first_batches import (
    assert_first_dpo_batch_equals_transformers,
    assert_first_sft_batch_equals_transformers,
)
from tiny import FAMILIES, freq_error, hf_model, ours_from
from tiny_train import build_model_dir

from pagedrl.model.config import ConfigError, ModelConfig

PHI3 = FAMILIES["phi3-longrope"]



def test_past_the_original_length_the_logits_are_transformers_cached_decoding() -> None:
    """transformers switches to the long factors for the tokens decoded past position 63 and keeps the
    cached keys as they were; pagedrl's one forward over 80 tokens, which rotates each position by its
    own set, gives the same logits at every position (within float32's bound, ~1e-5). transformers' one
    forward over all 80 (the long set everywhere) falls outside that bound: the comparison tells the rules apart."""
    hf = hf_model(PHI3)
    ours = ours_from(hf)
    ids = torch.randint(3, 211, (1, 80), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(input_ids=ids[:, :60], use_cache=True)
        steps = [out.logits]
        for t in range(60, 80):
            out = hf(input_ids=ids[:, t:t + 1], cache=out.past_key_values, use_cache=True)
            steps.append(out.logits)
        ref = torch.cat(steps, 1)
        got = ours.logits(ours(ids))
    probed = decoder_bound.logits(ours, ids, freq_error=freq_error(hf, ours))
    for logits in (ref, got):
        assert ((logits.double() - probed.exact).abs() <= probed.bound()).all()
    with torch.no_grad():
        whole = hf(input_ids=ids).logits
    assert ((whole.double() - probed.exact).abs() > probed.bound()).any()


def test_config_as_transformers_reads_it() -> None:
    raw = dict(PHI3, rope_parameters=None, rope_scaling=dict(PHI3["rope_parameters"], type="su",
                                                               original_max_position_embeddings=999))
    del raw["rope_scaling"]["rope_type"]
    cfg = ModelConfig.from_dict(raw)
    # "su" is LongRoPE; the top-level original length wins over the rope parameters' (transformers' rule)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 64
    assert cfg.rotary_dim == 12 and cfg.head_dim == 16 and cfg.fused_projections
    back = transformers.Phi3Config(**{k: v for k, v in cfg.to_dict().items() if k != "model_type"})
    assert back.rope_parameters["partial_rotary_factor"] == 0.75
    assert back.rope_parameters["original_max_position_embeddings"] == 64
    assert back.rope_parameters["short_factor"] == PHI3["rope_parameters"]["short_factor"]
    plain = ModelConfig.from_dict(dict(PHI3, rope_parameters=None, partial_rotary_factor=1.0, sliding_window=2047,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))
    assert plain.rope_scaling is None and plain.rotary_dim == 16 and plain.max_model_len == 256
    mini = ModelConfig.from_dict(dict(PHI3, max_position_embeddings=4096, sliding_window=2047))
    assert (mini.max_model_len, mini.uniform_window) == (4096, 2047)  # the window applied, not a cap
    assert plain.to_dict()["resid_pdrop"] == 0.0  # kept and written back
    for change, field in [(dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
                          (dict(rope_parameters=dict(PHI3["rope_parameters"], short_factor=[1.0])), "short_factor"),
                          (dict(original_max_position_embeddings=0), "original_max_position_embeddings")]:
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_dict(dict(PHI3, **change))


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory):
    """A tiny Phi-3 folder with a tokenizer (LongRoPE, partial rotation; rows stay within the original
    length, where transformers' one-forward rule and pagedrl's per-position one agree)."""
    fields = {k: PHI3[k] for k in ("architectures", "partial_rotary_factor", "original_max_position_embeddings",
                                   "rope_parameters")}
    return build_model_dir(tmp_path_factory.mktemp("phi3") / "model", std=0.05, **fields)


@pytest.fixture(scope="module")
def phi3_reference(tmp_path_factory):
    """Another Phi-3 folder (other weights): DPO's reference."""
    fields = {k: PHI3[k] for k in ("architectures", "partial_rotary_factor", "original_max_position_embeddings",
                                   "rope_parameters")}
    return build_model_dir(tmp_path_factory.mktemp("phi3-ref") / "model", seed=1, std=0.05, **fields)


def test_first_sft_and_dpo_batches_equal_transformers(phi3_folder, phi3_reference, tmp_path) -> None:
    assert_first_sft_batch_equals_transformers(phi3_folder, tmp_path / "sft")
    assert_first_dpo_batch_equals_transformers(phi3_folder, phi3_reference, tmp_path / "dpo")


def test_log_prob_contract() -> None:
    from test_engine_sampling import assert_logprob_contract

    assert_logprob_contract(hf_model(PHI3))


def test_serve_answers_as_the_engine_generates(phi3_folder, tmp_path) -> None:
    from server_process import assert_serves_the_engines_text

    assert "fused qkv_proj and gate_up_proj" in assert_serves_the_engines_text(phi3_folder, tmp_path)
