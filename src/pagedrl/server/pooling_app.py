"""`pagedrl serve REWARD_FOLDER --runner pooling`: the pooling runner (`engine/pooling.py`) over HTTP, in
vLLM's shapes (`server/pooling_protocol.py`): `POST /classify` (ClassificationRequest / ClassificationResponse)
and `POST /pooling` (the raw reward of every token, or its `task`'s output, PoolingResponse), each taking
vLLM's PoolingParams fields, `/v1/models`, `/health`, `/version`. The generating routes
answer 400 in vLLM's words ("The model does not support Completions API"), naming the runner.

One request's prompts run as one batch (split by max_num_seqs and max_num_batched_tokens) on a worker
thread, one request at a time, so the event loop keeps answering while a batch runs."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

import pagedrl
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.pooling import PoolingLLM
from pagedrl.engine.pooling_outputs import PoolingRequestOutput
from pagedrl.server.delivery import json_response
from pagedrl.server.errors import ApiError, bad_request, from_value_error, install_error_handlers, read_json
from pagedrl.server.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingParamsFields,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    encoded_data,
)
from pagedrl.server.request_ids import base_request_id
from pagedrl.server.response_bodies import ModelCard, ModelList, UsageInfo, VersionResponse
from pagedrl.server.served_models import LoRAModule, ServedModels, parse_lora_module

logger = logging.getLogger("pagedrl.server")
# vLLM's answers on a server whose model does not generate, with the runner named
# how the runner's errors name a prompt (`engine/pooling.py` `encode_prompts`): "prompts[2]: ..."
PROMPT_ITEM = "prompts["
NOT_GENERATING = {"completions": "Completions API", "chat/completions": "Chat Completions API",
                  "responses": "Responses API"}


def label_of(id2label: dict, index: int) -> str | None:
    """A class's name in a config's id2label (transformers writes its keys as strings)."""
    return id2label.get(str(index), id2label.get(index))


def request_error(e: ValueError) -> ApiError:
    """The runner's ValueError as a 400 naming the body's field: a prompt's problem (empty, a token outside
    the vocabulary, longer than max_model_len) names `input` and the item, the task `task`, the adapter
    `model`."""
    message = str(e)
    if message.startswith(PROMPT_ITEM):
        message = "input" + message[len("prompts"):]
        return bad_request(message, param="input",
                           code="context_length_exceeded" if "max_model_len" in message else None)
    return from_value_error(e, {"pooling_task": "task", "lora_request": "model"})


def usage_of(outputs: Sequence[PoolingRequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)


def build_pooling_app(llm: PoolingLLM, *, served_model_name: str | Sequence[str], model_root: str | None = None,
                      api_key: str | None = None, max_request_body_bytes: int = 8 << 20,
                      lora_modules: Sequence[LoRAModule] = ()) -> FastAPI:
    """The app over `llm`; with `api_key`, every route but /health, /ping and /version asks for it. On an `llm`
    built with `enable_lora`, each of `lora_modules` (SEQ_CLS adapters) is served under its name, which a
    request's `model` picks (one that does not fit raises ValueError here: its config and tensor shapes are
    checked, and each is folded when a request first names it)."""
    served = ServedModels(served_model_name, read=llm.adapters.check_fits if llm.adapters is not None else None)
    for module in lora_modules:
        served.load(module)
    if llm.adapters is not None and len(lora_modules) > llm.adapters.capacity:
        logger.warning("%d --lora-modules and %d folded copies kept (max(max_loras, max_cpu_loras)): requests that "
                       "go from one adapter to another fold them again, each a full model's work",
                       len(lora_modules), llm.adapters.capacity)
    app = FastAPI(title="pagedrl (pooling)")
    app.state.served = served
    busy = asyncio.Lock()  # one request at a time: the runner and its adapters' copies hold no lock of their own

    install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def run(prompts: Any, task: str, fields: PoolingParamsFields, lora: LoRARequest | None) -> list:
        try:
            params = fields.to_pooling_params()
            async with busy:
                return await asyncio.to_thread(llm.encode, prompts, params, pooling_task=task, use_tqdm=False,
                                               lora_request=lora)
        except ValueError as e:
            raise request_error(e) from None

    guarded = APIRouter(dependencies=[Depends(check_api_key)])

    @guarded.get("/v1/models", response_model=ModelList)
    async def models() -> Response:
        bases = [ModelCard(id=name, root=model_root, max_model_len=llm.max_model_len) for name in served.base_names]
        adapters = [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or served.base_name,
                              max_model_len=llm.max_model_len) for lora in served.adapters.values()]
        return json_response(ModelList(data=[*bases, *adapters]))

    @guarded.post("/classify", response_model=ClassificationResponse)
    async def classify(request: Request) -> Response:
        req = await read_json(request, ClassificationRequest, max_request_body_bytes)
        lora = served.resolve(req.model)
        if req.input == "" or (isinstance(req.input, list) and "" in req.input):
            raise bad_request("Input cannot be empty for classification", param="input")
        outputs = await run(req.input, "classify", req, lora) if req.input else []
        id2label = llm.id2label(lora) if outputs else {}  # once a request, from memory
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=label_of(id2label, best), probs=probs,
                                           num_classes=len(probs)))
        return json_response(ClassificationResponse(id=f"classify-{base_request_id(request, None)}",
                                                    model=req.model or served.base_name, data=data,
                                                    usage=usage_of(outputs)))

    @guarded.post("/pooling", response_model=PoolingResponse)
    async def pooling(request: Request) -> Response:
        req = await read_json(request, PoolingRequest, max_request_body_bytes)
        lora = served.resolve(req.model)
        if not req.input:
            raise bad_request("Input cannot be empty", param="input")
        outputs = await run(req.input, "token_classify" if req.task is None else req.task, req, lora)
        data = [PoolingResponseData(index=i, data=encoded_data(out.outputs.data, req.encoding_format, req.endianness))
                for i, out in enumerate(outputs)]
        return json_response(PoolingResponse(id=f"pool-{base_request_id(request, None)}",
                                             model=req.model or served.base_name, data=data,
                                             usage=usage_of(outputs)))

    def refuse(api: str) -> Any:
        async def refused() -> Response:
            raise bad_request(f"The model does not support {api} (it is served with --runner pooling: POST /classify "
                              "or /pooling)")
        return refused

    for route, api in NOT_GENERATING.items():
        guarded.add_api_route(f"/v1/{route}", refuse(api), methods=["POST"], include_in_schema=False)
    app.include_router(guarded)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        return json_response(VersionResponse(version=pagedrl.__version__))

    return app


def build_pooling_server(args: argparse.Namespace, engine_args: Any) -> Any:
    """The uvicorn server of `pagedrl serve --runner pooling` (or a classifier's folder on "auto")."""
    import uvicorn

    from pagedrl.engine.pooling import PoolingLLM
    from pagedrl.server.serve import uvicorn_options

    # Without --enable-lora the flag (or $VLLM_ALLOW_RUNTIME_LORA_UPDATING, its default) serves nothing, as on
    # the generating server; with it, the adapters are the start-up ones only
    if args.allow_runtime_lora_updating and engine_args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating: the pooling runner serves the adapters named at start-up "
                         "(--lora-modules); /v1/load_lora_adapter is not served")
    llm = PoolingLLM(**vars(engine_args))
    names = args.served_model_name or [args.adapter or args.model]
    app = build_pooling_app(llm, served_model_name=names, model_root=str(args.adapter or args.model),
                            api_key=args.api_key or None, max_request_body_bytes=args.max_request_body_bytes,
                            lora_modules=[parse_lora_module(m) for m in args.lora_modules])
    logger.info("serving %s with the pooling runner: POST /classify and /pooling (max_model_len %d)", names[0],
                llm.max_model_len)
    return uvicorn.Server(uvicorn.Config(app, **uvicorn_options(args)))
