"""vLLM's pooling runner for pagedrl's sequence classifiers: `LLM(folder, runner="pooling")` on a
`*ForSequenceClassification` folder (what `pagedrl rm` saves, or transformers writes) or a SEQ_CLS LoRA
adapter (`pagedrl rm` with use_peft, folded into the base it names), with vLLM's `classify`, `reward`
and `encode`.

Each call tokenizes its prompts (text as the tokenizer adds special tokens, token ids as given, a chat
rendered by the caller), then runs the scorer over them in batches, right-padded and masked, the backbone in
the precision the loader chose, the engine's, the score head and its activation in float32 (vLLM keeps a pooling
model's head in float32). What comes back:

- `classify`: the score at the last token that is not the pad token (`model/heads.py` `score_index`,
  the token transformers, the reward trainer and PPO's reward scorer read; vLLM reads the prompt's last
  token, which differs only when the pad token is EOS and the prompt ends in it), through the activation
  of vLLM's classifier pooler (`PoolerClassify`): a sigmoid for one label, a softmax for several, none
  for `problem_type: regression`. `outputs.probs`.
- `reward`: the raw score (no activation) at every prompt token, `outputs.data` of shape [tokens, num_labels];
  the row at the scored token is `pagedrl rm`'s reward. This is what vLLM gives for a reward-model
  architecture whose forward scores every token (`Qwen2ForRewardModel`), and later vLLM's `token_classify`
  with `PoolingParams(use_activation=False)`. vLLM 0.10's `reward` on a `*ForSequenceClassification` runs its
  `encode` task, which answers with the backbone's hidden states, not scores: that task is refused here.

Either takes vLLM's `pooling_params` (`engine/pooling_params.py`): `use_activation` turns the activation off
for `classify` or on for `reward`, `truncate_prompt_tokens` keeps a prompt's last tokens.

The KV cache, the scheduler and the sampler take no part: a classifier reads each prompt once."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any, NoReturn

import torch
from tqdm.auto import tqdm

from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.pooling_loras import PoolingAdapters, loras_per_prompt
from pagedrl.engine.pooling_outputs import ClassificationRequestOutput, PoolingOutput, PoolingRequestOutput
from pagedrl.engine.pooling_params import PoolingParams, params_per_prompt
from pagedrl.engine.pooling_runner import is_classifier_folder
from pagedrl.engine.prompt_inputs import Prompt, as_prompt, engine_args_from
from pagedrl.engine.request_checks import encode_prompt
from pagedrl.model.heads import SequenceScorer, last_logits, padded_hidden
from pagedrl.model.merge import load_reward_model, merged_scorer
from pagedrl.model.precision import resolve_dtype
from pagedrl.model.resolve import adapter_base, resolve_model_path
from pagedrl.model.scorer_skeleton import scorer_skeleton
from pagedrl.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
POOLING_TASKS = ("classify", "token_classify")
# vLLM 0.10's `LLM.encode` default: a sequence classifier's hidden states at every token, not its scores
HIDDEN_STATES_TASK = "encode"
PromptsArg = Prompt | Mapping[str, Any] | Seq[Prompt | Mapping[str, Any]]
PoolingParamsArg = PoolingParams | Seq[PoolingParams] | None
LoRAArg = LoRARequest | Seq[LoRARequest | None] | None


def prompt_list(prompts: PromptsArg) -> list[Prompt | Mapping[str, Any]]:
    """vLLM's prompts argument as a list: one prompt (text, token ids, a prompt dict) or several."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def too_long(num_tokens: int, max_model_len: int) -> str:
    """vLLM's message for a classification input over the context, naming the setting."""
    return (f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you "
            f"requested {num_tokens} tokens in the input for classification. Please reduce the length of the input.")


