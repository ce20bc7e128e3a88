"""The HTTP API (FastAPI), on rank 0: OpenAI-style endpoints in front of the job queue.

    POST   /v1/images/generations   {prompt, n, size "WxH", seed, steps, guidance_scale, negative_prompt,
                                     response_format b64_json | url, lora, lora_scale | loras [{name, scale}],
                                     cache, cache_threshold}
    POST   /v1/videos               the same + frames or seconds, image (base64) -> a job; JSON, or multipart/form-data
                                    with the first frame as the file input_reference (OpenAI's SDK sends that);
                                    control (base64, or a file): a control-video model's clip (Wan VACE)
    GET    /v1/videos               the video jobs still known, OpenAI's paged list (after, limit, order)
    GET    /v1/videos/{id}          status (queued, in_progress, completed, failed, cancelled), progress, step
    GET    /v1/videos/{id}/content  the MP4 (?index=i for sample i of n)
    DELETE /v1/videos/{id}          cancels a queued or running job
    POST   /v1/images/edits         image-to-video models: the image as the first frame, the prompt -> the last frame
    GET    /v1/files/{name}         a PNG / MP4 of a finished job (response_format=url)
    POST   /v1/loras {name, path[, path_2]}, GET /v1/loras, DELETE /v1/loras/{name}: run-time adapters (lora_dir)
    GET    /v1/models, GET /v1/stats, GET /metrics (Prometheus), GET /health (the only one without the key)

Requests are read and refused as ``ringdit.serve.bodies`` describes, and checked against the model by
``ringdit.serve.validate``.
"""

from __future__ import annotations

import asyncio
import base64
import re
import secrets
import time
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringdit.serve.adapters import AdapterError
from ringdit.serve.bodies import (MAX_BODY_BYTES, REFUSED, BadRequest, EditBody, ImageBody, LoraBody, VideoBody,
                                  json_body, read_body, unknown_fields, warned)
from ringdit.serve.engine import AdapterInUse
from ringdit.serve.jobs import COMPLETED, FINISHED, Job, QueueFull, ShuttingDown
from ringdit.serve.validate import bounded, sample_request

FILE_NAME = re.compile(r"job_[0-9a-f]{16}-[0-9]+\.(png|mp4)")  # a sample's file, as Rank0.write names it
MAX_LIST = 100  # GET /v1/videos: jobs per page at most (OpenAI's bound)

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
        use Wan's image-to-video). The video's length is ``frames`` / ``seconds`` (default: the model's). An edit model
        (Qwen-Image-Edit) samples an image with the image as its reference."""
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
        video = server.kind == "video"  # an image-to-video model answers with its video's last frame
        job = submit(body, "video" if video else "image", reference=("image", uploads.get("image")), last_frame=video)
        return warned(await image_answer(job, body, request), ignored)

    @app.post("/v1/videos", openapi_extra=json_body(VideoBody))
    async def videos(request: Request):
        body, uploads = await read_body(request, VideoBody, files=("input_reference", "control"))
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
        job = submit(body, "video", reference=("input_reference", uploads.get("input_reference")),
                     control=uploads.get("control"))
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
               last_frame: bool = False, control: bytes | None = None) -> Job:
        if server.state != "ok":
            raise BadRequest(None, f"the server is {server.state}", status=503)
        request = sample_request(body, kind, server, reference=reference, last_frame=last_frame, control=control)
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


def media_type(name: str) -> str:
    return "video/mp4" if name.endswith(".mp4") else "image/png"

