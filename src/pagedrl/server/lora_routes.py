"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's endpoints, bodies and answers.

Loading reads and checks the adapter off the event loop (an adapter that does not fit is a 400 naming
what does not fit; a path that is not there a 404) and serves it from the next request on, without a
restart. Unloading stops new requests from naming it; the running ones finish with it.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from pagedrl.engine.multi_lora import AdapterNotFound
from pagedrl.server.errors import ApiError, read_json
from pagedrl.server.openapi import errors, request_body
from pagedrl.server.protocol import NonEmptyStr, OpenAIBase
from pagedrl.server.served_models import LoRAModule, ServedModels


class LoadLoRAAdapterRequest(OpenAIBase):
    lora_name: NonEmptyStr
    lora_path: NonEmptyStr
    load_inplace: bool = False  # replace an adapter already served under this name


class UnloadLoRAAdapterRequest(OpenAIBase):
    lora_name: NonEmptyStr
    lora_int_id: int | None = None


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
        lora = served.adapters.get(req.lora_name)
        if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
            raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "not_found_error",
                           param="lora_name")
        served.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
