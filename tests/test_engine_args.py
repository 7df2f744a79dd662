"""One engine-arguments dataclass: `EngineArgs`' fields are `LLM`'s keyword arguments, `pagedrl serve`'s
and `pagedrl generate`'s flags (with the field's help in `--help`), the rows of the engine-arguments
table in docs/serving.md, and the rollout engine's settings; a field added to the dataclass and missing
from any of these fails here."""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from pagedrl import LLM, SamplingParams
from pagedrl.engine.engine_args import EngineArgs, add_engine_arguments, cli_fields, flag
from pagedrl.engine.engine_config import EngineConfig
from pagedrl.generate import ENGINE_SKIP
from pagedrl.server.serve import (
    build_parser,
    engine_arguments_problem,
    names_problem,
    origins,
    origins_problem,
    serve_main,
)
from pagedrl.train.rl.config import GRPOConfig, OnlineConfig
from pagedrl.train.rl.online import rollout_engine_args

DOCS = Path(__file__).resolve().parent.parent / "docs"
FIELDS = {f.name: f for f in fields(EngineArgs)}
NOT_ENGINE = {"tokenizer", "_module", "_eos_token_ids"}  # LLM's own: a tokenizer object, a trainer's module


def options(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def squeeze(text: str) -> str:
    return " ".join(text.split())


def test_every_field_has_help_and_a_group() -> None:
    for f in fields(EngineArgs):
        assert f.metadata.get("help"), f"EngineArgs.{f.name} has no help text (engine_config.setting)"
        assert f.metadata.get("group"), f.name


def test_llm_takes_each_field_by_name_with_its_default() -> None:
    params = inspect.signature(LLM).parameters
    engine = {name: p for name, p in params.items() if name not in NOT_ENGINE}
    assert set(engine) == set(FIELDS)
    for name, p in engine.items():
        assert p.default == FIELDS[name].default, name


def test_llm_names_the_field_meant_by_a_misspelt_keyword() -> None:
    with pytest.raises(TypeError, match="did you mean 'kv_cache_tokens'"):
        LLM(kv_cache_token=64)


def test_llm_keywords_reach_the_engine(tiny_train_model) -> None:
    llm = LLM(str(tiny_train_model), kv_cache_tokens=256, max_num_seqs=4, enable_prefix_caching=False, seed=3)
    assert llm.engine_args == EngineArgs(model=str(tiny_train_model), kv_cache_tokens=256, max_num_seqs=4,
                                         enable_prefix_caching=False, seed=3)
    assert llm.engine.config.max_num_seqs == 4 and not llm.engine.config.enable_prefix_caching
    assert llm.stats()["num_blocks_total"] == 256 // llm.block_size
    again = LLM.from_engine_args(llm.engine_args)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == \
        again.generate([[5, 6, 7]], params)[0].outputs[0].token_ids


def test_serve_has_a_flag_per_field_with_its_help() -> None:
    parser = build_parser()
    flags = options(parser)
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100_000)  # no line breaks to undo
    help_text = squeeze(parser.format_help())
    for f in fields(EngineArgs):
        if f.name == "model":
            assert any(a.dest == "model" and not a.option_strings for a in parser._actions)
        elif f.metadata["cli"]:
            assert flag(f.name) in flags, f"pagedrl serve has no {flag(f.name)}"
        else:
            assert flag(f.name) not in flags, f.name
        if f.metadata["cli"]:
            assert squeeze(f.metadata["help"]) in help_text, f"--help lacks {f.name}'s help"


def test_generate_has_the_engine_flags_but_its_own_seed_and_the_lora_slots() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, skip=ENGINE_SKIP)
    assert options(parser) >= {flag(f.name) for f in cli_fields() if f.name not in {"model", *ENGINE_SKIP}}
    assert not options(parser) & {flag(name) for name in ENGINE_SKIP}


