"""The supported-models tables (README's and docs/models.md's) name the architectures the config reads and
the tiny families the suite checks against transformers, no more and no fewer; and `pagedrl serve` on the
mixtures of experts answers the OpenAI client with the offline engine's text, saying its active
parameters at start-up (the other families' serve tests sit with their reference tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny import DEEPSEEK_FAMILIES, FAMILIES, GEMMA_FAMILIES, GPT_OSS_FAMILIES, MOE_FAMILIES, hf_model
from tiny_train import build_tokenizer

from pagedrl.model.config import ARCHITECTURES
from pagedrl.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def table_architectures(page: Path, heading: str) -> set[str]:
    """The `...ForCausalLM` names in the first column of the table under `heading`."""
    text = page.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    first_table: list[str] = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            first_table.append(line)
        elif first_table:
            break
    assert first_table, f"{page.name}: no table under {heading!r}"
    return {name for line in first_table[2:] for name in re.findall(r"`(\w+ForCausalLM)`", line.split("|")[1])}


def architectures_under_test() -> set[str]:
    families = {**FAMILIES, **GEMMA_FAMILIES, **GPT_OSS_FAMILIES, **DEEPSEEK_FAMILIES}
    return {raw["architectures"][0] for raw in families.values()}


def test_the_tables_the_config_and_the_tiny_families_agree() -> None:
    readme = table_architectures(ROOT / "README.md", "## Supported models")
    models = table_architectures(ROOT / "docs" / "models.md", "## Supported models")
    assert readme == models == set(ARCHITECTURES) == architectures_under_test()


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
