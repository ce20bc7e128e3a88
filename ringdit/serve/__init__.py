"""``python -m ringdit.serve``: an HTTP image and video API over the ring / Ulysses / CFG-parallel ranks.

    python -m ringdit.serve ckpt_path=outputs/train/runs/<run>/checkpoints/last.ckpt            # one process
    torchrun --nproc-per-node 8 -m ringdit.serve ckpt_path=<run>/last.ckpt ring_degree=4 ulysses_degree=2 \\
        api_key=$KEY host=0.0.0.0 lora_dir=loras/
    python -m ringdit.serve ckpt_path=<LoRA run>/last.ckpt base=Wan2.1-T2V-14B-Diffusers trainer.devices=2 ring_degree=2

How it fits together: the model is what infer.py would sample (``InferSpec``: a checkpoint, an export, or an
adapter-only LoRA run on its base). Rank 0 serves HTTP (``ringdit.serve.api``, FastAPI + uvicorn in a thread) and
queues jobs (``ringdit.serve.jobs``); its main thread and every other rank run one endless ``trainer.predict``
(``ringdit.serve.engine``) whose batches are rank 0's broadcast commands, so the models stay resident. SIGTERM
drains: the running batch finishes, waiting and new requests get 503, exit code 0. A rank that dies makes every
request answer 503 and the server exit with code 1 within seconds.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import types
from pathlib import Path

from omegaconf import DictConfig

from ringdit import _settings_of  # the package's parent: loaded (whole) before any of its modules
from ringdit.caching import CacheSettings
from ringdit.commands.cli import register_resolvers
from ringdit.commands.task import Task, command, run_task
from ringdit.common.atomic import atomic_write
from ringdit.common.errors import ConfigError
from ringdit.models.conditioning import text_conditioned
from ringdit.sampling.decoding import spec_codecs
from ringdit.serve.engine import Commands, Control, Engine, Rank0, ServingModule
from ringdit.serve.jobs import JobQueue
from ringdit.serve.metrics import Metrics
from ringdit.serve.server_settings import ServeSettings
from ringdit.spec import InferSpec
from ringdit.spec.control import control_family
from ringdit.spec.infer import image_kind
from ringdit.spec.model import kind_name
from ringdit.training.callbacks import LoadLoraAdapter
from ringdit.training.parallel_strategy import build_strategy

log = logging.getLogger("ringdit.serve")

FAILED_EXIT_CODE = 1
SERVING = "serving"  # what a SIGTERM before the server is up stops (after: it drains)


class Server:
    """One serving process's state (every rank makes one; only rank 0 listens)."""

    def __init__(self, cfg: DictConfig):
        self.settings = ServeSettings.from_config(cfg)
        self.spec = spec = InferSpec.from_config(cfg)
        check_servable(spec)
        self.started = time.time()
        self.state = "loading"  # loading -> ok -> draining | failed
        self.kind = "video" if len(spec.shape) == 3 else "image"
        self.model_name = kind_name(spec.model.config)

        self.image_kind = image_kind(spec.model.config)
        self.control_family = control_family(spec.model.config)  # a control-video model's: requests give a clip
        self.files_dir = Path(spec.output_dir) / "files"
        self.http = None
        self.trainer = self.module = self.engine = self.queue = self.control = self.rank0 = self.metrics = None

    def build(self) -> None:
        """The trainer and module (as infer.py builds them), the engine, and on rank 0 the queue and encoders."""
        import hydra

        spec, settings = self.spec, self.settings
        callbacks = [LoadLoraAdapter(spec.ckpt_path, spec.weights)] if spec.lora is not None else []
        self.trainer = hydra.utils.instantiate(spec.trainer.config, strategy=build_strategy(
            spec.trainer.config["strategy"], spec.layout), callbacks=callbacks, logger=False, enable_progress_bar=False)

        self.metrics = Metrics(self)
        self.queue = JobQueue(settings.queue_size, settings.max_batch, settings.batch_wait_s, keep=settings.keep_files,
                              metrics=self.metrics)
        self.control = Control(wake=self.queue.wake)
        if self.trainer.global_rank == 0:
            self.rank0 = self._rank0()
        self.engine = Engine(spec, self.queue, self.control, self.rank0)
        self.module = ServingModule(spec, self.engine, self.rank0.codecs if self.rank0 is not None else None)

    def _rank0(self):
        import torch

        spec = self.spec
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # the text encoder, the VAE (check_servable: both known where the model needs them), LTX-2's audio decoder
        codecs = spec_codecs(spec, device)
        caches = {"fbcache": CacheSettings(kind="fbcache", threshold=0.1)}
        if spec.cache.kind == "teacache" and spec.cache.coefficients:  # resolved for this model by the spec
            caches["teacache"] = spec.cache
        self.files_dir.mkdir(parents=True, exist_ok=True)
        return Rank0(spec, self.files_dir, self.settings.request_timeout_s, codecs, cache_settings=caches)

    # ---- running ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until drained (0) or a rank fails (``FAILED_EXIT_CODE``)."""
        from torch.utils.data import DataLoader

        rank0 = self.trainer.global_rank == 0
        if rank0:
            self._listen()
            threading.Thread(target=self._when_ready, daemon=True).start()
        try:
            self.trainer.predict(self.module, dataloaders=DataLoader(Commands(self.engine), batch_size=None),
                                 return_predictions=False)
        except BaseException as error:  # noqa: BLE001 - a rank died (or a bug): answer 503 and leave, never hang
            return self._failed(error)
        finally:
            if rank0:
                time.sleep(0.2)  # the last results reach the requests that wait for them
                self._close_http()
        if rank0:
            log.info("drained: every accepted job finished; exiting")
        return 0

    def drain(self) -> None:
        """SIGTERM: no new jobs (503), the waiting ones fail with 503, the running batch finishes, then exit 0."""
        if self.state in ("draining", "failed"):
            return
        self.state = "draining"
        log.warning("SIGTERM: draining (the running batch finishes; new requests get 503)")
        self.queue.close("the server is shutting down")
        self.control.stop_requested = True

    def _failed(self, error: BaseException) -> int:
        reason = f"a sampling rank failed ({type(error).__name__}: {str(error).strip()[:200]})"
        self.state = "failed"
        if self.queue is not None:
            self.queue.fail_all(reason + "; the server is exiting")
        log.error("%s; exiting with code %d", reason, FAILED_EXIT_CODE)
        time.sleep(2.0)  # requests waiting on their jobs, and health checks, get their 503
        return FAILED_EXIT_CODE

    def _when_ready(self) -> None:
        self.engine.is_ready.wait()
        if self.state == "loading":
            self.state = "ok"
            log.info("ready: %s on %d rank(s)", self.model_name, self.trainer.world_size)

    def _listen(self) -> None:
        import uvicorn

        # optional dependency: fastapi and uvicorn (ringdit[serve])
        from ringdit.serve.api import create_app

        config = uvicorn.Config(create_app(self), host=self.settings.host, port=self.settings.port,
                                log_level="warning", access_log=False)
        self.http = uvicorn.Server(config)
        thread = threading.Thread(target=self.http.run, name="http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.http.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise SystemExit(f"cannot listen on {self.settings.host}:{self.settings.port} (in use?); pick another "
                                 f"port=")
            time.sleep(0.01)
        port = self.http.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.settings.host}:{port}"

        with atomic_write(Path(self.spec.output_dir) / "server.json") as tmp:
            Path(tmp).write_text(json.dumps({"url": self.url, "pid": os.getpid()}))
        log.info("listening on %s (the model is loading; GET /health says when it is ready)", self.url)
        self._http_thread = thread

    def _close_http(self) -> None:
        if self.http is not None:
            self.http.should_exit = True
            self._http_thread.join(timeout=10)


