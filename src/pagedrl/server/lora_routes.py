"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's endpoints, bodies and answers.

Loading reads and checks the adapter off the event loop (an adapter that does not fit is a 400 naming
what does not fit; a path that is not there a 404) and serves it from the next request on, without a
restart. Unloading stops new requests from naming it; the running ones finish with it. An adapter is
unloaded by its name, its id (`lora_int_id`, as vLLM's body has it) or both, which must then agree.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import ConfigDict, Field

from pagedrl.engine.multi_lora import AdapterNotFound
from pagedrl.server.errors import ApiError, read_json
from pagedrl.server.openapi import errors, request_body
from pagedrl.server.protocol import INTEGRAL, NonEmptyStr, OpenAIBase
from pagedrl.server.served_models import (
    ADAPTER_NAME_PATTERN,
    MAX_ADAPTER_NAME_CHARS,
    LoRAModule,
    ServedModels,
)

AdapterName = Annotated[str, Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS, pattern=ADAPTER_NAME_PATTERN)]


class LoadLoRAAdapterRequest(OpenAIBase):
    lora_name: AdapterName
    lora_path: NonEmptyStr
    load_inplace: bool = False  # replace an adapter already served under this name


class UnloadLoRAAdapterRequest(OpenAIBase):
    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["lora_name"]}, {"required": ["lora_int_id"]}]})
    lora_name: NonEmptyStr | None = None
    lora_int_id: Annotated[int, INTEGRAL] | None = None


def adapter_to_unload(served: ServedModels, req: UnloadLoRAAdapterRequest) -> str:
    """The name of the adapter `req` names; 400 if it names none, 404 if none served fits."""
    if req.lora_name is None and req.lora_int_id is None:
        raise ApiError(400, "give lora_name or lora_int_id (or both)", param="lora_name")
    if req.lora_name is not None:
        lora = served.adapters.get(req.lora_name)
        if lora is not None and req.lora_int_id in (None, lora.lora_int_id):
            return req.lora_name
        raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "not_found_error",
                       param="lora_name")
    name = next((n for n, lora in served.adapters.items() if lora.lora_int_id == req.lora_int_id), None)
    if name is None:
        raise ApiError(404, f"No lora adapter with lora_int_id {req.lora_int_id} is loaded.", "not_found_error",
                       param="lora_int_id")
    return name


def lora_router(served: ServedModels, max_request_body_bytes: int) -> APIRouter:
    router = APIRouter()
    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}

    @router.post("/load_lora_adapter", response_model=None, openapi_extra=request_body(LoadLoRAAdapterRequest),
                 responses={200: {"description": "The adapter is served", **text}, **errors(400, 401, 404, 413)})
    async def load_lora_adapter(request: Request) -> Response:
        req = await read_json(request, LoadLoRAAdapterRequest, max_request_body_bytes)
        if req.lora_name in served.adapters and not req.load_inplace:
            raise ApiError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
        try:
            lora = served.new_request(LoRAModule(req.lora_name, req.lora_path))
        except ValueError as e:  # the name: the base model's, or not a name
            raise ApiError(400, str(e), param="lora_name") from None
        try:
            await asyncio.to_thread(served.read, lora)
        except AdapterNotFound as e:
            raise ApiError(404, str(e), "not_found_error", param="lora_path") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_path") from None
        if req.lora_name in served.adapters and not req.load_inplace:  # loaded by another request meanwhile
            raise ApiError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
        served.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter", response_model=None, openapi_extra=request_body(UnloadLoRAAdapterRequest),
                 responses={200: {"description": "The adapter is no longer served", **text}, **errors(400, 401, 404, 413)})
    async def unload_lora_adapter(request: Request) -> Response:
        req = await read_json(request, UnloadLoRAAdapterRequest, max_request_body_bytes)
        name = adapter_to_unload(served, req)
        served.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
