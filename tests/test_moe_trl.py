"""The router load-balancing loss of a mixture of experts in SFT, DPO and KTO against TRL 1.16's own
SFTTrainer, DPOTrainer and KTOTrainer on the same saved model and rows: the first batch's loss, every parameter's
gradient (the router's included) and `aux_loss`, with the loss on (the model config's coefficient,
0.5 here so that the term shows) and off (`router_aux_loss_coef=0`). TRL runs DPO's answers as two
padded rows, each with its own prompt; pagedrl computes the prompt once and counts its tokens twice (KTO's
KL completion, a second forward in TRL without the term, not at all).
GRPO's term against transformers' over the rows TRL's GRPO trainer builds; which models have it; the eval loss
with the term, as TRL's."""

from __future__ import annotations

import pytest
import torch
from first_batches import TOLERANCE, ours_first_batch, trl_first_batch
from preference_data import dpo_trainer, preference_rows, unpaired_rows
from test_grpo import grpo, write_prompts
from tiny import DEEPSEEK_FAMILIES, FAMILIES
from tiny_train import MOE, arithmetic_rows, build_model_dir, sft_trainer

from pagedrl.model.config import ModelConfig
from pagedrl.train.algorithms.pair_batch import collate_pairs
from pagedrl.train.config import TrainConfigError
from pagedrl.train.examples import Preference
from pagedrl.train.router_loss import load_balancing_loss, router_loss_coef

COEF = 0.5  # the model config's `router_aux_loss_coef`


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto"])
@pytest.mark.parametrize(("family", "coef"), [("mixtral", None), ("mixtral", 0.0), ("qwen3-moe", None),
                                              ("qwen3-moe", 0.0), ("gpt-oss", None)])
def test_first_batch_equals_trl(tmp_path, family: str, coef: float | None, kind: str) -> None:
    folder = build_model_dir(tmp_path / "model", num_experts_per_tok=2, router_aux_loss_coef=COEF, **MOE[family])
    # Plain-text rows (a dataset of TRL's holds one kind).
    plain = [r for r in arithmetic_rows() if isinstance(r["prompt"], str)]
    rows = {"sft": plain, "dpo": preference_rows(8, seed=3), "kto": unpaired_rows(8, seed=3)}[kind]
    settings = {} if coef is None else {"router_aux_loss_coef": coef}
    features, trl_loss, trl_grads, trl_metrics = trl_first_batch(kind, folder, rows, tmp_path / "trl", **settings)
    if kind == "sft":
        trainer = sft_trainer(folder, tmp_path / "ours", rows=rows, per_device_train_batch_size=4, **settings)
    else:
        trainer = dpo_trainer(folder, tmp_path / "ours", rows, per_device_train_batch_size=4, kto=kind == "kto",
                              **settings)
    examples, loss, grads, metrics = ours_first_batch(trainer.algorithm)
    for example, feature in zip(examples, features, strict=True):  # the same tokens
        if kind == "sft":
            assert example.input_ids == feature["input_ids"]
            assert example.completion_ids == [t for t in feature["labels"] if t != -100]
        elif kind == "kto":
            assert (example.prompt_ids, example.completion_ids, example.kl_completion_ids) == (
                feature["prompt_ids"], feature["completion_ids"], feature["KL_completion_ids"])
        else:
            assert (example.prompt_ids, example.chosen_ids, example.rejected_ids) == (
                feature["prompt_ids"], feature["chosen_ids"], feature["rejected_ids"])
    assert abs(loss - trl_loss) < TOLERANCE
    assert grads.keys() >= trl_grads.keys()
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name
    if kind == "sft":  # the config it saves says what ran, as TRL's SFT trainer leaves it
        cfg = trainer.algorithm.model.config
        assert (cfg.output_router_logits, cfg.router_aux_loss_coef) == ((True, COEF) if coef is None else (False, 0.0))
    if coef is None:
        assert metrics["aux_loss"] == pytest.approx(trl_metrics["aux_loss"], abs=1e-6)
        assert COEF * metrics["aux_loss"] > 0.1  # the term is there to be checked
    else:
        assert "aux_loss" not in metrics and "aux_loss" not in trl_metrics


