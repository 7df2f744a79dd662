"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagedrl.engine.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchParams,
    advance_all,
    check_logprobs_limit,
    live_beams,
    step_params,
)
from pagedrl.engine.engine_args import EngineArgs, ordered_fields
from pagedrl.engine.generation_defaults import generation_defaults
from pagedrl.engine.llm_engine import LLMEngine
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.pooling_runner import GenerateRunner, pooling_wanted
from pagedrl.engine.prompt_inputs import Prompt, as_prompt, engine_args_from
from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedrl.model import batch_invariant
from pagedrl.model.chat_template import select_chat_template
from pagedrl.model.content_format import ContentFormat, content_format_for
from pagedrl.model.decoder import CausalLM
from pagedrl.model.footprint import footprint
from pagedrl.model.precision import Precision

logger = logging.getLogger(__name__)

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


def _tokenizer_from(tokenizer: Any) -> Any:
    """`LLM(tokenizer=...)`: a folder's tokenizer, or the object given."""
    if isinstance(tokenizer, (str, Path)):
        from pagedrl.model.tokenizer import Tokenizer

        folder = Path(tokenizer)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: {folder} holds no tokenizer.json (give a local folder; "
                             "a Hub id is a model's name, the tokenizer comes with it)")
        return Tokenizer.from_folder(folder)
    return tokenizer


def _shaped_content(message: Mapping[str, Any], index: int, content_format: ContentFormat) -> dict[str, Any]:
    """A message with its content in the template's shape (`model/content_format.py`, as the server
    shapes it): `string` joins a list of text parts with newlines; `openai` gives a list of text parts (a
    string is one part), except for a tool's answer, which stays a string as vLLM gives it."""
    if not isinstance(message, Mapping):
        return message  # the template names a bad one
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{index}].content[{j}]: only text parts are supported, got {part!r}")
            texts.append(part["text"])
    elif content is None or isinstance(content, str):
        texts = [] if content is None else [content]  # None: no text parts, "" or [] as the server gives it
    else:
        return dict(message)
    if content_format == "openai" and message.get("role") != "tool":
        return {**message, "content": [{"type": "text", "text": t} for t in texts]}
    return {**message, "content": "\n".join(texts)}


