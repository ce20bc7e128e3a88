"""The request bodies of the HTTP API (``ringdit.serve.api``): their models, and how a JSON or multipart body is
read into them.

Every request is data: it is validated field by field (400 with ``{"error": {"message", "param", "type"}}`` naming
the field and its bound); nothing in it is executed, and no path in it reaches outside ``lora_dir`` / the run's
``files/``. Types are strict (JSON's own: ``true`` is not a number, ``"4"`` is not an integer, sizes are ASCII
digits), and every answer that is not a success -- a body that is not JSON, one over ``MAX_BODY_BYTES``, an unknown
endpoint -- is in that one shape. Multipart form fields are text: they are read as the JSON field's type (ASCII digits
for an integer) and then held to the same checks.

Unknown fields: OpenAI's API refuses a parameter it does not know, and so does this one (a misspelt ``step`` is a 400
naming it, not a setting silently dropped). Parameters OpenAI's API defines for the endpoint that ringdit has no use
for (``quality``, ``style``, ``output_format``, ``user`` ...: ``OPENAI_IGNORED``) are ignored and named in the
``X-Ringdit-Ignored-Fields`` and ``Warning`` headers; the few whose meaning cannot be ignored (``stream=true``, an
edit's ``mask``) are refused.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_IMAGE_BYTES = 20 * 2**20  # a first frame, base64-decoded
MAX_PROMPT = 4096  # characters: the text encoders cut far sooner
MAX_BODY_BYTES = 32 * 2**20  # a request's body: the largest first frame in base64 (4/3 of MAX_IMAGE_BYTES) fits
INTEGER = re.compile(r"-?[0-9]{1,19}")  # a multipart field read as an integer
DECIMAL = re.compile(r"[-+]?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})([eE][-+]?[0-9]{1,3})?")  # ... as a number
MAX_ADAPTERS = 8  # adapters stacked on one request (each adds a low-rank term to every layer it adapts)

# OpenAI's parameters of each endpoint that ringdit has no use for: ignored, named in the answer's headers. Anything
# else unknown is refused, as OpenAI refuses it (``stream`` is ignored only while it is false; see ``REFUSED``).
OPENAI_IGNORED = {
    "/v1/images/generations": {"quality", "style", "background", "moderation", "output_compression",
                               "output_format", "partial_images", "stream", "user"},
    "/v1/images/edits": {"quality", "background", "input_fidelity", "output_compression", "output_format",
                         "partial_images", "stream", "user"},
    "/v1/videos": set(),  # OpenAI's create takes prompt, model, seconds, size, input_reference: all used
}
REFUSED = {
    "stream": "streaming answers (stream=true) are not supported; leave stream out, or false",
    "mask": "masked edits (inpainting) are not supported: leave mask out; the image is the video's first frame",
}


class BadRequest(Exception):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


class Strict(BaseModel):
    """JSON's types as they are: no bool taken for a number, no string for a number, no number for a string; text
    that is not Unicode (a lone surrogate escape, which Python's JSON parser lets through) refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _unicode(cls, value, info):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("is not valid Unicode text (it holds a lone surrogate escape)") from None
        return value


class LoraChoice(Strict):
    """One adapter of a request's ``loras``: a resident adapter's name and its strength."""

    name: str = Field(min_length=1, max_length=128)
    scale: float = 1.0


class ImageBody(Strict):
    """Unknown fields are kept aside (``model_extra``) for ``unknown_fields`` to ignore or refuse by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str = Field(max_length=MAX_PROMPT)
    model: str | None = Field(default=None, max_length=256)
    n: int = 1
    size: str | None = Field(default=None, max_length=32)  # "WxH" (OpenAI's order); null: the model's default
    seed: int | None = None                      # null: a random one (returned in the job)
    steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT)
    response_format: Literal["b64_json", "url"] = "b64_json"
    lora: str | None = Field(default=None, max_length=128)
    lora_scale: float = 1.0
    loras: list[LoraChoice] | None = Field(default=None, min_length=1, max_length=MAX_ADAPTERS)  # several, stacked
    cache: Literal["none", "fbcache", "teacache"] | None = None
    cache_threshold: float | None = None


class VideoBody(ImageBody):
    frames: int | None = None
    seconds: Any = None                          # a positive number, or its text ("4", OpenAI's): frames at the fps
    image: str | None = None                     # base64 (or a data: URL) of the first frame
    input_reference: Any = None                  # the first frame as a multipart file (anything else is refused)
    control: str | None = None                   # base64 (or a data: URL) of a control-video model's clip (Wan VACE)


class EditBody(VideoBody):
    mask: Any = None                             # OpenAI's inpainting mask: refused


class LoraBody(Strict):

    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)
    path_2: str | None = Field(default=None, max_length=4096)  # a two-expert model's low-noise expert


def json_body(model: type[BaseModel]) -> dict:
    """The OpenAPI description of an endpoint that reads its body itself (JSON, or multipart/form-data)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def read_body(request: Request, model: type[ImageBody], files: tuple[str, ...]):
    """The body as ``model`` and its uploaded files (field -> bytes): a JSON object, or multipart/form-data whose
    text fields are read as the JSON fields' types and whose files may only be ``files``."""
    uploads: dict[str, bytes] = {}
    try:
        if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            data, uploads = await form_fields(request, model, files)
            return model.model_validate(data), uploads
        return model.model_validate_json(await request.body()), uploads
    except ValidationError as problem:  # as FastAPI reports a body it validated: the invalid() handler names it
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in problem.errors()]) from None


