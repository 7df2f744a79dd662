"""DPO's first batch against TRL 1.16's DPOTrainer on the same saved model, rows and settings:
the same tokens, the same per-answer log-probs (ours packed as [prompt, chosen, rejected] rows,
TRL's as two padded rows), the same loss and metrics."""

from __future__ import annotations

import decoder_bound
import pytest
import torch
from float_bounds import gamma, log_softmax_bounds
from preference_data import dpo_trainer, preference_rows
from tiny_train import build_model_dir

from pagedrl.train.algorithms.dpo import answer_logps
from pagedrl.train.dpo_losses import dpo_loss

PAIRS = 4  # one TRL micro-batch, one of ours
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """A second random model with the same tokenizer, as a reference that differs from the policy."""
    return str(build_model_dir(tmp_path_factory.mktemp("tiny-ref") / "model", seed=1))


def trl_first_batch(model_dir, ref_dir, rows, tmp_path, **settings):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32) if ref_dir else None
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PAIRS, bf16=False, use_cpu=True,
                     report_to="none", **{"max_length": None, "seed": 0, **settings})
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    features = [trainer.train_dataset[i] for i in range(PAIRS)]
    batch = trainer.data_collator(features)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)  # the policy's own log-probs
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return features, float(loss.detach()), torch.cat([chosen, rejected]), metrics, policy.model.rotary_emb.inv_freq


