"""The engine's CPU shortcuts compute exactly what the long way computes.

- Sampler rows whose processing is a no-op (greedy, or temperature 1 with no cut, penalty or ban)
  skip it: tokens and log-probs are bit-for-bit those of the full path, and every other kind of
  row still takes the full path.
- A step of plain greedy rows on a CPU takes `greedy_pick`: the full path's tokens, its log-probs
  to a float32 rounding; rows that are not finite go the full way.
- The sampler's reused log-softmax buffer never leaks into what it returns.
- The runner's logits projection into a reused buffer equals the model's own `logits`, and a model
  that overrides `logits` is respected.
- Fresh prompts are attended causally without a mask, continued prefills keep theirs.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from float_bounds import log_softmax_bound
from tiny import FAMILIES

from pagedrl.engine import attention, sampler
from pagedrl.engine.model_runner import ModelRunner
from pagedrl.engine.sampler import Sampler, SamplingRow, make_generator
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one

VOCAB = 97


def plain_rows() -> list[SamplingRow]:
    return [
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams(temperature=1.0, seed=5), generator=make_generator(5)),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=3)),
        SamplingRow(SamplingParams(temperature=0.0, top_k=3, top_p=0.5, logprobs=2)),  # greedy ignores cuts
        SamplingRow(SamplingParams(temperature=1.0, top_k=VOCAB, top_p=1.0, min_p=0.0)),
    ]


def sample(rows: list[SamplingRow], logits: torch.Tensor, force_full_path: bool):
    """Sampler output from fresh generators, optionally with the shortcut disabled."""
    for row in rows:
        if row.generator is not None:
            row.generator = make_generator(row.params.seed)
    draw = Sampler(torch.Generator().manual_seed(11))
    if not force_full_path:
        return draw(logits, rows)
    with mock.patch.object(sampler, "_leaves_logits_unchanged", lambda row, vocab: False):
        return draw(logits, rows)


def test_plain_rows_give_the_full_paths_tokens_and_logprobs_bit_for_bit() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    rows = plain_rows()
    assert all(sampler._leaves_logits_unchanged(row, VOCAB) for row in rows)
    fast, full = sample(rows, logits, False), sample(rows, logits, True)
    assert torch.equal(fast.token_ids, full.token_ids)
    assert torch.equal(fast.processed_logprobs, full.processed_logprobs)
    assert torch.equal(fast.raw_logprobs, full.raw_logprobs)
    assert fast.top_logprobs == full.top_logprobs


@pytest.mark.parametrize("params, banned", [
    (SamplingParams(temperature=0.7), ()),
    (SamplingParams(temperature=1.0, top_k=5), ()),
    (SamplingParams(temperature=1.0, top_p=0.9), ()),
    (SamplingParams(temperature=1.0, min_p=0.1), ()),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), ()),
    (SamplingParams(temperature=1.0, presence_penalty=0.5), ()),
    (SamplingParams(temperature=0.0), (3,)),
])
def test_rows_that_change_the_logits_take_the_full_path(params: SamplingParams, banned: tuple[int, ...]) -> None:
    row = SamplingRow(params, prompt_token_ids=[1, 2], output_token_ids=[3], banned_token_ids=banned)
    assert not sampler._leaves_logits_unchanged(row, VOCAB)
    # One such row in a batch sends the whole batch the full way, with the same result as alone.
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(temperature=0.0)), row]
    mixed, full = sample(rows, logits, False), sample(rows, logits, True)
    assert torch.equal(mixed.token_ids, full.token_ids)
    assert torch.equal(mixed.processed_logprobs, full.processed_logprobs)


@pytest.mark.parametrize("vocab", [VOCAB, 49152])
def test_plain_greedy_rows_take_the_kernel_with_the_full_paths_tokens(vocab: int) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, vocab, generator=gen) * 4
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # equal maxima: the first is the pick
    logits[3, -1] = logits[3].max() + 1  # the maximum in the last column
    rows = [SamplingRow(SamplingParams(temperature=0.0)) for _ in range(6)]
    picks = []
    real = sampler._greedy_pick

    def spy(x: torch.Tensor):  # noqa: ANN202
        picks.append(real(x))
        return picks[-1]

    with mock.patch.object(sampler, "_greedy_pick", spy):
        fast = sample(rows, logits, False)
    assert len(picks) == 1 and picks[0] is not None
    full = sample(rows, logits, True)
    assert torch.equal(fast.token_ids, full.token_ids) and fast.token_ids[2] == 7 and fast.token_ids[3] == vocab - 1
    exact = torch.log_softmax(logits.double(), -1).gather(1, fast.token_ids[:, None]).squeeze(1)
    # the kernel sums exponentials in float32 blocks of 1024 (`csrc/rowwise.cpp`), then in float64;
    # torch sums the whole row in float32, in its own order
    kernel_bound = log_softmax_bound(logits, fast.token_ids, summed=min(vocab, 1024))
    for got in (fast.processed_logprobs, fast.raw_logprobs):
        assert got.dtype == torch.float32
        assert ((got.double() - exact).abs() <= kernel_bound).all()
    assert ((full.processed_logprobs.double() - exact).abs() <= log_softmax_bound(logits, full.token_ids)).all()
    logits[1, 3] = float("nan")  # not finite: torch's answer, bit for bit
    with mock.patch.object(sampler, "_greedy_pick", spy):
        odd = sample(rows, logits, False)
    assert len(picks) == 2 and picks[1] is None
    full = sample(rows, logits, True)
    assert torch.equal(odd.token_ids, full.token_ids)
    assert torch.equal(odd.processed_logprobs.nan_to_num(), full.processed_logprobs.nan_to_num())


def test_reused_log_softmax_buffer_is_never_returned() -> None:
    gen = torch.Generator().manual_seed(2)
    draw = Sampler()
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=4)) for _ in range(3)]
    first_logits = torch.randn(3, VOCAB, generator=gen)
    first = draw(first_logits, rows)
    kept = (first.token_ids.clone(), first.processed_logprobs.clone(), first.raw_logprobs.clone(),
            first.top_logprobs)
    with torch.inference_mode():  # the buffer follows the mode it is used in
        draw(torch.randn(3, VOCAB, generator=gen), rows)
    second = draw(torch.randn(2, VOCAB, generator=gen), rows[:2])
    assert torch.equal(first.token_ids, kept[0]) and torch.equal(first.processed_logprobs, kept[1])
    assert torch.equal(first.raw_logprobs, kept[2]) and first.top_logprobs == kept[3]
    expected = torch.log_softmax(first_logits, -1).max(-1)
    assert torch.equal(first.token_ids, expected.indices)
    assert torch.equal(first.processed_logprobs, expected.values)
    assert second.token_ids.shape == (2,)


def tiny_model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])).eval()


def test_projection_into_the_reused_buffer_equals_the_models_logits() -> None:
    """More rows than the float32 kernels take: torch's product into a buffer kept across steps; a
    decode step's few rows: the kernel's product of the same head."""
    from pagedrl.kernels import products

    model = tiny_model()
    runner = ModelRunner(model, kv_cache=None, kv_manager=None, block_size=16)
    most = max(products.MAX_ROWS_FLOAT, products.MAX_ROWS_GEMM)
    hidden = torch.randn(most + 7, model.config.hidden_size)
    with torch.inference_mode():
        big = runner.project(hidden)
        assert torch.equal(big, model.logits(hidden))
        buffer = runner._logits
        small = runner.project(hidden[:most + 3])
        assert runner._logits is buffer  # fewer rows reuse the buffer
        assert torch.equal(small, model.logits(hidden[:most + 3]))
        few = runner.project(hidden[:3])
        assert runner.float_routes
        assert torch.equal(few, torch.ops.pagedrl_cpu.float_linear(hidden[:3], model.lm_head.weight, None))


def test_positions_are_computed_once_per_step(monkeypatch) -> None:
    """The model's rotary embedding reads the very positions tensor the attention metadata built (the
    modules' steps: a decode program reads `meta.positions` itself)."""
    from pagedrl.engine import model_runner
    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams

    llm = LLM.from_module(tiny_model(), block_size=4, kv_cache_tokens=256, max_num_batched_tokens=6,
                          enforce_eager=True)
    built, seen = [], []
    real_build = model_runner.PagedAttention.from_block_tables
    monkeypatch.setattr(model_runner.PagedAttention, "from_block_tables",
                        lambda *args, **kwargs: built.append(real_build(*args, **kwargs)) or built[-1])
    real_forward = llm.engine.model.forward
    monkeypatch.setattr(llm.engine.model, "forward",
                        lambda ids, positions, meta: seen.append(positions) or real_forward(ids, positions, meta))
    llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21]], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    assert len(seen) == len(built) == llm.engine.num_steps
    for positions, meta in zip(seen, built, strict=True):
        assert positions.data_ptr() == meta.positions.data_ptr()
        assert positions[0].tolist() == meta.positions.tolist()
    # Chunked prefill: the 9-token prompt is cut at 6 tokens per step, then decodes follow.
    assert seen[0][0].tolist() == [0, 1, 2, 3, 4, 5]
    assert seen[1][0].tolist() == [6, 7, 8, 0, 1]


