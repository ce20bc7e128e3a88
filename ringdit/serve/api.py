"""The HTTP API (FastAPI), on rank 0: OpenAI-style endpoints in front of the job queue.

    POST   /v1/images/generations   {prompt, n, size "WxH", seed, steps, guidance_scale, negative_prompt,
                                     response_format b64_json | url, lora, lora_scale, cache, cache_threshold}
    POST   /v1/videos               the same + frames, image (base64, image-to-video) -> a job
    GET    /v1/videos/{id}          status (queued, in_progress, completed, failed, cancelled), progress, step
    GET    /v1/videos/{id}/content  the MP4 (?index=i for sample i of n)
    DELETE /v1/videos/{id}          cancels a queued or running job
    GET    /v1/files/{name}         a PNG / MP4 of a finished job (response_format=url)
    POST   /v1/loras {name, path[, path_2]}, GET /v1/loras, DELETE /v1/loras/{name}: run-time adapters (lora_dir)
    GET    /v1/models, GET /v1/stats, GET /health (the only one without the key)

Every request is data: it is validated field by field (400 with ``{"error": {"message", "param", "type"}}`` naming
the field and its bound); nothing in it is executed, and no path in it reaches outside ``lora_dir`` / the run's
``files/``. Types are strict (JSON's own: ``true`` is not a number, ``"4"`` is not an integer, sizes are ASCII
digits), and every answer that is not a success -- a body that is not JSON, one over ``MAX_BODY_BYTES``, an unknown
endpoint -- is in that one shape.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import secrets
import time
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringdit.errors import ConfigError
from ringdit.serve.adapters import AdapterError
from ringdit.serve.engine import AdapterInUse
from ringdit.serve.jobs import COMPLETED, FINISHED, Job, QueueFull, SampleRequest, ShuttingDown

MAX_IMAGE_BYTES = 20 * 2**20  # a first frame, base64-decoded
MAX_PROMPT = 4096  # characters: the text encoders cut far sooner
MAX_BODY_BYTES = 32 * 2**20  # a request's body: the largest first frame in base64 (4/3 of MAX_IMAGE_BYTES) fits
FILE_NAME = re.compile(r"job_[0-9a-f]{16}-[0-9]+\.(png|mp4)")  # a sample's file, as Rank0.write names it
SIZE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")  # ASCII digits only: "\uff18x\uff18" is not a size
CLASS_ID = re.compile(r"[0-9]{1,9}")  # a class-conditional prompt that is not a class name: ASCII digits only


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
    image: str | None = None                     # base64 (or a data: URL) of the first frame


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

    @app.post("/v1/images/generations")
    async def images(body: ImageBody, request: Request):
        if server.kind != "image":
            raise BadRequest("model", "this model generates videos: POST /v1/videos")
        job = submit(body, "image")
        await finished(job, server.queue, settings.request_timeout_s)
        if job.status != COMPLETED:
            return error(job.error_code if job.error_code >= 400 else 500, job.error or job.status, kind="job_error")
        data = []
        for file in job.files:
            if body.response_format == "url":
                data.append({"url": str(request.base_url) + f"v1/files/{file.name}"})
            else:
                data.append({"b64_json": base64.b64encode(file.read_bytes()).decode()})
        return {"created": int(job.created), "data": data, "id": job.id, "seed": job.request.seed}

    @app.post("/v1/videos")
    async def videos(body: VideoBody):
        if server.kind != "video":
            raise BadRequest("model", "this model generates images: POST /v1/images/generations")
        if "response_format" in body.model_fields_set:  # inherited from images; a video is a job, not a reply
            raise BadRequest("response_format", "a video is a job: leave response_format out and fetch the MP4 from "
                                                "GET /v1/videos/{id}/content once it is completed")
        return submit(body, "video").describe()

    @app.get("/v1/videos/{job_id}")
    async def video(job_id: str):
        return known(job_id).describe()

    @app.get("/v1/videos/{job_id}/content")
    async def content(job_id: str, index: int = 0):
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

    def submit(body: ImageBody, kind: str) -> Job:
        if server.state != "ok":
            raise BadRequest(None, f"the server is {server.state}", status=503)
        request = sample_request(body, kind, server)
        try:
            return server.queue.submit(Job(request))
        except QueueFull as full:
            raise BadRequest(None, str(full), status=429) from None
        except ShuttingDown as down:
            raise BadRequest(None, str(down), status=503) from None

    return app


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


def sample_request(body: ImageBody, kind: str, server) -> SampleRequest:
    """``body`` checked against the model and the server's bounds (``BadRequest`` naming the field)."""
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
    if kind == "video":
        frames = default_frames if frames is None else frames
        bounded("frames", frames, 1, settings.max_frames or default_frames)
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
    if spec.data.get("conditioning") != "text":
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
    image = first_frame(getattr(body, "image", None), server, size)
    return SampleRequest(kind=kind, prompt=prompt, n=body.n, seed=seed, shape=tuple(shape), size=size,
                         frames=frames, steps=steps, cfg_scale=float(cfg_scale),
                         negative_prompt=body.negative_prompt or None, lora=lora,
                         lora_scale=float(body.lora_scale), cache=cache, image=image)


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


def first_frame(data: str | None, server, size: tuple[int, int]):
    """The base64 first frame of an image-to-video request as an upright RGB PIL image of the samples' ratio."""
    from PIL import Image, ImageOps

    needs = server.image_kind is not None
    if data is None:
        if needs:
            raise BadRequest("image", "this model is image-to-video: give the first frame as base64 in image")
        return None
    if not needs:
        raise BadRequest("image", "this model takes no image (it is not image-to-video)")
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest("image", f"image: more than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as opened:
            picture = ImageOps.exif_transpose(opened).convert("RGB")
    except (binascii.Error, ValueError):
        raise BadRequest("image", "image is not base64") from None
    except Exception as problem:  # noqa: BLE001 - Pillow's many failures (a decompression bomb included)
        raise BadRequest("image", f"image is not a readable image ({type(problem).__name__})") from None
    height, width = size
    if abs(picture.width * height - picture.height * width) >= max(height, width):
        raise BadRequest("image", f"image is {picture.width}x{picture.height} but the samples are {width}x{height}: "
                                  f"crop it to that aspect ratio (nothing is cropped for you)")
    return picture