def exact_first_batch(policy, reference, pairs, freq, beta: float, settings: dict):
    """The batch's answer log-probs [2n] (chosen first) and, in `METRICS` order after the loss, its
    metrics (the accuracy's per-pair margins apart), each exact (float64 forwards of both models,
    `decoder_bound`) and on perturbed forwards, where each answer's sum also carries its tokens' own
    log_softmax roundings and the sum's (any order); the policy's and the reference's forwards round
    independently, even where the reference is the policy itself."""
    n = len(pairs)
    settings = dict(settings)
    ld_alpha = settings.pop("ld_alpha", None)  # LD-DPO weighs the tokens past the pair's shorter answer
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    starts = [len(p.prompt_ids) for p in pairs] * 2
    width = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    freq_error = (freq.double() - policy.model.inv_freq.double()).abs()  # transformers' float32 frequencies

    def answers(model, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[1 + PROBES, 2n] sums of log-probs; [1 + PROBES, tokens] vocabulary means of the logits and
        their magnitudes' means [tokens], chosen answers' tokens first."""
        probed = decoder_bound.logits(model, ids, mask, freq_error=freq_error, seed=seed)
        g = torch.Generator().manual_seed(seed + 100)
        sums, means, sizes = [], [], []
        for i, (q, start) in enumerate(zip(seqs, starts, strict=True)):
            rows, targets = probed.values[:, i, start - 1:len(q) - 1], torch.tensor(q[start:])
            logp = torch.log_softmax(rows, -1).gather(-1, targets.expand(rows.shape[0], -1)[..., None])[..., 0]
            own = log_softmax_bounds(rows[0]).gather(1, targets[:, None]).sum() + gamma(len(q)) * logp[0].abs().sum()
            signs = torch.randint(0, 2, (rows.shape[0],), generator=g).double() * 2 - 1
            signs[0] = 0
            weights = torch.ones(len(targets), dtype=torch.float64)
            if ld_alpha is not None:  # weights of at most 1: `own` still bounds the weighted sum's roundings
                p = pairs[i % n]
                weights[min(len(p.chosen_ids), len(p.rejected_ids)):] = ld_alpha
            sums.append((logp * weights).sum(-1) + signs * own)
            means.append(rows.mean(-1))
            sizes.append(rows[0].abs().mean(-1))
        return torch.stack(sums, -1), torch.cat(means, -1), torch.cat(sizes)

    pol, logit_means, logit_sizes = answers(policy, 0)
    ref = answers(reference, 1)[0]
    lengths = torch.tensor([len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]).double()
    split = sum(len(p.chosen_ids) for p in pairs)

    def outcome(pi: torch.Tensor, r: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        out = dpo_loss(*pi.chunk(2), *r.chunk(2), beta=beta, chosen_lengths=lengths[:n],
                       rejected_lengths=lengths[n:], **settings)
        margins = out.chosen_rewards - out.rejected_rewards
        return torch.cat([torch.stack([out.losses.mean(), out.chosen_rewards.mean(), out.rejected_rewards.mean(),
                                       margins.mean(), pi[:n].mean(), pi[n:].mean(), means[:split].mean(),
                                       means[split:].mean()]), margins])

    values = decoder_bound.Probed(torch.stack([outcome(*v) for v in zip(pol, ref, logit_means, strict=True)]))
    # Each in float32 besides: a chain of a few roundings (differences, beta, the loss's exp and log,
    # means over n pairs, over the answers' tokens and over a 300-token vocabulary) on values of at
    # most the log-probs' size (times the loss's slope) or the logits'.
    pi = pol[0].clone().requires_grad_()
    (slope,) = torch.autograd.grad(outcome(pi, ref[0], logit_means[0])[0], pi)
    size = pol[0].abs() + ref[0].abs()
    sizes = torch.cat([torch.stack([(slope.abs() * size).sum() + values.exact[0].abs(), beta * size[:n].mean(),
                                    beta * size[n:].mean(), 2 * beta * size.mean(), pol[0, :n].abs().mean(),
                                    pol[0, n:].abs().mean(), logit_sizes[:split].mean(), logit_sizes[split:].mean()]),
                       beta * (size[:n] + size[n:])])
    chains = torch.full_like(sizes, gamma(16))
    chains[6:8] = gamma(300 + len(logit_sizes))  # the vocabulary means, then the mean over tokens
    return decoder_bound.Probed(pol), values.exact, values.bound() + chains * sizes


@pytest.mark.parametrize(("settings", "precompute", "other_ref", "chat"), [
    (dict(loss_type="sigmoid"), False, True, False),
    (dict(loss_type="ipo"), True, True, True),
    (dict(loss_type="robust", label_smoothing=0.2), False, False, True),
    (dict(loss_type="hinge"), True, False, False),
    # MPO's list: the sft term's NLL over the chosen tokens from the same forward
    (dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]), False, True, True),
    (dict(loss_type=["exo_pair", "aot", "discopop"], label_smoothing=1e-3, discopop_tau=0.1), True, True, False),
    # f-DPO: the answers' scores in place of their log-ratios
    (dict(loss_type="sigmoid", f_divergence_type="js_divergence"), False, True, False),
    (dict(loss_type=["ipo", "sft"], f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3), True, True,
     True),
    # LD-DPO: the verbose tokens weighed, the reference's sums (precomputed or not) too
    (dict(loss_type="sigmoid", ld_alpha=0.4), True, True, False),
    (dict(loss_type="hinge", ld_alpha=0.0), False, True, False),
])
def test_first_batch_equals_trl_dpo_trainer(tiny_train_model, other_model, tmp_path, settings, precompute,
                                            other_ref, chat) -> None:
    rows = preference_rows(8, seed=3, chat_every=1 if chat else 0)
    if "ld_alpha" in settings:  # answers of different lengths, so that some tokens are verbose ones
        rows = [dict(r, chosen=r["chosen"] + " dog" * (i % 3), rejected=r["rejected"] + " red cat" * (i % 2))
                for i, r in enumerate(rows)]
    ref_dir = other_model if other_ref else None
    features, trl_loss, trl_logps, trl_metrics, freq = trl_first_batch(
        tiny_train_model, ref_dir, rows, tmp_path, beta=0.3, precompute_ref_log_probs=precompute, **settings)

    from pagedrl.model.loader import load_model

    # The same reference TRL got (run_dpo loads `ref_model` the same way), or a copy of the policy.
    reference = load_model(ref_dir).model if other_ref else None
    trainer = dpo_trainer(tiny_train_model, tmp_path / "ours", rows, reference=reference, beta=0.3,
                          precompute_ref_log_probs=precompute, per_device_train_batch_size=PAIRS, **settings)
    algorithm = trainer.algorithm
    assert (algorithm.reference is None) == precompute  # precomputed: the reference is gone
    types = settings["loss_type"] if isinstance(settings["loss_type"], list) else [settings["loss_type"]]
    assert any(line.startswith(f"dpo: loss {' + '.join(types)}") for line in algorithm.summary_lines())
    examples = algorithm.examples[:PAIRS]
    pairs = [getattr(e, "pair", e) for e in examples]
    for pair, feature in zip(pairs, features, strict=True):  # the same tokens, cut at the same place
        assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == (
            feature["prompt_ids"], feature["chosen_ids"], feature["rejected_ids"])

    if "ld_alpha" in settings:
        assert any(len(p.chosen_ids) != len(p.rejected_ids) for p in pairs)
    # Ours and TRL's against the exact values, within float32's bounds (~3e-3 on sums of ~100 over ~17 tokens'
    # log-probs; an answer token predicted from the wrong row moves a sum by ~1).
    policy = load_model(tiny_train_model).model
    logps, expected, bound = exact_first_batch(policy, reference if other_ref else policy, pairs, freq, 0.3,
                                               settings)
    batch = algorithm.collate(examples)
    with torch.no_grad():
        ours_logps = answer_logps(algorithm.model, batch, ld_alpha=settings.get("ld_alpha")).logps
    for got in (ours_logps, trl_logps):
        assert ((got.double() - logps.exact).abs() <= logps.bound()).all()
    loss, metrics = algorithm.loss(trainer.handle, batch, torch.tensor(float(PAIRS)))
    for got in (float(loss.detach()), trl_loss):
        assert abs(got - float(expected[0])) <= float(bound[0])
    named = [m for m in METRICS if m != "rewards/accuracies"]
    for i, name in enumerate(named, start=1):
        m = metrics[name]
        for got in (float(m.total) / float(m.weight), trl_metrics[name]):
            assert abs(got - float(expected[i])) <= float(bound[i]), name
    if other_ref:
        assert abs(trl_metrics["rewards/margins"]) > 1e-3  # a reference that differs, so the rewards count
        margins, margin_bound = expected[len(named) + 1:], bound[len(named) + 1:]
        assert (margins.abs() > margin_bound).all()  # each pair's comparison decided in float32
        accuracy = float((margins > 0).double().mean())
        assert float(metrics["rewards/accuracies"].total) / PAIRS == accuracy == trl_metrics["rewards/accuracies"]
    # else the reference is the starting policy: every margin is 0 but for rounding (checked above
    # within its bound), and whether a reward exceeds another is float32's choice