class LLM(GenerateRunner):
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
    among a hundred others, at some cost in speed.

    Every setting is a field of `EngineArgs` (`engine/engine_args.py`: the KV cache, scheduling, LoRA,
    the model's precision), passed by name; `LLM.from_engine_args(args)` takes a whole one."""

    def __new__(cls, model: str | None = None, **kwargs: Any) -> Any:
        """`runner="pooling"` (or "auto" on a classifier): vLLM's pooling runner, `engine/pooling.py`."""
        if cls is LLM and kwargs.get("_module") is None and pooling_wanted(model, kwargs):
            from pagedrl.engine.pooling import PoolingLLM

            return PoolingLLM(model, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: str | None = None, *, tokenizer: Any = None, _module: CausalLM | None = None,
                 _eos_token_ids: list[int] | None = None, **engine_args: Any) -> None:
        """`engine_args`: any field of `EngineArgs` by name (the signature lists them). `tokenizer`: a
        folder holding tokenizer.json (vLLM's `tokenizer=`), or a tokenizer object, in place of the model's."""
        args = self.engine_args = engine_args_from(model, engine_args)
        config = args.engine_config()
        config.validate()  # before a model is loaded (the engine checks it again, for its other callers)
        if args.enable_lora and _module is not None:
            raise ValueError("enable_lora: adapters per request need a model the engine owns (LLM(model, ...)); "
                             "a module training owns would have its projections replaced")
        owned = _module is None
        self.sampling_defaults: dict[str, Any] = {}
        if owned:
            from pagedrl.model.loader import load_model

            loaded = load_model(args.model, device=args.device, dtype=args.dtype, adapter=args.adapter,
                                revision=args.revision, quantization=args.quantization, activations=args.activations)
            _module, _eos_token_ids = loaded.model, loaded.eos_token_ids
            tokenizer = loaded.tokenizer if tokenizer is None else _tokenizer_from(tokenizer)
            defaults = generation_defaults(args.generation_config, loaded.generation_config,
                                           str(loaded.path / "generation_config.json"), args.override_generation_config)
            self.sampling_defaults = defaults.params
            if self.sampling_defaults:
                logger.info("pagedrl engine: default sampling parameters %s (generation_config='vllm' turns the "
                            "model's off)", defaults.describe())
            self.precision = loaded.precision
            logger.info("pagedrl engine: %s on %s", self.precision.describe(), _module.device)
        elif args.autocast_dtype is not None:
            self.precision = Precision(args.autocast_dtype, "autocast over "
                                       f"{str(_module.dtype).removeprefix('torch.')} weights, as the trainer computes")
        else:
            self.precision = Precision(_module.dtype, "the module's own")
        self.engine = LLMEngine(_module, tokenizer, config, eos_token_ids=_eos_token_ids)
        if owned:
            fp = footprint(_module.config, _module.dtype, self.engine.kv_dtype)
            logger.info("pagedrl engine: %s; %s", fp.describe(self.engine.weight_bytes), self.engine.kv_layout())
            logger.info("pagedrl engine: %s", self.engine.decode_path())
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, tokenizer: Any = None) -> LLM:
        """The engine `args` describe (vLLM's `LLMEngine.from_engine_args`)."""
        return cls(tokenizer=tokenizer, **{f.name: getattr(args, f.name) for f in fields(args)})

    @classmethod
    def from_module(cls, model: CausalLM, tokenizer: Any = None, eos_token_ids: list[int] | None = None,
                    **engine_args: Any) -> LLM:
        return cls(tokenizer=tokenizer, _module=model, _eos_token_ids=eos_token_ids, **engine_args)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's spelling of `tokenizer`)."""
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

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` samples with: SamplingParams' defaults, over which the model's
        generation_config.json recommends its own (vLLM's `generation_config="auto"`), or those of
        `generation_config`'s folder, with `override_generation_config` over them."""
        return SamplingParams(**self.sampling_defaults)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their blocks become plain free blocks)."""
        self.engine.kv_manager.reset_prefix_cache()

    def reseed(self, seed: int) -> None:
        """Restart the random stream of requests whose `SamplingParams` carry no seed."""
        self.engine.reseed(seed)

    def generate(self, prompts: Prompt | Mapping[str, Any] | Seq[Prompt | Mapping[str, Any]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. A prompt is text,
        token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` (with its `"cache_salt"`, if
        any). `lora_request`:
        one adapter for every prompt, or one (or None, the base) per prompt. A sample whose logits go NaN
        or infinite ends there with finish_reason "error" (its `error` says why, and a warning is logged),
        as vLLM marks it; the other prompts are not affected."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts, salts = zip(*[as_prompt(p, i) for i, p in enumerate(prompts)], strict=True) if prompts else ((), ())
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (Mapping, str)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
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
            for prompt, p, lora, salt in zip(prompts, params, loras, salts, strict=True):
                ids.append(self.engine.add_request(prompt, p, request_id=f"gen-{next(self._ids)}", lora_request=lora,
                                                   cache_salt=salt))
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

    def beam_search(self, prompts: Prompt | Mapping[str, Any] | Seq[Prompt | Mapping[str, Any]],
                    params: BeamSearchParams, use_tqdm: bool = False, concurrency_limit: int | None = None,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best beams of each prompt, best first
        (`engine/beam_search.py` says how they are found and ranked). Each sequence's `tokens` start
        with the prompt's and keep an ending EOS; its `text` is theirs, decoded. Every step is one
        `generate` call over every live beam of up to `concurrency_limit` prompts (None: all), whose
        shared prefixes the prefix cache keeps (with `enable_prefix_caching=False` every step recomputes
        each beam whole). A prompt dict's `cache_salt` holds for all its beams."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        check_logprobs_limit(params, self.engine.config.max_logprobs)
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive int or None, got {concurrency_limit!r}")
        instances = []
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
            text_or_ids, salt = as_prompt(prompt, i)
            ids = self.engine.encode(text_or_ids)
            instances.append(BeamSearchInstance(ids, params, self.engine.eos_token_ids, lora,
                                                self.max_model_len - len(ids), salt))
        sampling, limit = step_params(params), concurrency_limit or max(1, len(instances))
        for start in range(0, len(instances), limit):
            batch = instances[start:start + limit]
            for _ in tqdm(itertools.count(), desc="beam search", unit="token", disable=not use_tqdm):
                if not (beams := live_beams(batch)):
                    break
                advance_all(batch, self.generate([b.prompt() for b in beams], sampling, use_tqdm=False,
                                                 lora_request=[b.lora_request for b in beams]))
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return [BeamSearchOutput(sequences=inst.best(decode)) for inst in instances]

    def chat(self, messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Seq[Mapping[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation or a list of them, each rendered with the model's chat
        template (or `chat_template`, a template's name or text) with `tools`, then generated. A
        message's content may be a string or a list of text parts; `chat_template_content_format` (vLLM's:
        `auto`, `string`, `openai`) says which shape the template gets, `auto` detecting it from the
        template as the server's `--chat-template-content-format` does. `continue_final_message` (with
        `add_generation_prompt=False`) has the model go on writing the final message; `prompt`: the text."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]  # one conversation
        source = select_chat_template(self.tokenizer.chat_template, chat_template, tools)
        shape = content_format_for(source, chat_template_content_format)
        texts = [self.tokenizer.apply_chat_template(
            [_shaped_content(m, i, shape) for i, m in enumerate(conv)], add_generation_prompt=add_generation_prompt,
            tools=tools, chat_template=source, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {})) for conv in messages]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    @contextlib.contextmanager
    def batch_invariance_suspended(self) -> Iterator[None]:
        """Steps at full speed for a while, not batch-invariant: a trainer's greedy evaluations, whose
        numbers no trainer recomputes."""
        with batch_invariant.suspended(self.engine.runner.model):
            yield

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache memory until the next request (vLLM's sleep mode, level 1: the weights
        stay, since they are the trainer's own tensors or the model's only copy)."""
        if level != 1:
            raise ValueError(f"sleep: level {level} is not supported; level 1 frees the KV cache, the weights stay")
        self.engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate the KV cache again (`tags`: vLLM's; the weights never left, so only the cache is woken)."""
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


def _signature() -> inspect.Signature:
    """`LLM.__init__`'s signature as `help()` and editors show it: every EngineArgs field by name."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation="str | None"),
              inspect.Parameter("tokenizer", keyword, default=None, annotation="Any")]
    params += [inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
               for f in ordered_fields() if f.name != "model"]
    params += [inspect.Parameter("_module", keyword, default=None, annotation="CausalLM | None"),
               inspect.Parameter("_eos_token_ids", keyword, default=None, annotation="list[int] | None")]
    return inspect.Signature(params, return_annotation="None")


LLM.__init__.__signature__ = LLM.__new__.__signature__ = _signature()
