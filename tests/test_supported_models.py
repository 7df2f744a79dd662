"""The supported-models tables (README's and docs/models.md's) name the architectures the config reads and
the tiny families the suite checks against transformers, no more and no fewer, and in their GGUF column
llama.cpp's architectures the GGUF reader reads; and `pagedrl serve` on the
mixtures of experts answers the OpenAI client with the offline engine's text, saying its active
parameters at start-up (the other families' serve tests sit with their reference tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny import DEEPSEEK_FAMILIES, FAMILIES, GEMMA_FAMILIES, GPT_OSS_FAMILIES, MOE_FAMILIES, hf_model
from tiny_train import build_tokenizer

from pagedrl.model.config import ARCHITECTURES
from pagedrl.model.gguf import SUPPORTED_ARCHITECTURES
from pagedrl.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def first_table(page: Path, heading: str) -> list[list[str]]:
    """The cells of the body rows of the first table under `heading`."""
    text = page.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    lines: list[str] = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    assert lines, f"{page.name}: no table under {heading!r}"
    return [line.split("|")[1:-1] for line in lines[2:]]


def table_architectures(page: Path, heading: str) -> set[str]:
    """The `...ForCausalLM` names in the first column of the table under `heading`."""
    return {name for row in first_table(page, heading) for name in re.findall(r"`(\w+ForCausalLM)`", row[0])}


def table_gguf_architectures(page: Path, heading: str) -> set[str]:
    """The llama.cpp architectures (`qwen2`, `gemma3`, ...) the GGUF column of that table names."""
    return {name for row in first_table(page, heading) for name in re.findall(r"`([a-z0-9-]+)`", row[-1])}


def architectures_under_test() -> set[str]:
    families = {**FAMILIES, **GEMMA_FAMILIES, **GPT_OSS_FAMILIES, **DEEPSEEK_FAMILIES}
    return {raw["architectures"][0] for raw in families.values()}


def test_the_tables_the_config_and_the_tiny_families_agree() -> None:
    readme = table_architectures(ROOT / "README.md", "## Supported models")
    models = table_architectures(ROOT / "docs" / "models.md", "## Supported models")
    assert readme == models == set(ARCHITECTURES) == architectures_under_test()
    gguf_readme = table_gguf_architectures(ROOT / "README.md", "## Supported models")
    gguf_models = table_gguf_architectures(ROOT / "docs" / "models.md", "## Supported models")
    assert gguf_readme == gguf_models == set(SUPPORTED_ARCHITECTURES)


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_folder(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(request.param) / "model"
    build_tokenizer(folder)
    tok = Tokenizer.from_folder(folder)
    raw = dict(FAMILIES[request.param], vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, bos_token_id=None)
    hf_model(raw, seed=4).save_pretrained(folder)
    return folder


def test_serve_answers_the_openai_client_as_the_engine_generates(moe_folder: Path, tmp_path: Path) -> None:
    from server_process import assert_serves_the_engines_text

    log = assert_serves_the_engines_text(moe_folder, tmp_path, kv_cache_tokens=512)
    assert re.search(r"M parameters, [\d.]+M active per token", log), log
