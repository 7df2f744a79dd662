"""The pooling server's bodies, in vLLM's shapes: ClassificationRequest / ClassificationResponse for
`POST /classify`, PoolingRequest / PoolingResponse for `POST /pooling`; each request's PoolingParams
(`engine/pooling_params.py`), and /pooling's `encoding_format`.

`encoding_format: "base64"` is vLLM's: the pooled tensor as float32, flattened row-major (a reward's
[tokens, labels] becomes tokens x labels numbers), its bytes in the server's byte order (`endianness`
"native", the default; "little" or "big" to fix it), base64-encoded. A client reads it back with
`numpy.frombuffer(base64.b64decode(data), "<f4").reshape(-1, num_labels)` on a little-endian server."""

from __future__ import annotations

import base64
import sys
from dataclasses import fields
from typing import Literal

import torch
from pydantic import Field

from pagedrl.engine.pooling_params import PoolingParams
from pagedrl.server.protocol import OpenAIBase
from pagedrl.server.response_bodies import UsageInfo, now_s


class PoolingParamsFields(OpenAIBase):
    """vLLM's PoolingParams fields that both bodies hold (vLLM's ClassificationRequest has no `dimensions` or
    `normalize`: sent to /classify they are ignored, as any field it does not know)."""

    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    activation: bool | None = None  # vLLM's older spellings of use_activation, read before it
    softmax: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        """The body's PoolingParams fields as the runner takes them (`engine/pooling_params.py`), which checks
        them for the request's task: one body's fields then name the same problems as an offline call's."""
        names = {f.name for f in fields(PoolingParams)}
        return PoolingParams(**{name: getattr(self, name) for name in type(self).model_fields if name in names})


class ClassificationRequest(PoolingParamsFields):
    model: str | None = None
    input: list[str] | str
    user: str | None = None


class ClassificationData(OpenAIBase):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class PooledList(OpenAIBase):
    """The envelope /classify and /pooling share (vLLM's field order); each route types `data`."""

    id: str
    object: str = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list
    usage: UsageInfo


class ClassificationResponse(PooledList):
    data: list[ClassificationData]


class PoolingRequest(PoolingParamsFields):
    # vLLM's PoolingRequest holds an embedding model's fields too: read so they are refused by name
    dimensions: int | None = None
    normalize: bool | None = None
    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str]
    # vLLM's pooling task; unset: the reward of every token ("token_classify")
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32"] = "float32"  # vLLM's default; its narrower types are not sent
    endianness: Literal["native", "little", "big"] = "native"
    user: str | None = None


class PoolingResponseData(OpenAIBase):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(PooledList):
    data: list[PoolingResponseData]


def encoded_data(data: torch.Tensor, encoding_format: str, endianness: str = "native") -> list | str:
    """A pooled tensor as /pooling sends it: nested lists of floats, or vLLM's base64 (see above)."""
    if encoding_format == "float":
        return data.tolist()
    array = data.detach().to("cpu", torch.float32).flatten().contiguous().numpy()
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return base64.b64encode(array.tobytes()).decode("ascii")
