"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedrl.model import batch_invariant
from pagedrl.model.decoder import CausalLM
from pagedrl.model.precision import Precision

logger = logging.getLogger(__name__)

Prompt = str | list[int]


def final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """The same params asking for FINAL_ONLY outputs: only the final one of each request is returned, so
    no step builds the others (vLLM's LLM.generate does the same). Shared params are cloned once."""
    clones: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        if not isinstance(p, SamplingParams) or p.output_kind is RequestOutputKind.FINAL_ONLY:
            out.append(p)  # a wrong type is refused, naming it, by add_request
            continue
        if id(p) not in clones:
            clones[id(p)] = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        out.append(clones[id(p)])
    return out


class LLM:
    """An engine plus a model. `LLM()` loads the embedded default; `LLM("org/name", revision=...)` a
    Hugging Face Hub id (or a local folder, a .gguf file: `model/resolve.py`); `LLM(model, adapter=folder)` a
    base model with a LoRA adapter (PEFT's format) folded into its weights at load, so it decodes at
    the base's speed (`model` None: the base the adapter names); `LLM.from_module(model, tokenizer)`
    runs on a model that training owns (same parameter tensors, no copy; a live adapter included).

    `LLM(model, enable_lora=True, max_loras=N, max_lora_rank=R)` serves many adapters, chosen per
    prompt with `generate(..., lora_request=LoRARequest(name, id, path))`, side by side in the same
    steps (`engine/multi_lora.py`).

    `batch_invariant=True` (CPU): a request's numbers do not depend on what else runs in its steps
    (`model/batch_invariant.py`): its log-probs, and so its seeded samples, are the same alone or
    among a hundred others, at some cost in speed."""

    def __init__(self, model: str | None = None, *, adapter: str | None = None, revision: str | None = None,
                 tokenizer: Any = None,
                 device: str | None = None,
                 dtype: torch.dtype | str | None = None, kv_cache_tokens: int | None = None,
                 kv_cache_bytes: int | None = None, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, max_model_len: int | None = None, seed: int = 0,
                 gpu_memory_utilization: float = 0.9, attention_impl: str = "auto", enforce_eager: bool = False,
                 autocast_dtype: torch.dtype | None = None, cast_weights: bool = True, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 batch_invariant: bool = False, _module: CausalLM | None = None,
                 _eos_token_ids: list[int] | None = None) -> None:
        config = EngineConfig(block_size=block_size, kv_cache_tokens=kv_cache_tokens, kv_cache_bytes=kv_cache_bytes,
                              gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching,
                              enable_chunked_prefill=enable_chunked_prefill, max_model_len=max_model_len, seed=seed,
                              attention_impl=attention_impl, enforce_eager=enforce_eager,
                              autocast_dtype=autocast_dtype, cast_weights=cast_weights, enable_lora=enable_lora,
                              max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                              batch_invariant=batch_invariant)
        config.validate()  # before a model is loaded (the engine checks it again, for its other callers)
        if enable_lora and _module is not None:
            raise ValueError("enable_lora: adapters per request need a model the engine owns (LLM(model, ...)); "
                             "a module training owns would have its projections replaced")
        owned = _module is None
        if owned:
            from pagedrl.model.loader import load_model

            loaded = load_model(model, device=device, dtype=dtype, adapter=adapter, revision=revision)
            _module, tokenizer, _eos_token_ids = loaded.model, loaded.tokenizer, loaded.eos_token_ids
            self.precision = loaded.precision
            logger.info("pagedrl engine: %s on %s", self.precision.describe(), _module.device)
        elif autocast_dtype is not None:
            self.precision = Precision(autocast_dtype, f"autocast over {str(_module.dtype).removeprefix('torch.')} "
                                                       "weights, as the trainer computes")
        else:
            self.precision = Precision(_module.dtype, "the module's own")
        self.engine = LLMEngine(_module, tokenizer, config, eos_token_ids=_eos_token_ids)
        if owned:
            logger.info("pagedrl engine: %s", self.engine.runner.decode_path())
        self._ids = itertools.count()

    @classmethod
    def from_module(cls, model: CausalLM, tokenizer: Any = None, eos_token_ids: list[int] | None = None,
                    **engine_args: Any) -> LLM:
        return cls(tokenizer=tokenizer, _module=model, _eos_token_ids=eos_token_ids, **engine_args)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def block_size(self) -> int:
        """Tokens per KV block (prefix hits and forks share whole blocks)."""
        return self.engine.block_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) this engine runs."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def reseed(self, seed: int) -> None:
        """Restart the random stream of requests whose `SamplingParams` carry no seed."""
        self.engine.reseed(seed)

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. `lora_request`:
        one adapter for every prompt, or one (or None, the base) per prompt. A sample whose logits go NaN
        or infinite ends there with finish_reason "error" (its `error` says why, and a warning is logged),
        as vLLM marks it; the other prompts are not affected."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        params = final_only(params)
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                ids.append(self.engine.add_request(prompt, p, request_id=f"gen-{next(self._ids)}", lora_request=lora))
        except ValueError:
            for rid in ids:  # a bad prompt rejects the whole call and leaves nothing queued
                self.engine.abort_request(rid)
            raise
        return self.run_to_completion(ids, use_tqdm)

    def run_to_completion(self, request_ids: list[str], use_tqdm: bool = True) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while len(done) < len(wanted) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in wanted - done.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in request_ids]

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # one conversation
        prompts = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                      **(chat_template_kwargs or {}))
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    @contextlib.contextmanager
    def batch_invariance_suspended(self) -> Iterator[None]:
        """Steps at full speed for a while, not batch-invariant: a trainer's greedy evaluations, whose
        numbers no trainer recomputes."""
        with batch_invariant.suspended(self.engine.runner.model):
            yield

    def sleep(self) -> None:
        """Release the KV cache memory until the next request (vLLM's sleep mode, level 1)."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        """Abort every request still running and free the KV cache (a run that stops early); the
        next request allocates it again, so a closed LLM still works."""
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self.engine.sleep()

    def bump_weight_version(self) -> int:
        """Call after an optimizer step changed the weights this engine reads."""
        return self.engine.bump_weight_version()