def test_flags_read_back_as_engine_args() -> None:
    args = build_parser().parse_args(["some/model", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                                      "--batch-invariant", "--dtype", "float32", "--max-cpu-loras", "3"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(model="some/model", max_num_seqs=4, dtype="float32",
                                                        enable_prefix_caching=False, batch_invariant=True,
                                                        max_cpu_loras=3)
    assert EngineArgs.from_cli_args(build_parser().parse_args([])) == EngineArgs()


def test_serve_refuses_bad_engine_flags_naming_them() -> None:
    args = build_parser().parse_args(["--kv-cache-tokens", "8"])
    assert engine_arguments_problem(args) == "--kv-cache-tokens (8) must hold at least one block of " \
                                             "--block-size=16 tokens"
    assert engine_arguments_problem(build_parser().parse_args([])) is None
    args = build_parser().parse_args(["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"])
    assert engine_arguments_problem(args) == "--max-cpu-loras (1) must be at least --max-loras (2): what the " \
                                             "slots hold is kept on the host too"


def engine_table() -> dict[str, str]:
    """docs/serving.md's engine-arguments table: the `LLM(...)` keyword of each row and its flag cell."""
    text = (DOCS / "serving.md").read_text(encoding="utf-8")
    section = text.split("## Engine arguments", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)}


def test_the_docs_list_each_field_with_its_flag() -> None:
    table = engine_table()
    assert set(table) == set(FIELDS), "docs/serving.md#engine-arguments lists other fields than EngineArgs"
    for name, cell in table.items():
        f = FIELDS[name]
        want = "`MODEL`" if name == "model" else f"`{flag(name)}`" if f.metadata["cli"] else "Python only"
        assert cell == want, name


def test_the_docs_name_every_serve_flag() -> None:
    pages = " ".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    missing = sorted(o for o in options(build_parser()) if o.startswith("--") and o != "--help"
                     and o.removeprefix("--no-") == o and f"`{o}`" not in pages)
    assert not missing, f"flags no page of docs/ names: {missing}"


def test_the_rollout_engine_is_engine_args() -> None:
    engine_fields = [f for f in fields(OnlineConfig) if "group" in f.metadata]
    assert {f.name for f in engine_fields} == {"kv_cache_tokens", "batch_invariant"}
    assert all(f.name in FIELDS for f in engine_fields)
    config = GRPOConfig(kv_cache_tokens=4096, num_generations=4, seed=7)
    args = rollout_engine_args(config, prompts_per_rollout=80, bf16=False, batch_invariant=True)
    assert isinstance(args, EngineArgs)
    assert (args.kv_cache_tokens, args.seed, args.max_num_seqs, args.batch_invariant) == (4096, 7, 320, True)
    assert set(args.config_kwargs()) == {f.name for f in fields(EngineConfig)}


def test_a_context_the_model_lacks_or_a_step_that_cannot_hold_one_is_refused(tiny_train_model) -> None:
    """As vLLM: max_model_len past the model's context is an error (it was quietly lowered), and without
    chunked prefill a step budget below max_model_len is one (a longer prompt waited for ever, and every
    request behind it)."""
    context = LLM(str(tiny_train_model), kv_cache_tokens=256).engine.max_model_len
    with pytest.raises(ValueError, match=rf"max_model_len \({context + 1}\) is longer than the model's context "
                                         rf"\({context}"):
        LLM(str(tiny_train_model), kv_cache_tokens=256, max_model_len=context + 1)
    with pytest.raises(ValueError, match=rf"max_num_batched_tokens \(64\) is smaller than max_model_len \({context}\) "
                                         "with enable_chunked_prefill off"):
        LLM(str(tiny_train_model), kv_cache_tokens=256, enable_chunked_prefill=False, max_num_batched_tokens=64)
    llm = LLM(str(tiny_train_model), kv_cache_tokens=256, enable_chunked_prefill=False, max_num_batched_tokens=64,
              max_model_len=64)  # a budget that holds the longest sequence served: every prompt schedules
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        EngineConfig(max_model_len=0).validate()


def test_serve_reads_vllm_s_key_and_spellings_and_guesses_no_flag(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDRL_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert build_parser().parse_args([]).api_key == "from-vllm"  # it ran with no key before
    monkeypatch.setenv("PAGEDRL_API_KEY", "ours")
    assert build_parser().parse_args([]).api_key == "ours"
    monkeypatch.setenv("PAGEDRL_API_KEY", "")  # set and empty: no key, whatever VLLM_API_KEY says
    assert build_parser().parse_args([]).api_key == ""
    assert EngineArgs.from_cli_args(build_parser().parse_args(["--dtype", "half"])).dtype == "half"
    assert build_parser().parse_args(["--dtype", "float"]).dtype == "float"
    with pytest.raises(SystemExit):  # an abbreviation set --api-key quietly
        build_parser().parse_args(["--api", "k"])


def test_a_busy_port_is_refused_before_the_model_loads(capsys) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve_main(["/no/such/model", "--port", str(port)]) == 2  # the model is never looked at
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pagedrl serve: cannot listen on 127.0.0.1:{port}: ") and "in use" in err


def test_several_served_names_and_a_model_read_as_one_of_them(tmp_path) -> None:
    args = build_parser().parse_args(["some/model", "--served-model-name", "a", "b"])
    assert (args.model, args.served_model_name, names_problem(args)) == ("some/model", ["a", "b"], None)
    folder = tmp_path / "model"
    folder.mkdir()
    for model in (str(folder), "Qwen/Qwen2.5-0.5B-Instruct"):  # a folder or a Hub id after the names
        swallowed = build_parser().parse_args(["--served-model-name", "a", model])
        assert swallowed.model is None and "put MODEL first" in names_problem(swallowed)


def test_serve_names_a_context_the_model_lacks_by_its_flag(tiny_train_model, capsys) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert serve_main([str(tiny_train_model), "--port", str(port), "--max-model-len", "100000",
                       "--kv-cache-tokens", "256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pagedrl serve: --max-model-len (100000) is longer than the model's context (256")


def test_allowed_origins_as_words_or_vllm_s_json_list() -> None:
    assert origins(['["*"]']) == ["*"] and origins(["https://a.example", "https://b.example"]) == [
        "https://a.example", "https://b.example"]
    bad = build_parser().parse_args(["--allowed-origins", '["*"'])
    assert origins_problem(bad).startswith('--allowed-origins: ["*" is not a JSON list')
    assert build_parser().parse_args([]).allowed_origins == []  # no other site's pages by default