def classify_activation(network: SequenceScorer) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's classification activation, as transformers' sequence-classification loss reads `problem_type`:
    none for regression, a sigmoid per label for multi_label_classification, else a sigmoid for one label
    and a softmax over several."""
    problem_type = network.config.extra.get("problem_type")
    if problem_type == "regression":
        return lambda x: x
    if problem_type == "multi_label_classification" or network.score.out_features == 1:
        return torch.sigmoid
    return lambda x: torch.softmax(x, dim=-1)


class PoolingLLM:
    """What `LLM(model, runner="pooling")` returns (`engine/llm.py` `LLM.__new__`). Of EngineArgs it reads
    the model's fields (model, adapter, revision, device, dtype), max_model_len, max_num_seqs and
    max_num_batched_tokens as the size of one forward's batch, and enable_lora, max_loras, max_lora_rank and
    max_cpu_loras for SEQ_CLS adapters chosen per request (`engine/pooling_loras.py`; the model then may be
    the causal LM they were trained on, which scores only through them)."""

    def __init__(self, model: str | None = None, *, tokenizer: Any = None, **engine_args: Any) -> None:
        args = self.engine_args = engine_args_from(model, engine_args)
        config = args.engine_config()
        config.validate()
        if args.quantization:
            raise ValueError("quantization: not supported with runner='pooling' (the classifier's float weights are "
                             "loaded)")
        if args.enable_lora and args.adapter is not None:
            raise ValueError("enable_lora: adapters per request apply to the model itself; name the base as the model "
                             "and each SEQ_CLS adapter per request (lora_request), without adapter")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision = resolve_dtype(args.dtype, device)
        self.adapters: PoolingAdapters | None = None
        self.base_scores = True  # False: a causal LM base with adapters, whose placeholder head is never read
        if args.adapter is not None:
            adapter = resolve_model_path(args.adapter)
            base = None if args.model is None else resolve_model_path(args.model, args.revision)
            self.network = merged_scorer(base, adapter, device=device, dtype=self.precision.dtype, float_head=True)
            folders = [adapter, adapter_base(adapter, base)]
        else:
            path = resolve_model_path(args.model, args.revision)
            if args.enable_lora:
                self.adapters = PoolingAdapters(path, device, self.precision.dtype, config.max_loras,
                                                config.max_lora_rank, config.max_cpu_loras)
                self.base_scores = is_classifier_folder(path)
            # a causal LM base scores only through its adapters' copies: of it only the config is read (a
            # skeleton on the meta device, holding no weights)
            self.network = load_reward_model(path, device=device, dtype=self.precision.dtype, float_head=True,
                                             any_labels=True) if self.base_scores else scorer_skeleton(path)
            folders = [path]
        if tokenizer is None:
            found = [f for f in folders if (f / "tokenizer.json").is_file()]
            tokenizer = Tokenizer.from_folder(found[0]) if found else None
        else:
            from pagedrl.engine.llm import _tokenizer_from

            tokenizer = _tokenizer_from(tokenizer)
        self.tokenizer = tokenizer
        self.max_model_len = config.context_length(self.network.config.max_model_len)
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.pad_token_id = self.network.config.pad_token_id
        if self.pad_token_id is None and tokenizer is not None:
            self.pad_token_id = tokenizer.pad_token_id
        self._ids = itertools.count()
        logger.info("pagedrl pooling runner: %s (%s) on %s, max_model_len %d", self.network.config.architecture,
                    self.precision.describe(), device, self.max_model_len)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def encode_prompts(self, prompts: PromptsArg,
                       truncate_prompt_tokens: int | None | Seq[int | None] = None) -> list[list[int]]:
        """Each prompt's token ids, checked (empty, outside the vocabulary, longer than max_model_len: a
        ValueError naming it); `truncate_prompt_tokens` (one for all, or one per prompt) keeps the last k
        (-1: max_model_len; more than max_model_len is a ValueError) as vLLM's does."""
        prompts = prompt_list(prompts)
        per_prompt = list(truncate_prompt_tokens) if isinstance(truncate_prompt_tokens, Seq) else \
            [truncate_prompt_tokens] * len(prompts)
        encoded = []
        for i, (prompt, truncate) in enumerate(zip(prompts, per_prompt, strict=True)):
            text_or_ids, _ = as_prompt(prompt, i)
            keep = self._kept(truncate)
            try:
                ids = encode_prompt(text_or_ids, self.tokenizer, self.network.config.vocab_size, keep)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompts[{i}]: {too_long(len(ids), self.max_model_len)}")
            encoded.append(ids)
        return encoded

    def _kept(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens `truncate_prompt_tokens` keeps (None: all), checked as vLLM's
        `_validate_truncation_size` checks it."""
        if truncate_prompt_tokens is None:
            return None
        if type(truncate_prompt_tokens) is not int or truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
            raise ValueError("truncate_prompt_tokens: must be a positive integer or -1, got "
                             f"{truncate_prompt_tokens!r}")
        if truncate_prompt_tokens > self.max_model_len:
            # vLLM's check, in words that do not read as a prompt too long
            raise ValueError(f"truncate_prompt_tokens: {truncate_prompt_tokens} is greater than the model's maximum "
                             f"context length ({self.max_model_len} tokens); select a smaller truncation size")
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def _batches(self, encoded: list[list[int]]) -> list[list[int]]:
        """The prompts' indices per forward: at most max_num_seqs, padded to at most max_num_batched_tokens
        (a longer prompt alone)."""
        out: list[list[int]] = []
        for i, ids in enumerate(encoded):
            last = out[-1] if out else None
            if last and len(last) < self.max_num_seqs and \
                    (len(last) + 1) * max(len(ids), *(len(encoded[j]) for j in last)) <= self.max_num_batched_tokens:
                last.append(i)
            else:
                out.append([i])
        return out

    @torch.no_grad()
    def encode(self, prompts: PromptsArg, pooling_params: PoolingParamsArg = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request: LoRAArg = None,
               pooling_task: str = "token_classify") -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: one PoolingRequestOutput per prompt, in order; `pooling_task` "classify"
        (one score per prompt) or "token_classify" (the score of every token), each through the activation
        as `pooling_params` (one, or one per prompt) asks (`engine/pooling_params.py`)."""
        if pooling_task == HIDDEN_STATES_TASK:
            raise ValueError("pooling_task: 'encode' (vLLM 0.10's default) gives a classifier's hidden states, not "
                             f"its scores, and is not served; use one of {', '.join(POOLING_TASKS)}")
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task: {pooling_task!r} is not one of {', '.join(POOLING_TASKS)} (a "
                             "sequence classifier classifies; it has no embeddings)")
        prompts = prompt_list(prompts)
        params = params_per_prompt(pooling_params, len(prompts), truncate_prompt_tokens)
        activated = [p.activation_for(pooling_task) for p in params]
        loras = loras_per_prompt(lora_request, len(prompts))
        for lora in dict.fromkeys(loras):
            self.check_lora(lora)
        encoded = self.encode_prompts(prompts, [p.truncate_prompt_tokens for p in params])
        data: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
        # each adapter's prompts batched apart, in the order the adapters first come: each folded once a call
        batches = [(lora, [rows[i] for i in batch]) for lora in dict.fromkeys(loras)
                   for rows in [[i for i, x in enumerate(loras) if x == lora]]
                   for batch in self._batches([encoded[i] for i in rows])]
        network, network_lora = None, None
        for lora, rows in tqdm(batches, desc=pooling_task, unit="batch", disable=not use_tqdm or len(batches) < 2):
            if network is None or lora != network_lora:
                network = None  # the last adapter's copy may be dropped before this one is folded
                network, network_lora = self.network_for(lora), lora
                network.eval()
            batch = [encoded[i] for i in rows]
            if pooling_task == "classify":
                scores = last_logits(network, batch, self.pad_token_id).cpu()
                pooled = [scores[k] for k in range(len(rows))]
            else:
                scores = network.logits(padded_hidden(network, batch, self.pad_token_id)).cpu()
                pooled = [scores[k, :len(encoded[i])] for k, i in enumerate(rows)]
            activate = classify_activation(network)
            for i, row in zip(rows, pooled, strict=True):
                data[i] = activate(row) if activated[i] else row
        return [PoolingRequestOutput(str(next(self._ids)), PoolingOutput(d), ids) for d, ids in zip(data, encoded,
                                                                                                   strict=True)]

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Whether a request may run with `lora_request` (None: the model itself), before any weight is read."""
        if lora_request is None:
            if not self.base_scores:
                raise ValueError("lora_request: the model is a causal LM, whose head scores nothing; name one of its "
                                 "SEQ_CLS adapters (lora_request, or the request's model)")
        elif self.adapters is None:
            raise ValueError("lora_request: adapters per request need LLM(..., runner='pooling', enable_lora=True) "
                             "(or load the SEQ_CLS adapter itself as the model)")
        else:
            self.adapters.check(lora_request)

    def network_for(self, lora_request: LoRARequest | None) -> SequenceScorer:
        """The scorer a request runs on: the model's, or with `enable_lora` the adapter's
        (`engine/pooling_loras.py`)."""
        self.check_lora(lora_request)
        return self.network if lora_request is None else self.adapters.scorer(lora_request)  # type: ignore[union-attr]

    def id2label(self, lora_request: LoRARequest | None = None) -> dict:
        """The config's id2label of the model or of the adapter (transformers writes its keys as strings),
        held in memory: a response names its labels without reading a file."""
        if lora_request is None or self.adapters is None:
            return self.network.config.extra.get("id2label") or {}
        return self.adapters.id2label(lora_request)

    def classify(self, prompts: PromptsArg, *, pooling_params: PoolingParamsArg = None,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 lora_request: LoRAArg = None) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's class probabilities (`outputs.probs`; one label: its sigmoid,
        several: their softmax; the raw scores with `PoolingParams(use_activation=False)`)."""
        return [ClassificationRequestOutput.from_base(out) for out in
                self.encode(prompts, pooling_params, pooling_task="classify", use_tqdm=use_tqdm,
                            lora_request=lora_request, truncate_prompt_tokens=truncate_prompt_tokens)]

    def reward(self, prompts: PromptsArg, *, pooling_params: PoolingParamsArg = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: LoRAArg = None) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.reward`: each prompt's raw reward at every token (`outputs.data`, [tokens, num_labels];
        through the activation with `PoolingParams(use_activation=True)`)."""
        return self.encode(prompts, pooling_params, pooling_task="token_classify", use_tqdm=use_tqdm,
                           lora_request=lora_request, truncate_prompt_tokens=truncate_prompt_tokens)

    def _generate_only(self, name: str) -> NoReturn:
        raise ValueError(f"LLM.{name}() is only supported for generative models; this LLM runs runner='pooling' "
                         "(use classify() or reward(), or load a causal LM with runner='generate')")

    def generate(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._generate_only("generate")

    def chat(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._generate_only("chat")

    def beam_search(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._generate_only("beam_search")