def test_shared_prompt_weighted_twice_equals_two_rows_in_float64() -> None:
    """The load-balancing loss over one `[prompt, chosen, rejected]` row with the prompt's tokens weighted 2
    equals transformers' over the two padded rows `prompt + chosen`, `prompt + rejected` (the prompt's router
    logits repeated, as causal attention gives them), in float64 by hand."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    pair = Preference([5, 6, 7], [8, 9], [10, 11, 12, 13], "row 0")
    batch = collate_pairs([pair, Preference([3], [4, 5, 6], [7], "row 1")], 0, torch.device("cpu"), answer_tokens=True)
    assert batch.token_weights is not None
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(batch.input_ids.numel(), 6, generator=g, dtype=torch.float64) for _ in range(2)]
    ours = load_balancing_loss(layers, 6, 2, batch.token_weights)
    # TRL's layout: rows chosen 0, chosen 1, rejected 0, rejected 1, padded to the longest (7 tokens).
    width, seq = batch.input_ids.shape[1], [(0, 3, 3, 2), (1, 1, 1, 3), (0, 3, 5, 4), (1, 1, 4, 1)]
    padded, mask = [], torch.zeros(4, 7)
    for logits in layers:
        rows = torch.zeros(4, 7, 6, dtype=torch.float64)
        for r, (b, p, start, n) in enumerate(seq):
            picked = list(range(p)) + list(range(start, start + n))
            rows[r, :p + n] = logits[b * width + torch.tensor(picked)]
            mask[r, :p + n] = 1
        padded.append(rows.reshape(-1, 6))
    ref = load_balancing_loss_func(tuple(padded), 6, 2, mask)
    # transformers' function sums in float32; by hand in float64: E Σ_e f_e P_e over the 4 rows' real tokens.
    real = torch.cat([p[mask.reshape(-1).bool()] for p in padded])
    probs = real.softmax(-1)
    f = torch.zeros(6, dtype=torch.float64).index_add(0, probs.topk(2).indices.reshape(-1),
                                                      torch.ones(2 * len(real), dtype=torch.float64)) / len(real)
    exact = 6 * (f * probs.mean(0)).sum()
    assert abs(float(ours) - float(exact)) < 1e-6 and abs(float(ref) - float(exact)) < 1e-6


def test_a_coefficient_for_a_dense_model_is_refused_by_name(tiny_train_model, tmp_path) -> None:
    with pytest.raises(TrainConfigError, match="router_aux_loss_coef"):
        sft_trainer(tiny_train_model, tmp_path / "sft", router_aux_loss_coef=0.01)
    with pytest.raises(TrainConfigError, match="router_aux_loss_coef"):
        dpo_trainer(tiny_train_model, tmp_path / "dpo", preference_rows(4), router_aux_loss_coef=0.01)
    sft_trainer(tiny_train_model, tmp_path / "off", router_aux_loss_coef=0.0)  # 0: nothing to weight, allowed


def test_which_models_add_the_loss_and_with_what_weight() -> None:
    """TRL's rule: a model whose config declares `output_router_logits` (transformers' Mixtral, Qwen3-MoE,
    gpt-oss, DeepSeek-V3) has the loss, weighted by the trainer's coefficient or else by the config's
    `router_aux_loss_coef` (0 where it declares none: DeepSeek-V3, which computes no such loss either);
    a non-zero weight for a model without the loss is refused by the field's name."""
    import transformers

    for name, raw in [*FAMILIES.items(), *DEEPSEEK_FAMILIES.items()]:
        ours = ModelConfig.from_dict(dict(raw, router_aux_loss_coef=0.02, output_router_logits=False))
        theirs = transformers.AutoConfig.for_model(raw["model_type"])
        has_loss = hasattr(theirs, "output_router_logits") and hasattr(theirs, "router_aux_loss_coef")
        assert ours.load_balancing_loss == has_loss, name
        assert router_loss_coef(0.0, ours) == 0.0
        if has_loss:  # whatever the config's `output_router_logits`
            assert (router_loss_coef(None, ours), router_loss_coef(0.3, ours)) == (0.02, 0.3)
        else:
            assert router_loss_coef(None, ours) == 0.0
            with pytest.raises(TrainConfigError, match="router_aux_loss_coef"):
                router_loss_coef(0.01, ours)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_grpo_adds_the_router_loss_of_trls_rows(tmp_path, mask_truncated: bool) -> None:
    """With a router load-balancing loss (Mixtral, the config's coefficient): each micro-batch adds the
    coefficient times transformers' `aux_loss` over the micro-batch as TRL's GRPO trainer lays it out
    (a row per completion: its prompt left-padded, the completion right-padded, a truncated one masked
    out with `mask_truncated_completions`), divided by the step's micro-batches; `aux_loss` is that value."""
    from transformers import AutoModelForCausalLM

    model_dir = build_model_dir(tmp_path / "moe", architectures=["MixtralForCausalLM"], num_experts_per_tok=2,
                                num_local_experts=8, router_aux_loss_coef=0.5)
    algo = grpo(model_dir, write_prompts(tmp_path), mask_truncated_completions=mask_truncated)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batches = algo.step_batches(1)
    r, total = algo.rollout, torch.tensor(float(sum(algo.count(b) for b in batches)))
    assert r is not None and len(batches) == 2
    assert bool(r.truncated.any()) or not mask_truncated  # something masked out
    for b in batches:
        with torch.no_grad():
            loss, metrics = algo.loss(algo.model, b, total)
            algo.router_coef = 0.0
            without, _ = algo.loss(algo.model, b, total)
            algo.router_coef = 0.5
        index = b.completion_index.tolist()
        prompts = [r.prompts[i // r.num_generations].prompt_ids for i in index]
        answers = [r.completion_ids[i] for i in index]
        width_p, width_c = max(map(len, prompts)), max(map(len, answers))
        ids = torch.tensor([[0] * (width_p - len(p)) + p + c + [0] * (width_c - len(c))
                            for p, c in zip(prompts, answers, strict=True)])
        keep = [not (mask_truncated and bool(r.truncated[i])) for i in index]
        mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) + [int(k)] * len(c)
                             + [0] * (width_c - len(c)) for k, p, c in zip(keep, prompts, answers, strict=True)])
        with torch.no_grad():
            aux = hf(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss.item()
        assert float(metrics["aux_loss"].total) == pytest.approx(aux, abs=1e-6)
        assert float(loss - without) == pytest.approx(0.5 * aux / 2, abs=1e-6)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_eval_loss_holds_the_router_term_as_trls(tmp_path, kind: str) -> None:
    """The eval loss with the router's term less the same eval without it (`router_aux_loss_coef=0`) is the
    coefficient times the mean over the eval set's micro-batches of transformers' own `aux_loss` on those
    micro-batches' rows (TRL's eval loss: the mean of its batches' losses, each with the term)."""
    from first_batches import theirs

    from pagedrl.model.loader import load_model
    from pagedrl.train.algorithms.sft import SFT
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.offline_config import SFTConfig

    folder = build_model_dir(tmp_path / "model", num_experts_per_tok=2, router_aux_loss_coef=COEF, **MOE["mixtral"])

    def algorithm(**settings: object):
        if kind == "dpo":
            rows = preference_rows(8, seed=3)
            return dpo_trainer(folder, tmp_path / "dpo", rows, eval_rows=preference_rows(6, seed=4),
                               per_device_train_batch_size=4, **settings).algorithm
        rows = [r for r in arithmetic_rows() if isinstance(r["prompt"], str)]
        config = SFTConfig(model=str(folder), output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4,
                           max_steps=1, seed=0, **settings)
        loaded = load_model(config.model, device="cpu", dtype=torch.float32)
        return SFT(config, loaded.model, loaded.tokenizer, DistInfo(), rows[:4], rows[1:])

    with_term, without = algorithm(), algorithm(router_aux_loss_coef=0.0)
    evaluated, plain = with_term.evaluate(0), without.evaluate(0)

    def rows_of(example) -> list[list[int]]:  # the token rows transformers (and TRL) run for an example
        if kind == "sft":
            return [example.input_ids]
        pair = getattr(example, "pair", example)
        return [pair.prompt_ids + pair.chosen_ids, pair.prompt_ids + pair.rejected_ids]

    model, size = theirs(folder).eval(), with_term.per_device
    examples = with_term.eval_examples
    batches = [examples[i:i + size] for i in range(0, len(examples), size)]
    assert len(batches) >= 2 and len(examples) % size != 0  # a short last batch counts as one, as TRL's does
    terms = []
    for batch in batches:
        token_rows = [r for e in batch for r in rows_of(e)]
        if kind == "dpo":  # TRL's DPO runs every chosen row, then every rejected one
            token_rows = token_rows[0::2] + token_rows[1::2]
        width = max(map(len, token_rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in token_rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in token_rows])
        with torch.no_grad():
            terms.append(float(model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss))
    expected = COEF * sum(terms) / len(terms)
    assert expected > 0.1  # the term is there to be checked
    assert evaluated["loss"] - plain["loss"] == pytest.approx(expected, abs=1e-5)
    assert "aux_loss" in evaluated and "aux_loss" not in plain