def test_a_model_that_overrides_logits_is_respected() -> None:
    class Scaled(CausalLM):
        def logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return 2 * super().logits(hidden)

    model = Scaled(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"])).eval()
    runner = ModelRunner(model, kv_cache=None, kv_manager=None, block_size=16)
    hidden = torch.randn(4, model.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(runner.project(hidden), model.logits(hidden))
    assert runner._logits is None


def test_fresh_prompts_skip_the_mask_and_continued_prefills_keep_it() -> None:
    q_lens = [1, 5, 3, 4, 6]
    seq_lens = [9, 5, 3, 12, 6]  # a decode, fresh prompts (1, 2, 4), a chunk over 8 cached tokens (3)
    tables = torch.arange(5 * 4).view(5, 4)  # sequence s holds blocks 4s..4s+3
    fresh = {1, 2, 4}
    for chunk_tokens in (4 * 4, 1 << 20):  # CPU cuts: one sequence per group, or as few as allowed
        groups = attention.plan_groups(q_lens, seq_lens, tables, 4, torch.device("cpu"), torch.float32,
                                       chunk_tokens=chunk_tokens)
        covered = []
        for group in groups:
            members = {int(b) // 4 for b in group.block_ids.view(group.num_seqs, -1)[:, 0]}
            covered += members
            if group.is_decode:
                assert members == {0} and group.mask is not None
            else:  # fresh prompts and continued prefills are never mixed; only the fresh skip the mask
                assert members <= fresh or not members & fresh
                assert (group.mask is None) == (members <= fresh)
        assert sorted(covered) == list(range(5))
    # Without cuts (a GPU), one prefill group holds the continued chunk too, so it keeps the mask.
    groups = attention.plan_groups(q_lens, seq_lens, tables, 4, torch.device("cpu"), torch.float32)
    assert [(g.is_decode, g.mask is None) for g in groups] == [(True, False), (False, False)]
    only_fresh = attention.plan_groups([5, 3], [5, 3], tables[:2], 4, torch.device("cpu"), torch.float32)
    assert [(g.is_decode, g.mask is None) for g in only_fresh] == [(False, True)]


def test_forked_samples_beside_prompt_log_prob_rows_read_their_own_logits() -> None:
    """A step whose logits rows are not sampled one each, in order: a request forks into two samples
    of its one row while another's prompt log-prob row is not sampled, so there are as many samples
    as rows, the last one sampled. Each sample must still read its own row."""
    from pagedrl.engine.llm import LLM

    llm = LLM.from_module(tiny_model(), kv_cache_tokens=256)
    forked = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], forked, use_tqdm=False)[0]
    both = llm.generate([[5, 6, 7, 8], [9, 10]], [forked, SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True, prompt_logprobs=1)],
                        use_tqdm=False)[0]
    expected = alone.outputs[0].token_ids
    assert alone.outputs[1].token_ids == expected
    assert [c.token_ids for c in both.outputs] == [expected, expected]
