"""A model whose every layer slides over one window (Mistral v0.1 style), served past its window: the
engine's greedy tokens equal transformers' (eager attention, which applies the window) through chunked
prefill, prefix sharing, forks and preemption; the blocks that fall out of the window go back to the pool,
so a long sequence holds a bounded number of them; and which configs count as one window for every layer.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_greedy import engine_for, prompts, reference, strip_eos
from tiny import FAMILIES, hf_model
from window_batches import kernels_only

from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ModelConfig

WINDOW = 24  # a block and a half of 16: blocks fall out whole and the window's first block is partly seen
MISTRAL = dict(FAMILIES["mistral"], sliding_window=WINDOW)
MAX_NEW = 40


@pytest.fixture(scope="module")
def mistral() -> torch.nn.Module:
    hf = hf_model(MISTRAL)
    hf.set_attn_implementation("eager")
    return hf


def long_prompts(vocab: int) -> list[list[int]]:
    """Prompts of 5 to 90 tokens, half of them behind one 40-token prefix (longer than the window)."""
    return prompts(vocab, seed=1, prefix=40, lengths=(5, 50, 31, 17, 60, 9))


def generated(hf: torch.nn.Module, batch: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    return reference(hf, batch, max_new)


def test_which_configs_slide_in_every_layer() -> None:
    cfg = ModelConfig.from_dict(MISTRAL)
    assert (cfg.uniform_window, cfg.max_model_len) == (WINDOW, 256)  # no longer capped at the window
    qwen = dict(FAMILIES["qwen2-bias-tied"], use_sliding_window=True, sliding_window=WINDOW)
    assert ModelConfig.from_dict(dict(qwen, max_window_layers=0)).uniform_window == WINDOW
    capped = ModelConfig.from_dict(dict(qwen, max_window_layers=1))  # layer 0 full: not one window
    assert capped.uniform_window is None and capped.max_model_len == WINDOW
    assert ModelConfig.from_dict(FAMILIES["mistral"]).uniform_window is None


@pytest.mark.parametrize(("block_size", "roomy"), [(16, False), (16, True), (4, False)])
def test_engine_greedy_equals_eager_generate_past_the_window(mistral, block_size: int, roomy: bool) -> None:
    """Prompts up to 90 tokens (nearly four windows) and up to 40 new tokens each, prefilled 7 tokens a
    step, twice over: in a cache small enough that requests are preempted and recomputed, or in a roomy
    one where the shared prefix (and the first pass's prompts) are hit in the prefix cache, blocks freed
    for leaving the window included. Each sequence holds at most the window and one step's chunk, in
    blocks, at any step."""
    batch = long_prompts(MISTRAL["vocab_size"])
    expected = generated(mistral, batch)
    step_tokens = 7
    bound = -(-(WINDOW - 1 + step_tokens) // block_size) + 1
    llm = engine_for(mistral, block_size=block_size, kv_cache_tokens=(8 * bound if roomy else bound + 2) * block_size,
                     max_num_batched_tokens=step_tokens)
    engine = llm.engine
    assert engine.max_model_len == 256
    peak = [0]

    def held(eng, outputs) -> None:  # noqa: ANN001
        manager = eng.kv_manager
        peak[0] = max([peak[0], *(manager.num_held_blocks(s) for s in list(manager._seqs))])

    remove = engine.add_step_observer(held)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with kernels_only():
        for _ in range(2):
            got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
            assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected]
    remove()
    stats = llm.stats()
    assert stats["num_blocks_used"] == 0
    assert stats["prefix_cache_hits"] > 0 if roomy else stats["num_preemptions"] >= 1
    longest = max(len(p) for p in batch) + MAX_NEW
    assert peak[0] <= bound < -(-longest // block_size)


def test_forked_samples_share_then_drop_their_blocks(mistral) -> None:
    """n = 3 samples of one 70-token prompt fork its blocks, then each drops what leaves its window; the
    greedy samples all equal transformers' tokens."""
    prompt = long_prompts(MISTRAL["vocab_size"])[4]
    expected = generated(mistral, [prompt], 20)[0]
    llm = engine_for(mistral, kv_cache_tokens=512, max_num_batched_tokens=16)
    with kernels_only():
        out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=20),
                           use_tqdm=False)[0]
    assert [strip_eos(c.token_ids) for c in out.outputs] == [strip_eos(expected)] * 3
    assert llm.stats()["num_blocks_used"] == 0


LAYER_KINDS = {  # Qwen configs as transformers writes or a user edits them -> which layers transformers slides
    "max_window_layers 28 (the default) over 2 layers": dict(max_window_layers=28),
    "layer_types: the second slides": dict(max_window_layers=0, layer_types=["full_attention", "sliding_attention"]),
    "layer_types: both slide": dict(max_window_layers=5, layer_types=["sliding_attention"] * 2),
    "layer_types: none slides": dict(max_window_layers=0, layer_types=["full_attention"] * 2),
    "layer_types: a full layer after a sliding one": dict(layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("arch", ["qwen2-bias-tied", "qwen3-qknorm"])
@pytest.mark.parametrize("case", sorted(LAYER_KINDS))
def test_qwen_layers_slide_where_transformers_slides_them(arch: str, case: str) -> None:
    """`layer_types` over `max_window_layers`, as transformers reads them: where no layer slides there is
    no window (the context is not capped), where every one does the window is uniform, where the last
    ones do the context is capped at the window; other layouts are refused by name."""
    import transformers

    from pagedrl.model.config_error import ConfigError

    raw = dict(FAMILIES[arch], use_sliding_window=True, sliding_window=WINDOW, **LAYER_KINDS[case])
    theirs = getattr(transformers, raw["architectures"][0].replace("ForCausalLM", "Config"))(**raw).layer_types
    slides = [kind == "sliding_attention" for kind in theirs]
    if any(slides) and not all(slides[slides.index(True):]):
        with pytest.raises(ConfigError, match="layer_types.*full layers after sliding"):
            ModelConfig.from_dict(raw)
        return
    cfg = ModelConfig.from_dict(raw)
    if not any(slides):
        assert cfg.layer_windows == (None, None) and cfg.max_model_len == 256
    elif all(slides):
        assert cfg.layer_windows == (WINDOW, WINDOW) and cfg.max_model_len == 256
    else:
        assert cfg.uniform_window is None and cfg.max_model_len == WINDOW


def test_qwen3_moe_slides_every_layer_and_gemma_ties_its_head_by_default() -> None:
    """Qwen3-MoE applies its window in every layer whatever `max_window_layers` says; Gemma 2 and 3
    configs without `tie_word_embeddings` (as published) tie the head, as transformers defaults them."""
    import transformers
    from tiny import GEMMA_FAMILIES

    moe = dict(FAMILIES["qwen3-moe"], use_sliding_window=True, sliding_window=WINDOW, max_window_layers=48)
    assert ModelConfig.from_dict(moe).layer_windows == (WINDOW, WINDOW)
    for family in GEMMA_FAMILIES.values():
        raw = {k: v for k, v in family.items() if k != "tie_word_embeddings"}
        theirs = getattr(transformers, raw["architectures"][0].replace("ForCausalLM", "Config"))
        if raw["model_type"] == "gemma3_text":
            theirs = transformers.Gemma3TextConfig
        assert ModelConfig.from_dict(raw).tie_word_embeddings is theirs(**raw).tie_word_embeddings is True
    assert ModelConfig.from_dict(FAMILIES["mistral"]).tie_word_embeddings is False