def check_servable(spec) -> None:
    """What the server needs beyond infer.py's checks, refused before anything starts."""
    layout = spec.layout
    if layout.dp_degree > (2 if layout.cfg_parallel else 1):
        raise ConfigError(f"dp_degree={layout.dp_degree}: a server samples one batch at a time on all its ranks "
                          f"(sequence-parallel, and CFG-parallel with cfg_parallel=true and dp_degree=2); run one "
                          f"server per group of ranks behind a load balancer")
    if "latent_scale" in spec.data and not spec.output.vae:
        raise ConfigError(f"ckpt_path={spec.ckpt_path} samples latents, and no VAE folder is known to decode them "
                          f"into images and videos; give vae=<the VAE folder the data was prepared with>")

    family = control_family(spec.model.config)
    if family is not None and "vae" not in spec.data:  # a request's clip could not be encoded as the data's were
        raise ConfigError(f"ckpt_path={spec.ckpt_path} is a control-video model (model.family={family.name}) trained "
                          f"on data that record no VAE (latents made without one, as data=synthetic_text_latents "
                          f"makes), so a request's control clip cannot be encoded as its control latents were; "
                          f"serve a model trained on data prepared with python -m ringdit.prepare vae=<folder> "
                          f"control=<folder>")
    if text_conditioned(spec.data) and not spec.conditioning.text_encoder:
        raise ConfigError(f"ckpt_path={spec.ckpt_path} is text-conditioned and no text encoder is known to encode "
                          f"the requests' prompts; give text_encoder=<the folder the data was encoded with>")


def serve_task(cfg: DictConfig, task: Task) -> int:
    """Check, build and run the server of ``cfg`` (``conf/serve.yaml``); its exit code."""
    server = Server(cfg)
    task.claim(server.spec.output_dir)
    server.build()
    # SIGTERM: rank 0 drains; the other ranks (torchrun signals every rank) wait for its stop
    task.start(trainer=server.trainer, drain=lambda: server.drain() if server.trainer.global_rank == 0 else None)
    return server.run()


def serve(cfg: DictConfig) -> int:
    """Check, build and run the server of ``cfg`` (``conf/serve.yaml``); its exit code. The Python API of
    ``python -m ringdit.serve``: a mistake in the settings raises ``ringdit.common.errors.ConfigError``."""
    return run_task(serve_task, cfg, name="serve", doing=SERVING, one_line=False)


def main(argv: list[str] | None = None) -> None:
    """``python -m ringdit.serve`` on ``argv`` (default ``sys.argv[1:]``)."""
    _command(argv)


@command("serve", doing=SERVING)
def _run_command(cfg: DictConfig, task: Task) -> int:
    code = serve_task(cfg, task)
    if code:  # a rank is gone: the process group cannot be torn down, and nothing is left to finish
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _command(argv):
    register_resolvers()
    return _run_command(argv)


class _CallablePackage(types.ModuleType):
    """This package, callable as the Python API's ``ringdit.serve(cfg)``: importing ``ringdit.serve`` (or any of its
    modules) makes the package ``ringdit``'s attribute ``serve`` in place of that function -- Python's import system
    sets every loaded submodule on its parent -- so the package answers the call as the function would: the
    settings checked to be ``ringdit.config("serve", ...)``'s, then served."""

    def __call__(self, cfg) -> int:
        return serve(_settings_of(cfg, "serve"))


sys.modules[__name__].__class__ = _CallablePackage
