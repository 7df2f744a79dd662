"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2`, `gemma3`), written here from random transformers
models as llama.cpp's converter writes them (norms stored as 1 + w, no head, a SentencePiece vocabulary
without a prefix space). Two kinds of tiny model: ones whose rules bite (small soft-caps, a global
rotary base apart from the sliding layers', linear scaling) held to the original model, since
transformers' GGUF reader does not read those fields; and ones on the values transformers assumes for
them, held to transformers reading the GGUF itself: logits, greedy tokens, the tokenizer's ids. The
engine keeps the file's quantized projections quantized with the tokens of the file dequantized."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import assert_file_follows, write_tiny_gguf
from test_gguf_engine import generate_both
from test_gguf_sentencepiece import BYTES, SPECIALS, train_pieces
from tiny import GEMMA_FAMILIES, hf_model

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.checkpoint import load_causal_lm, read_folder_config
from pagedrl.model.gguf import GGUFError, convert_gguf
from pagedrl.model.tokenizer import Tokenizer

# Gemma's vocabulary as llama.cpp writes it: its specials first, then runs of newlines and of spaces (the
# spaces written as spaces) and an HTML tag, all user-defined, the 256 byte tokens, then the pieces.
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["\n\n", "  ", "   ", "<table>"]
PIECES = ["\n"] + [t for t, _ in sorted(train_pieces().get_vocab().items(), key=lambda kv: kv[1]) if t not in SPECIALS]
TOKENS = CONTROL + USER_DEFINED + BYTES + PIECES
TEXTS = ["the cat sat on the mat", "Hello world", "  two leading spaces", "the\nnew line", "a\n\nb\n\n\nc",
         "héllo wörld 🐈", "ÆØÅ and ß", "end with space ", "x  y   z    w", "", "<table>in the rain",
         "<start_of_turn>user\nthe cat<end_of_turn>\n", "tokens\tand pieces"]

RULES = dict(vocab_size=len(TOKENS), bos_token_id=2, eos_token_id=1, pad_token_id=0, query_pre_attn_scalar=16)
# name -> transformers config. Their rules bite: written in the file (soft-caps, the global base and its
# scaling) or llama.cpp's for files of this size (the attention scale 1/sqrt(head_dim), Gemma 3's base
# 10000 on the sliding layers and its pattern of five sliding layers, then a global one).
BITING = {
    "gemma2": dict(GEMMA_FAMILIES["gemma2"], **RULES),
    "gemma3": dict(GEMMA_FAMILIES["gemma3"], **RULES, num_hidden_layers=7, layer_types=["sliding_attention"] * 5 + [
        "full_attention", "sliding_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
# On the values transformers' GGUF reader assumes where the file is silent (head size 256 so that its
# attention scale, 256^-1/2, is llama.cpp's; Gemma 2's caps of 50 and 30; no rope scaling).
ASSUMED = {
    "gemma2": dict(BITING["gemma2"], head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3": dict(BITING["gemma3"], head_dim=256, query_pre_attn_scalar=256, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
FLOAT32: dict[str, Q] = {}


def gemma_vocabulary(w: gguf.GGUFWriter) -> None:
    types = [int(gguf.TokenType.CONTROL)] * len(CONTROL) + [int(gguf.TokenType.USER_DEFINED)] * len(USER_DEFINED) \
        + [int(gguf.TokenType.BYTE)] * 256 + [int(gguf.TokenType.NORMAL)] * len(PIECES)
    types[CONTROL.index("<unk>")] = int(gguf.TokenType.UNKNOWN)
    w.add_token_list(TOKENS)
    w.add_token_types(types)
    w.add_token_scores([0.0] * (len(TOKENS) - len(PIECES)) + [-float(i) for i in range(len(PIECES))])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_eot_token_id(CONTROL.index("<end_of_turn>"))
    w.add_add_space_prefix(False)


def gemma_gguf(raw: dict, arch: str, folder: Path, types: dict[str, Q] | None = None,
               seed: int = 11) -> tuple[torch.nn.Module, Path]:
    hf = hf_model(raw, seed=seed)
    return hf, write_tiny_gguf(folder / f"{arch}.gguf", hf, arch=arch, tokenizer_model="llama",
                               types=FLOAT32 if types is None else types, vocabulary=gemma_vocabulary)


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, len(TOKENS), (2, 29), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(BITING))
def test_conversion_gives_back_the_original_model(arch: str, tmp_path: Path) -> None:
    """Every tensor the original's (the norms to within their float32 round trip through 1 + w, which
    leaves 1 + w itself exact), the rules in the config, and the logits within 1e-5 of the original's."""
    hf, path = gemma_gguf(BITING[arch], arch, tmp_path)
    out = convert_gguf(path, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        if k.endswith("norm.weight"):
            assert torch.equal(1 + got[k], 1 + want[k]), k
        else:
            assert torch.equal(got[k], want[k]), k
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_parameters", "head_dim", "tie_word_embeddings"):
        assert getattr(back.config, field) == getattr(hf.config, field), field
    ours = load_causal_lm(out, dtype=torch.float32)
    with torch.no_grad():
        assert float((ours.logits(ours(ids(0))) - hf(ids(0)).logits).abs().max()) < 1e-5
    assert read_folder_config(out).gemma.window(5 if arch == "gemma3" else 1) is None


@pytest.mark.parametrize("arch", sorted(ASSUMED))
def test_transformers_reading_the_gguf_gives_the_same_logits_and_greedy_tokens(arch: str, tmp_path: Path) -> None:
    """transformers' own GGUF reader on a file with Q8_0 projections: the same logits within 1e-5, and the
    engine on the file greedy-decodes transformers' `generate` tokens."""
    _, path = gemma_gguf(ASSUMED[arch], arch, tmp_path, types={"ffn_up": Q.Q8_0, "attn_q": Q.Q8_0, "attn_v": Q.Q8_0})
    direct = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    assert_file_follows(path, tmp_path / "hf", direct, len(TOKENS), ids(1))


@pytest.mark.parametrize("arch", sorted(BITING))
def test_engine_kept_quantized_gives_the_dequantized_engines_tokens(arch: str, tmp_path: Path) -> None:
    _, path = gemma_gguf(BITING[arch], arch, tmp_path, types={
        "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
        "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0})
    rng = np.random.default_rng(2)
    batch = [rng.integers(5, len(TOKENS), size=n).tolist() for n in (3, 17, 30, 9)]
    for params in (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, logprobs=0, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)):
        quantized, plain = generate_both(path, params, batch, enforce_eager=True)
        assert quantized == plain


@pytest.mark.parametrize("arch", sorted(BITING))
def test_ids_equal_transformers_gguf_tokenizer(arch: str, tmp_path: Path) -> None:
    """Texts with runs of spaces and newlines, tabs, bytes no piece spells, specials and a user-defined tag."""
    _, path = gemma_gguf(BITING[arch], arch, tmp_path)
    ours = Tokenizer.from_folder(convert_gguf(path, tmp_path / "hf"))
    direct = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        got = ours.encode(text)
        assert got[:1] == [2], text  # the file asks for BOS
        assert got == direct.encode(text), text
        assert ours.decode(got, True) == direct.decode(got, skip_special_tokens=True), text
        if "<start_of_turn>" not in text:
            assert ours.decode(got, True) == text, text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (2, 1, 0)


def test_unsupported_gemma_fields_are_named(tmp_path: Path) -> None:
    def yarn(w: gguf.GGUFWriter) -> None:
        gemma_vocabulary(w)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)

    hf = hf_model(dict(ASSUMED["gemma3"], head_dim=16, query_pre_attn_scalar=16), seed=1)
    path = write_tiny_gguf(tmp_path / "yarn.gguf", hf, arch="gemma3", tokenizer_model="llama", types=FLOAT32,
                           vocabulary=yarn)
    with pytest.raises(GGUFError, match=r"yarn\.gguf: gemma3\.rope\.scaling\.type 'yarn' is not supported"):
        convert_gguf(path, tmp_path / "out")


class _Field:
    def __init__(self, value: object) -> None:
        self.value = value

    def contents(self) -> object:
        return self.value


def read_gemma_config(arch: str, layers: int, **fields: object):
    """The config of a file with these fields (a Gemma 27B's sizes but `layers` layers), no tensors needed."""
    from types import SimpleNamespace

    from pagedrl.model.gguf_gemma import gemma_config
    from pagedrl.model.gguf_metadata import Metadata

    raw = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": 4608,
           f"{arch}.attention.head_count": 32, f"{arch}.attention.head_count_kv": 16,
           f"{arch}.attention.key_length": 128, f"{arch}.feed_forward_length": 36864,
           f"{arch}.attention.sliding_window": 4096, **{f"{arch}.{k}": v for k, v in fields.items()}}
    reader = SimpleNamespace(fields={k: _Field(v) for k, v in raw.items() if v is not None})
    return gemma_config(Metadata(reader, "x.gguf"), {"token_embd.weight": SimpleNamespace(shape=(4608, 256000))})


def test_what_the_file_leaves_out_is_llama_cpps_rule() -> None:
    """The attention scale: 1/sqrt(head_dim) but in the 27B models (told by their layer count), which scale
    by 1/sqrt(hidden / heads); the layer kinds; Gemma 3's sliding base; Gemma 2's default caps."""
    assert read_gemma_config("gemma2", 46).gemma.query_pre_attn_scalar == 4608 // 32 == 144
    assert read_gemma_config("gemma2", 42).gemma.query_pre_attn_scalar == 128
    assert read_gemma_config("gemma3", 62).gemma.query_pre_attn_scalar == 144
    assert read_gemma_config("gemma3", 34).gemma.query_pre_attn_scalar == 128
    g2 = read_gemma_config("gemma2", 4).gemma
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.local_rope_theta) == (50.0, 30.0, None)
    g3 = read_gemma_config("gemma3", 7, **{"rope.freq_base": 1e6, "rope.freq_base_swa": 5e4})
    assert [g3.gemma.window(i) for i in range(7)] == [4096] * 5 + [None, 4096]
    assert (g3.rope_theta, g3.gemma.local_rope_theta, g3.gemma.final_logit_softcapping) == (1e6, 5e4, None)
    everywhere = read_gemma_config("gemma3", 7, **{"attention.sliding_window": None}).gemma
    assert set(everywhere.layer_types) == {"full_attention"} and everywhere.attn_logit_softcapping is None
    with pytest.raises(GGUFError, match=r"x\.gguf: metadata field 'gemma2\.attention\.sliding_window' is missing"):
        read_gemma_config("gemma2", 4, **{"attention.sliding_window": None})
