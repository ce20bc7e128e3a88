"""The HTTP API (FastAPI), on rank 0: OpenAI-style endpoints in front of the job queue.

    POST   /v1/images/generations   {prompt, n, size "WxH", seed, steps, guidance_scale, negative_prompt,
                                     response_format b64_json | url, lora, lora_scale, cache, cache_threshold}
    POST   /v1/videos               the same + frames or seconds, image (base64) -> a job; JSON, or multipart/form-data
                                    with the first frame as the file input_reference (OpenAI's SDK sends that)
    GET    /v1/videos               the video jobs still known, OpenAI's paged list (after, limit, order)
    GET    /v1/videos/{id}          status (queued, in_progress, completed, failed, cancelled), progress, step
    GET    /v1/videos/{id}/content  the MP4 (?index=i for sample i of n)
    DELETE /v1/videos/{id}          cancels a queued or running job
    POST   /v1/images/edits         image-to-video models: the image as the first frame, the prompt -> the last frame
    GET    /v1/files/{name}         a PNG / MP4 of a finished job (response_format=url)
    POST   /v1/loras {name, path[, path_2]}, GET /v1/loras, DELETE /v1/loras/{name}: run-time adapters (lora_dir)
    GET    /v1/models, GET /v1/stats, GET /metrics (Prometheus), GET /health (the only one without the key)

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

import asyncio
import base64
import binascii
import io
import math
import re
import secrets
import time
import typing
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringdit.errors import ConfigError
from ringdit.models.conditioning import text_conditioned
from ringdit.serve.adapters import AdapterError
from ringdit.serve.engine import AdapterInUse
from ringdit.serve.jobs import COMPLETED, FINISHED, Job, QueueFull, SampleRequest, ShuttingDown

MAX_IMAGE_BYTES = 20 * 2**20  # a first frame, base64-decoded
MAX_PROMPT = 4096  # characters: the text encoders cut far sooner
MAX_BODY_BYTES = 32 * 2**20  # a request's body: the largest first frame in base64 (4/3 of MAX_IMAGE_BYTES) fits
FILE_NAME = re.compile(r"job_[0-9a-f]{16}-[0-9]+\.(png|mp4)")  # a sample's file, as Rank0.write names it
SIZE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")  # ASCII digits only: "\uff18x\uff18" is not a size
CLASS_ID = re.compile(r"[0-9]{1,9}")  # a class-conditional prompt that is not a class name: ASCII digits only
INTEGER = re.compile(r"-?[0-9]{1,19}")  # a multipart field read as an integer
DECIMAL = re.compile(r"[-+]?([0-9]{1,30}(\.[0-9]{0,30})?|\.[0-9]{1,30})([eE][-+]?[0-9]{1,3})?")  # ... as a number
MAX_LIST = 100  # GET /v1/videos: jobs per page at most (OpenAI's bound)

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
    cache: Literal["none", "fbcache", "teacache"] | None = None
    cache_threshold: float | None = None


class VideoBody(ImageBody):
    frames: int | None = None
    seconds: Any = None                          # a positive number, or its text ("4", OpenAI's): frames at the fps
    image: str | None = None                     # base64 (or a data: URL) of the first frame
    input_reference: Any = None                  # the first frame as a multipart file (anything else is refused)


class EditBody(VideoBody):
    mask: Any = None                             # OpenAI's inpainting mask: refused


class LoraBody(Strict):

    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)
    path_2: str | None = Field(default=None, max_length=4096)  # a two-expert model's low-noise expert


NOT_JSON = ("the body is not valid JSON, or nested deeper than a JSON parser reads (send a JSON object with "
            "Content-Type: application/json)")


class BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is refused (413) before it is all read -- by its Content-Length,
    or while it streams in (chunked) --, so no request can make the server hold gigabytes."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            response = error(413, f"the body is larger than {self.limit // 2**20} MiB")
            return await response(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # FastAPI passes an HTTPException raised while reading the body on
                raise HTTPException(413)
            return message

        return await self.app(scope, counted, send)


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "param": param, "type": kind}}, status_code=status)


def create_app(server) -> FastAPI:
    """The app over ``server`` (``ringdit.serve.Server``: its settings, spec, queue, engine and control)."""
    settings = server.settings
    app = FastAPI(title="ringdit", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if settings.api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), settings.api_key.encode()):
                response = error(401, "a valid API key is needed: Authorization: Bearer <key>", kind="auth_error")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await call_next(request)

    @app.middleware("http")
    async def count(request: Request, call_next):
        """Every answer counted by route (its template: one series per endpoint, not per job id) and status."""
        response = await call_next(request)
        metrics = getattr(server, "metrics", None)
        if metrics is not None:
            metrics.requests.labels(route_of(request), str(response.status_code)).inc()
        return response

    def route_of(request: Request) -> str:
        """The route's template, also for an answer made before routing (a 401): one series per endpoint."""
        from starlette.routing import Match

        route = request.scope.get("route")
        if route is None:
            route = next((r for r in app.router.routes if r.matches(request.scope)[0] == Match.FULL), None)
        return getattr(route, "path", "unmatched")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(400, NOT_JSON)
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if param is None:  # the body itself: empty, an array, a string, or sent as another content type
            return error(400, f"the body must be a JSON object sent with Content-Type: application/json ({message})")
        return error(400, f"{param}: {message}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's and FastAPI's own answers (no such endpoint, a method not allowed, a body the parser gave up
        on -- e.g. nested too deep for it --, one too large) in the API's shape, their headers kept (Allow)."""
        status = exc.status_code
        message = {400: NOT_JSON, 404: f"no endpoint {request.url.path} (see docs/serving.md)",
                   405: f"{request.method} is not allowed on {request.url.path}",
                   413: f"the body is larger than {MAX_BODY_BYTES // 2**20} MiB"}.get(status, str(exc.detail))
        response = error(status, message, kind="invalid_request_error" if status < 500 else "server_error")
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        return error(exc.status, exc.message, exc.param)

    @app.get("/health")
    async def health():
        state = server.state
        return JSONResponse({"status": state, "waiting": server.queue.waiting},
                            status_code=200 if state == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "ringdit",
                                            "created": int(server.started), "kind": server.kind}]}

    @app.get("/v1/stats")
    async def stats():
        engine = server.engine
        return {"batches": engine.batches, "model_evaluations": engine.evaluations, "samples": engine.samples,
                "cache_reused": engine.cache_reused, "waiting": server.queue.waiting}

    @app.get("/metrics")
    async def metrics():
        content, media_type = server.metrics.render()
        return Response(content, media_type=media_type)

    @app.post("/v1/images/generations")
    async def images(body: ImageBody, request: Request):
        if server.kind != "image":
            raise BadRequest("model", "this model generates videos: POST /v1/videos")
        ignored = unknown_fields(body, "/v1/images/generations")
        job = submit(body, "image")
        return warned(await image_answer(job, body, request), ignored)

    @app.post("/v1/images/edits", openapi_extra=json_body(EditBody))
    async def edits(request: Request):
        """An image-to-video model edits an image as a video model can: the image is the first frame of a video
        sampled for the prompt, and the video's last frame is the answer (as video-based editors such as ChronoEdit
        use Wan's image-to-video). The video's length is ``frames`` / ``seconds`` (default: the model's)."""
        body, uploads = await read_body(request, EditBody, files=("image", "mask"))
        if server.image_kind is None:
            other = "POST /v1/videos" if server.kind == "video" else "POST /v1/images/generations"
            raise BadRequest("model", f"this model takes no reference image (it is not image-to-video): {other} "
                                      f"without one")
        if "mask" in uploads or body.mask is not None:
            raise BadRequest("mask", REFUSED["mask"])
        if body.input_reference is not None:
            raise BadRequest("input_reference", "POST /v1/images/edits takes the image as image (a file, or base64)")
        ignored = unknown_fields(body, "/v1/images/edits")
        job = submit(body, "video", reference=("image", uploads.get("image")), last_frame=True)
        return warned(await image_answer(job, body, request), ignored)

    @app.post("/v1/videos", openapi_extra=json_body(VideoBody))
    async def videos(request: Request):
        body, uploads = await read_body(request, VideoBody, files=("input_reference",))
        if server.kind != "video":
            raise BadRequest("model", "this model generates images: POST /v1/images/generations")
        if "response_format" in body.model_fields_set:  # inherited from images; a video is a job, not a reply
            raise BadRequest("response_format", "a video is a job: leave response_format out and fetch the MP4 from "
                                                "GET /v1/videos/{id}/content once it is completed")
        if body.input_reference is not None:  # a JSON value, or a form's text: OpenAI's {image_url} / {file_id}
            raise BadRequest("input_reference", "input_reference is the first frame as an uploaded file (a "
                                                "multipart/form-data request: OpenAI's SDK sends one for "
                                                "input_reference=open(path, 'rb')); nothing is fetched from a URL or "
                                                "a file id; in JSON, give the image as base64 in image")
        ignored = unknown_fields(body, "/v1/videos")
        job = submit(body, "video", reference=("input_reference", uploads.get("input_reference")))
        return warned(JSONResponse(job.describe()), ignored)

    @app.get("/v1/videos")
    async def list_videos(after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "desc"):
        """OpenAI's paged list: the video jobs still known (the newest ``keep_files`` finished ones and every
        unfinished one), newest first by default; the next page starts ``after`` the last id of this one."""
        bounded("limit", limit, 1, MAX_LIST)
        jobs = [job for job in server.queue.jobs() if job.is_video]
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise BadRequest("after", f"after={after[:100]!r} is not a video job this server still knows (the "
                                          f"oldest finished ones are forgotten past keep_files); list from the start",
                                 status=404)
            jobs = jobs[ids.index(after) + 1:]
        page = jobs[:limit]
        return {"object": "list", "data": [job.describe() for job in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": len(jobs) > limit}

    @app.get("/v1/videos/{job_id}")
    async def video(job_id: str):
        return known(job_id).describe()

    @app.get("/v1/videos/{job_id}/content")
    async def content(job_id: str, index: int = 0, variant: Literal["video"] = "video"):
        # variant: OpenAI's thumbnail and spritesheet are not made (a 400 naming variant)
        job = known(job_id)
        if job.status != COMPLETED:
            raise BadRequest("id", f"job {job_id} is {job.status}, not completed", status=409)
        if not 0 <= index < len(job.files):
            raise BadRequest("index", f"index={index}: the job has samples 0..{len(job.files) - 1}")
        return FileResponse(job.files[index], media_type=media_type(job.files[index].name))

    @app.delete("/v1/videos/{job_id}")
    async def cancel(job_id: str):
        known(job_id)
        return server.queue.cancel(job_id).describe()

    @app.get("/v1/files/{name}")
    async def files(name: str):
        # only names the server writes (Rank0.write): nothing else in files/ or beyond it can be asked for
        if FILE_NAME.fullmatch(name) is None or not (server.files_dir / name).is_file():
            raise BadRequest("name", f"no file {name[:200]!r}", status=404)
        return FileResponse(server.files_dir / name, media_type=media_type(name))

    @app.get("/v1/loras")
    async def loras():
        adapters = server.engine.adapters
        return {"object": "list", "data": [a.describe() for a in adapters.loaded.values()] if adapters else []}

    @app.post("/v1/loras")
    async def load_lora(body: LoraBody):
        adapters = ready_adapters()
        paths = [body.path] + ([body.path_2] if body.path_2 else [])
        try:
            adapter = await asyncio.to_thread(adapters.read, settings.lora_dir, body.name, paths)
            command = {"op": "lora_add", "adapter": (adapter.name, list(adapter.files), adapter.layers)}
            return await ask(command)
        except AdapterError as problem:
            raise BadRequest(str(problem).split(":")[0].split("=")[0], str(problem)) from None
        except AdapterInUse as busy:  # replacing it would change what accepted jobs sample
            raise BadRequest("name", str(busy), status=409) from None

    @app.delete("/v1/loras/{name}")
    async def unload_lora(name: str):
        """409 while unfinished jobs name it: a job the server accepted is sampled as accepted (an unload never
        fails someone else's request); the caller learns which jobs hold it and retries, or cancels them."""
        adapters = ready_adapters()
        if name not in adapters.loaded:
            raise BadRequest("name", f"no adapter {name!r} is loaded", status=404)
        try:
            await ask({"op": "lora_remove", "name": name})
        except AdapterInUse as busy:
            raise BadRequest("name", str(busy), status=409) from None
        return {"name": name, "deleted": True}

    # ---- helpers --------------------------------------------------------------------------------------------------
    async def ask(command: dict):
        """A LoRA command run by every rank between batches (503 if the sampling loop no longer takes commands)."""
        if server.state != "ok":
            raise BadRequest(None, f"the server is {server.state}", status=503)
        try:
            return await asyncio.to_thread(server.control.ask, command, settings.request_timeout_s)
        except TimeoutError:
            raise BadRequest(None, f"the sampling ranks did not take the command within request_timeout_s="
                                   f"{settings.request_timeout_s:g} seconds", status=503) from None

    def ready_adapters():
        if server.engine.adapters is None:
            raise BadRequest("model", "the model is still loading", status=503)
        return server.engine.adapters

    def known(job_id: str) -> Job:
        job = server.queue.get(job_id)
        if job is None:
            raise BadRequest("id", f"no job {job_id!r}", status=404)
        return job

    def submit(body: ImageBody, kind: str, reference: tuple[str, bytes | None] = ("image", None),
               last_frame: bool = False) -> Job:
        if server.state != "ok":
            raise BadRequest(None, f"the server is {server.state}", status=503)
        request = sample_request(body, kind, server, reference=reference, last_frame=last_frame)
        try:
            return server.queue.submit(Job(request))
        except QueueFull as full:
            raise BadRequest(None, str(full), status=429) from None
        except ShuttingDown as down:
            raise BadRequest(None, str(down), status=503) from None

    async def image_answer(job: Job, body: ImageBody, request: Request):
        """OpenAI's images answer once ``job`` is done: each PNG as base64, or its URL."""
        await finished(job, server.queue, settings.request_timeout_s)
        if job.status != COMPLETED:
            return error(job.error_code if job.error_code >= 400 else 500, job.error or job.status, kind="job_error")
        data = []
        for file in job.files:
            if body.response_format == "url":
                data.append({"url": str(request.base_url) + f"v1/files/{file.name}"})
            else:
                data.append({"b64_json": base64.b64encode(file.read_bytes()).decode()})
        return JSONResponse({"created": int(job.created), "data": data, "id": job.id, "seed": job.request.seed})

    return app


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


async def finished(job: Job, queue, timeout: float) -> None:
    """Wait for the job without holding a thread (the sampling loop finishes it); past ``timeout`` it is cancelled
    (out of the queue if it still waits, so it takes no place there)."""
    deadline = time.monotonic() + timeout
    while job.status not in FINISHED:
        if time.monotonic() > deadline:
            job.finish("failed", f"the job took longer than request_timeout_s={timeout:g} seconds", code=504)
            queue.cancel(job.id)
            return
        await asyncio.sleep(0.02)


def sample_request(body: ImageBody, kind: str, server, reference: tuple[str, bytes | None] = ("image", None),
                   last_frame: bool = False) -> SampleRequest:
    """``body`` checked against the model and the server's bounds (``BadRequest`` naming the field); ``reference``:
    (its field, the uploaded first frame or None)."""
    settings, spec = server.settings, server.spec
    bounded("n", body.n, 1, settings.max_n)
    steps = spec.sampling["steps"] if body.steps is None else body.steps
    bounded("steps", steps, 1, settings.max_steps)
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise BadRequest("seed", f"seed={body.seed} must be in [0, 2^63)")
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    cfg_scale = spec.sampling["cfg_scale"] if body.guidance_scale is None else body.guidance_scale
    if not (0 <= cfg_scale <= 100):
        raise BadRequest("guidance_scale", f"guidance_scale={body.guidance_scale} must be in [0, 100]")
    if body.model is not None and body.model != server.model_name:
        raise BadRequest("model", f"model={body.model!r}: this server serves {server.model_name!r} (GET /v1/models)")
    default_size, default_frames = spec.sizes.user_size(spec.shape)
    size = parse_size(body.size) if body.size is not None else tuple(default_size)
    frames = getattr(body, "frames", None)
    fps = spec.output.fps
    if kind == "video":
        most = settings.max_frames or default_frames
        seconds = getattr(body, "seconds", None)
        if seconds is not None:
            timed = frames_for(seconds, fps, spec.sizes, most)
            if frames is not None and frames != timed:
                raise BadRequest("seconds", f"seconds={seconds} is {timed} frames at {fps} fps, but frames={frames}: "
                                            f"give one of seconds and frames")
            frames = timed
        frames = default_frames if frames is None else frames
        bounded("frames", frames, 1, most)
    if size[0] * size[1] > (settings.max_pixels or default_size[0] * default_size[1]):
        raise BadRequest("size", f"size={body.size}: {size[0] * size[1]} pixels, more than the "
                                 f"{settings.max_pixels or default_size[0] * default_size[1]} this server allows "
                                 f"(max_pixels)")
    try:
        shape = spec.sizes.shape(list(size), frames, names=("size", "frames"))
    except ConfigError as problem:
        text = str(problem)
        raise BadRequest("frames" if text.startswith("frames") else "size", text) from None
    prompt = body.prompt
    if not text_conditioned(spec.data):
        from ringdit.sampling import resolve_labels

        names = [str(name) for name in spec.data.get("class_names") or []]
        if prompt not in names and CLASS_ID.fullmatch(prompt) is None:  # int() would take " 3", "\uff13", "+3"
            raise BadRequest("prompt", f"this model is class-conditional: the prompt is a class id in ASCII digits or "
                                       f"one of the class names {names[:20]}; got {prompt[:100]!r}")
        try:
            resolve_labels([prompt], 1, spec.data)
        except ValueError as problem:
            raise BadRequest("prompt", f"this model is class-conditional: the prompt is a class id or name; "
                                       f"{problem}") from None
        if body.negative_prompt:
            raise BadRequest("negative_prompt", "a class-conditional model takes no negative prompt")
    if not -10 <= body.lora_scale <= 10:
        raise BadRequest("lora_scale", f"lora_scale={body.lora_scale} must be in [-10, 10]")
    if body.lora is None and "lora_scale" in body.model_fields_set:
        raise BadRequest("lora_scale", "lora_scale is the strength of the adapter named by lora; give lora too")
    lora = None
    if body.lora is not None:
        adapters = server.engine.adapters
        if adapters is None or body.lora not in adapters.loaded:
            raise BadRequest("lora", f"lora={body.lora!r} is not loaded (POST /v1/loras first; GET /v1/loras lists "
                                     f"them)")
        lora = body.lora
    cache = None
    if body.cache_threshold is not None and (body.cache == "none" or body.cache is None and not spec.cache.enabled):
        raise BadRequest("cache_threshold", "cache_threshold applies to a step cache; give cache=fbcache (or teacache) "
                                            "too")
    if body.cache is None and spec.cache.enabled:  # the server's own cache= setting (its threshold the default)
        threshold = spec.cache.threshold if body.cache_threshold is None else body.cache_threshold
        cache = (spec.cache.kind, float(threshold))
    elif body.cache not in (None, "none"):
        if body.cache not in server.rank0.cache_settings:
            raise BadRequest("cache", f"cache={body.cache} is not available for this model (its TeaCache polynomial "
                                      f"is unknown: calibrate one, or use fbcache)")
        threshold = 0.1 if body.cache_threshold is None else body.cache_threshold
        cache = (body.cache, float(threshold))
    if body.cache_threshold is not None and not 0 <= body.cache_threshold <= 10:
        raise BadRequest("cache_threshold", f"cache_threshold={body.cache_threshold} must be in [0, 10]")
    field, upload = reference
    given = getattr(body, "image", None)
    if upload is not None and given is not None:
        raise BadRequest(field, f"the first frame is given twice: as {field} and as image; give one")
    image = first_frame(upload, server, size, field) if upload is not None else first_frame(given, server, size)
    return SampleRequest(kind=kind, prompt=prompt, n=body.n, seed=seed, shape=tuple(shape), size=size,
                         frames=frames, steps=steps, cfg_scale=float(cfg_scale),
                         negative_prompt=body.negative_prompt or None, lora=lora,
                         lora_scale=float(body.lora_scale), cache=cache, image=image, last_frame=last_frame,
                         fps=fps if kind == "video" else None, model=server.model_name)


def parse_seconds(value) -> float:
    """``seconds``: a positive finite number, or its text in ASCII ("4", "2.5": OpenAI's SDK sends text)."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and DECIMAL.fullmatch(value.strip()):
        number = float(value)
    if number is None or not (math.isfinite(number) and number > 0):
        raise BadRequest("seconds", f"seconds={str(value)[:100]!r} is not a positive number of seconds, e.g. \"4\" "
                                    f"or 2.5")
    return number


def frames_for(value, fps: int | None, sizes, most: int) -> int:
    """``seconds`` as video frames at ``fps`` (the MP4's rate): the nearest frame count the model takes (Wan: 1 + 4k,
    so 4 s at 16 fps is 65 frames, 4.06 s), ties to the longer; a ``BadRequest`` naming seconds past ``most``."""
    seconds = parse_seconds(value)
    if not fps:
        raise BadRequest("seconds", "this model's videos have no frame rate: give frames instead of seconds")
    target = seconds * fps
    step = sizes.temporal * (sizes.patch[0] if len(sizes.patch) == 3 else 1) * max(sizes.frame_pad, 1)
    if target > most + step:  # before searching: seconds=1e300 is not a loop of 1e300 tries
        raise BadRequest("seconds", f"seconds={value}: {math.ceil(target)} frames at {fps} fps, more than the {most} "
                                    f"this server makes (max_frames): at most {most / fps:.4g} seconds")
    valid = []
    for frames in range(max(1, math.floor(target) - step), min(math.ceil(target) + step, most) + 1):
        try:
            sizes.shape(None, frames)
            valid.append(frames)
        except ConfigError:
            continue
    if not valid:
        raise BadRequest("seconds", f"seconds={value}: no frame count the model takes is near {target:.4g} frames "
                                    f"({fps} fps) within max_frames={most}; give frames")
    return min(valid, key=lambda frames: (abs(frames - target), -frames))


def media_type(name: str) -> str:
    return "video/mp4" if name.endswith(".mp4") else "image/png"


def bounded(param: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise BadRequest(param, f"{param}={value} must be in [{low}, {high}]")


def parse_size(size: str) -> tuple[int, int]:
    """OpenAI's ``"WxH"`` -> (H, W)."""
    match = SIZE.fullmatch(size)
    if match is None or not all(0 < int(part) <= 65536 for part in match.groups()):
        raise BadRequest("size", f"size={size!r} is not WIDTHxHEIGHT in pixels (ASCII digits), e.g. \"832x480\"")
    width, height = (int(part) for part in match.groups())
    return height, width


def first_frame(data: str | bytes | None, server, size: tuple[int, int], field: str = "image"):
    """The first frame of an image-to-video request -- base64 text (``image``), or the bytes of an uploaded file
    (``field``) -- as an upright RGB PIL image of the samples' ratio."""
    from PIL import Image, ImageOps

    needs = server.image_kind is not None
    if data is None:
        if needs:
            raise BadRequest(field, f"this model is image-to-video: give the first frame as base64 in image (or upload "
                                    f"it as the file {'input_reference' if field == 'image' else field})")
        return None
    if not needs:
        raise BadRequest(field, "this model takes no image (it is not image-to-video)")
    if isinstance(data, str):
        if data.startswith("data:"):
            data = data.partition(",")[2]
        if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise BadRequest(field, f"{field}: more than {MAX_IMAGE_BYTES // 2**20} MiB")
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(field, f"{field} is not base64") from None
    try:
        with Image.open(io.BytesIO(data)) as opened:
            picture = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception as problem:  # noqa: BLE001 - Pillow's many failures (a decompression bomb included)
        raise BadRequest(field, f"{field} is not a readable image ({type(problem).__name__}); give a PNG, JPEG or "
                                f"WebP file") from None
    height, width = size
    if abs(picture.width * height - picture.height * width) >= max(height, width):
        raise BadRequest(field, f"{field} is {picture.width}x{picture.height} but the samples are {width}x{height}: "
                                f"crop it to that aspect ratio (nothing is cropped for you)")
    return picture
