"""KTO's micro-batches are exactly the blocks its KL completions were drawn from, as in TRL's sequential
dataloader: 10 rows in blocks of 4 are [0-3], [4-7], [8, 9] in every epoch (the epoch ends on the short
block and its step takes only the micro-batches left), under gradient accumulation and two processes, in
training (through `step_batches`) and in evaluation."""

from __future__ import annotations

import pytest
import torch
from preference_data import unpaired_rows

from pagedrl.model.loader import load_model
from pagedrl.train.algorithms.kto import KTO
from pagedrl.train.distributed import DistInfo
from pagedrl.train.offline_config import KTOConfig
from pagedrl.train.optim import total_steps

B0, B1, B2 = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9]


def kto(model_dir, rank: int, world: int, **fields) -> KTO:
    """KTO on 10 rows (and 10 eval rows) in blocks of 4, as rank `rank` of `world`; micro-batches left as rows."""
    config = KTOConfig(model=str(model_dir), output_dir="unused", per_device_train_batch_size=4, use_cpu=True,
                       **fields)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    algorithm = KTO(config, loaded.model, loaded.tokenizer, DistInfo(rank=rank, world_size=world),
                    unpaired_rows(10, seed=3), unpaired_rows(10, seed=4))
    algorithm.collate = list  # type: ignore[method-assign]  # a micro-batch as its rows, to read them back
    return algorithm


def indices(rows, examples) -> list[int]:
    """Which of `examples` the micro-batch's rows are, checking that each row's KL completion is its
    predecessor's in the micro-batch (the first row's the last's): the micro-batch is the KL block."""
    assert [r.kl_completion_ids for r in rows] == [rows[i - 1].whole_completion_ids for i in range(len(rows))]
    position = {id(e): i for i, e in enumerate(examples)}
    return [position[id(r)] for r in rows]


@pytest.mark.parametrize(("world", "accumulation", "steps"), [
    (1, 1, [[[B0]], [[B1]], [[B2]]]),  # per step, per rank: the micro-batches' rows
    (1, 2, [[[B0, B1]], [[B2]]]),  # the epoch's last step: the one micro-batch left
    (2, 1, [[[B0], [B1]], [[B2], [B0]]]),  # the last round padded with the epoch's first block
])
def test_micro_batches_are_kl_blocks_across_epochs(tiny_train_model, world, accumulation, steps) -> None:
    ranks = [kto(tiny_train_model, rank, world, gradient_accumulation_steps=accumulation, num_train_epochs=2)
             for rank in range(world)]
    for epoch in range(2):
        for step, expected in enumerate(steps, start=1 + epoch * len(steps)):
            got = [[indices(b, a.examples) for b in a.step_batches(step)] for a in ranks]
            assert got == expected, (epoch, step)
    assert ranks[0].epoch == 2.0
    assert total_steps(ranks[0].config, ranks[0]) == 2 * len(steps)  # transformers' steps: per epoch, rounded up


def test_evaluation_micro_batches_are_kl_blocks_on_every_rank(tiny_train_model) -> None:
    """The eval rows' blocks dealt to the ranks in turn, each whole (TRL draws their KL completions the same way)."""
    got = []
    for rank in range(2):
        algorithm = kto(tiny_train_model, rank, 2)
        got.append([indices(rows, algorithm.eval_examples) for rows in algorithm.eval_shares()])
    assert got == [[B0, B2], [B1]]


def test_without_a_kl_term_rows_flow_as_dpos(tiny_train_model) -> None:
    """apo_zero_unpaired pairs nothing: full micro-batches straddling the epoch, as every other algorithm's."""
    algorithm = kto(tiny_train_model, 0, 1, loss_type="apo_zero_unpaired")
    position = {id(e): i for i, e in enumerate(algorithm.examples)}
    got = [[position[id(r)] for r in algorithm.step_batches(s)[0]] for s in (1, 2, 3)]
    assert got == [B0, B1, [8, 9, 0, 1]]