async def form_fields(request: Request, model: type[ImageBody], files: tuple[str, ...]):
    from starlette.datastructures import UploadFile

    try:
        form = await request.form(max_files=len(files), max_fields=64, max_part_size=MAX_BODY_BYTES)
    except StarletteHTTPException as problem:
        if problem.status_code != 400:
            raise  # 413: the BodyLimit
        raise BadRequest(None, f"the multipart/form-data body cannot be read ({problem.detail}); at most "
                               f"{len(files)} file(s): {', '.join(files)}") from None
    data, uploads = {}, {}
    for key in dict.fromkeys(form.keys()):
        values = form.getlist(key)
        name = key.removesuffix("[]")  # OpenAI's SDK sends a list as image[]
        base = name.partition("[")[0]  # and an object as input_reference[image_url]
        if len(values) > 1 or name in data or name in uploads:
            raise BadRequest(name, f"{name} is given {len(values)} times; give it once")
        value = values[0]
        if base in files and (name != base or isinstance(value, str)):
            data[base] = value  # text (a URL, a file id): refused by its endpoint, by name
            continue
        if isinstance(value, UploadFile):
            if name not in files:
                raise BadRequest(name, f"{name} is a file; the files this endpoint takes: {', '.join(files)}")
            raw = await value.read(MAX_IMAGE_BYTES + 1)
            if len(raw) > MAX_IMAGE_BYTES:
                raise BadRequest(name, f"{name}: more than {MAX_IMAGE_BYTES // 2**20} MiB")
            uploads[name] = raw
            continue
        data[name] = form_value(name, value, model)
    return data, uploads


def form_value(name: str, text: str, model: type[ImageBody]):
    """A multipart field's text as its JSON field's type: ASCII digits for an integer, a decimal for a number."""
    field = model.model_fields.get(name)
    types = typing.get_args(field.annotation) or (field.annotation,) if field is not None else (str,)
    if any(typing.get_origin(kind) is list for kind in types):  # loras: a form field holds it as JSON text
        try:
            return json.loads(text)
        except ValueError:
            raise BadRequest(name, f"{name}={text[:100]!r} is not JSON; in a form give it as JSON text, e.g. "
                                   f"[{{\"name\": \"fox\", \"scale\": 0.8}}]") from None
    if float in types:
        if DECIMAL.fullmatch(text) is None:
            raise BadRequest(name, f"{name}={text[:100]!r} is not a number")
        return float(text)
    if int in types:
        if INTEGER.fullmatch(text) is None:
            raise BadRequest(name, f"{name}={text[:100]!r} is not an integer (ASCII digits)")
        return int(text)
    return text


def unknown_fields(body: ImageBody, endpoint: str) -> list[str]:
    """The fields of ``body`` the endpoint does not know: OpenAI's that ringdit ignores (returned, for the headers);
    any other is a 400 naming it."""
    ignored = []
    for name, value in (body.model_extra or {}).items():
        if name == "stream" and value not in (False, "false", None):
            raise BadRequest(name, REFUSED["stream"])
        if name not in OPENAI_IGNORED[endpoint]:
            raise BadRequest(name[:200], f"{name[:200]}: not a field of POST {endpoint} (misspelt?); its fields are "
                                         f"{', '.join(sorted(type(body).model_fields))}")
        ignored.append(name)
    return ignored


def warned(response: Response, ignored: list[str]) -> Response:
    """``response`` with the OpenAI fields it ignored named in its headers (they are ASCII: ``OPENAI_IGNORED``)."""
    if ignored and response.status_code < 400:
        names = ", ".join(ignored)
        response.headers["X-Ringdit-Ignored-Fields"] = names
        response.headers["Warning"] = f'299 ringdit "ignored OpenAI fields ringdit has no use for: {names}"'
    return response
