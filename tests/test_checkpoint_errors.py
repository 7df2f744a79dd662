"""Bad checkpoints fail with a message that names the file and the problem."""

from __future__ import annotations

import json

import pytest
from tiny import FAMILIES, hf_model

from pagedrl.model.checkpoint import CheckpointError, load_causal_lm


@pytest.fixture()
def saved(tmp_path):
    hf_model(FAMILIES["llama-gqa-untied"]).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        load_causal_lm(tmp_path / "nope")


def test_missing_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        load_causal_lm(saved)


def test_missing_weights(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model.safetensors"):
        load_causal_lm(saved)


def test_pickled_weights_are_named_with_the_way_out(saved):
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model.safetensors.*holds pytorch_model.bin.*safe_serialization"):
        load_causal_lm(saved)


def test_a_folder_with_a_slow_tokenizer_only_says_so(saved, caplog):
    from pagedrl.model.loader import load_model

    (saved / "tokenizer.json").unlink(missing_ok=True)
    (saved / "tokenizer.model").write_bytes(b"sentencepiece")
    with caplog.at_level("WARNING", logger="pagedrl.model.loader"):
        loaded = load_model(str(saved), device="cpu", dtype="float32")
    assert loaded.tokenizer is None
    assert "no tokenizer.json (it has tokenizer.model)" in caplog.text and str(saved) in caplog.text


def test_unsupported_architecture(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_causal_lm(saved)


def test_truncated_safetensors(saved):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot read safetensors file"):
        load_causal_lm(saved)


def test_garbage_safetensors(saved):
    (saved / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=r"model.safetensors"):
        load_causal_lm(saved)


def test_inconsistent_shapes(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' "
                                              r"has shape \(\d+, \d+\) but config.json implies"):
        load_causal_lm(saved)


def test_heads_not_dividing(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"num_attention_heads \(4\) is not a multiple of num_key_value_heads"):
        load_causal_lm(saved)


def test_missing_shard_named_by_index(tmp_path):
    hf_model(FAMILIES["llama-gqa-untied"]).save_pretrained(tmp_path / "m", max_shard_size="20KB")
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"names shard {shard.name}, which is missing"):
        load_causal_lm(tmp_path / "m")
