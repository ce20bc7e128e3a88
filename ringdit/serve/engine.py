"""The sampling side of the server: every rank runs one ``trainer.predict`` over an endless stream of commands.

Rank 0's main thread takes the next batch of jobs from the ``JobQueue``, turns it into a command (prompts encoded,
first frames encoded, seeds drawn: ``Commands``) and broadcasts it to every rank; each rank's ``ServingModule`` (the
Lightning shell infer.py samples in: no training module) carries it out with the same ``Sampler`` infer.py samples
with, so a request's samples equal infer.py's for the same seed. Lightning sets up the ranks, the sequence-parallel
layout, FSDP and the precision once; the models stay resident between requests.

- When nothing is waiting, rank 0 broadcasts a tick every ``TICK_S``: the ranks' collectives never wait long enough
  to time out, and a rank that died is found within seconds (the broadcast fails; the server then answers 503 and
  exits non-zero).
- Before every model forward the ranks agree (one all-reduce of one number) whether every job of the batch was
  cancelled; if so they drop the batch together at that step.
- Run-time LoRA adapters (``ringdit.serve.adapters``) are loaded by a command too, so every rank holds the same ones;
  a batch samples with its requests' adapters stacked at their strengths, taken off again when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from ringdit.caching import CacheSettings, StepCache
from ringdit.media.image_condition import first_frame_inputs
from ringdit.media.control_pixels import encode_control, encode_reference
from ringdit.models.conditioning import CONTROL_KEY, REFERENCE_KEY, text_conditioned
from ringdit.common.seeding import Stream, seed_of
from ringdit.sampling import resolve_labels
from ringdit.serve.adapters import Adapter, Adapters
from ringdit.serve.jobs import CANCELLED, COMPLETED, FAILED, Job, JobQueue
from ringdit.spec.control import control_family
from ringdit.spec.infer import image_kind
from ringdit.sampling.predict import SamplingModule
from ringdit.sampling.sampler import Codecs, Sampler
from ringdit.sampling.writer import write_sample

log = logging.getLogger("ringdit.serve")

TICK_S = 1.0  # the longest a rank waits for rank 0 without hearing from it


class Cancelled(Exception):
    """Every job of the running batch was cancelled: the ranks stop sampling it, together."""


class AdapterInUse(Exception):
    """Unloading (``DELETE /v1/loras/<name>``) or replacing (``POST /v1/loras`` with its name) an adapter while
    unfinished jobs name it: refused (409), nothing changed."""

    def __init__(self, name: str, job_ids: list[str]):
        shown = ", ".join(job_ids[:10]) + (f" and {len(job_ids) - 10} more" if len(job_ids) > 10 else "")
        super().__init__(f"adapter {name!r} is named by {len(job_ids)} unfinished job(s) ({shown}); unload or replace "
                         f"it when they have finished, or cancel them first (DELETE /v1/videos/<id>)")
        self.name, self.job_ids = name, job_ids


class Control:
    """What rank 0 asks of the sampling loop besides jobs: run-time LoRA commands and the stop."""

    def __init__(self, wake=lambda: None):
        self._lock = threading.Lock()
        self._commands: list[tuple[dict, threading.Event, list]] = []
        self.stop_requested = False
        self.wake = wake  # the job queue's: the sampling loop takes the command now, not after its wait for a job

    def ask(self, command: dict, timeout: float) -> object:
        """Run ``command`` on every rank at the loop's next turn; its answer (or the error it raised)."""
        done, answer = threading.Event(), []
        with self._lock:
            self._commands.append((command, done, answer))
        self.wake()
        if not done.wait(timeout):
            raise TimeoutError("the sampling ranks did not take the command in time")
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def take(self) -> tuple[dict, threading.Event, list] | None:
        """The oldest command not yet taken (one per turn of the loop: each gets its own answer)."""
        with self._lock:
            return self._commands.pop(0) if self._commands else None


class Commands(IterableDataset):
    """The stream every rank's prediction loop reads: rank 0 makes each command, every rank receives it by
    broadcast. Ends when rank 0 says stop. Has a length (a very large one) so that Lightning's loop asks for the next
    command only after running the last (without a length it would fetch one ahead and hold a batch back until the
    next request came)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __len__(self) -> int:
        return 2**62

    def __iter__(self):
        while True:
            command = self.engine.next_command()
            if command["op"] == "stop":
                return
            if command["op"] != "tick":
                yield command


class ServingModule(SamplingModule):
    """infer.py's ``SamplingModule`` whose prediction steps carry out ``engine``'s commands."""

    def __init__(self, spec, engine: Engine, codecs: Codecs | None = None):
        # rank 0's codecs (Rank0's): its sampler encodes the prompts and decodes the latents; the others' none
        super().__init__(spec, codecs=codecs or Codecs())
        self.engine = engine

    def on_predict_start(self) -> None:
        super().on_predict_start()  # the sampler
        self.engine.ready(self)

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        return batch  # a command: generate moves its tensors; adapters are moved when they become resident

    def predict_step(self, command: dict, batch_idx: int = 0):
        return self.engine.run(self, command)


class Engine:
    """Runs on every rank. Rank 0 also holds the queue, the encoders and the decoder (``Rank0``)."""

    def __init__(self, spec, queue: JobQueue | None, control: Control | None, rank0=None):
        self.spec, self.queue, self.control, self.rank0 = spec, queue, control, rank0
        self.adapters: Adapters | None = None
        self.sampler: Sampler | None = None  # the module's, once it is ready
        self.batches = self.evaluations = self.samples = 0
        self.cache_reused = 0  # model evaluations whose blocks the step cache skipped
        self.failure: str | None = None
        self.is_ready = threading.Event()
        self._running: list[Job] = []
        self._pending_control = None

    def ready(self, module: ServingModule) -> None:
        """The model is built, on its device, with its weights: requests may come."""
        self.adapters = Adapters(module.model, module.device)
        self.sampler = module.sampler
        self.is_ready.set()

    # ---- the stream (collective) -----------------------------------------------------------------------------------
    def next_command(self) -> dict:
        """The next command on every rank: made on rank 0 (jobs, LoRA commands, a tick, the stop), broadcast."""
        command = self._make_command() if self._is_rank0 else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [command]
            dist.broadcast_object_list(box, src=0)
            command = box[0]
        return command

    @property
    def _is_rank0(self) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def _make_command(self) -> dict:
        taken = self.control.take()
        if taken is not None:
            command, done, answer = taken
            name = command["name"] if command["op"] == "lora_remove" else command["adapter"][0]
            if (command["op"] == "lora_remove" or name in self.adapters.loaded) and (users := self.queue.naming(name)):
                # an unload, or a replacement, of an adapter that accepted jobs name: refused. Rank 0's loop alone
                # decides, between batches: no job that names the adapter can start after this check and before the
                # removal (a job the HTTP side accepts meanwhile fails in ``unloaded`` below)
                answer.append(AdapterInUse(name, [job.id for job in users]))
                done.set()
                return {"op": "tick"}
            self._pending_control = (done, answer)
            return {**command, "reply": True}
        if self.control.stop_requested and not self._running:
            return {"op": "stop"}
        jobs = self.queue.next_batch(timeout=TICK_S)
        jobs = [job for job in jobs if not job.cancel_requested]
        if not jobs:
            return {"op": "tick"}
        if self.unloaded(jobs):
            return {"op": "tick"}
        try:
            return self.rank0.sample_command(jobs, self.sampler)
        except ValueError as error:  # a prompt / image the encoders refuse: those jobs fail, the server goes on
            for job in jobs:
                job.finish(FAILED, str(error), code=400)
            return {"op": "tick"}

    def unloaded(self, jobs: list[Job]) -> bool:
        """Whether the batch names an adapter no longer resident (unloaded between the request's check and its turn):
        its jobs fail alone (409) -- sampling it would fail on every rank, and with them the server."""
        # one key: one adapter stack for the whole batch
        gone = [name for name in jobs[0].request.adapter_names if name not in self.adapters.loaded]
        if not gone:
            return False
        name = gone[0]
        for job in jobs:
            job.finish(FAILED, f"lora={name!r} was unloaded before this job ran; load it again (POST /v1/loras) and "
                               f"resend the request", code=409)
        return True

    # ---- carrying a command out (every rank) -----------------------------------------------------------------------
    def run(self, module: ServingModule, command: dict):
        op = command["op"]
        if op == "sample":
            return self._sample(module, command)
        answer: object = None
        try:
            if op == "lora_add":  # (name, files, layers): plain containers, which Lightning's batch handling keeps
                name, files, layers = command["adapter"]
                self.adapters.add(Adapter(name, tuple(files), layers))
                answer = self.adapters.loaded[name].describe()
            elif op == "lora_remove":
                answer = self.adapters.remove(command["name"])
        except Exception as error:  # noqa: BLE001 - handed to the HTTP request that asked
            answer = error
        if command.get("reply") and self._is_rank0:
            done, box = self._pending_control
            box.append(answer)
            done.set()
        return {}  # nothing to collect (Lightning warns about None)

    def _sample(self, module: ServingModule, command: dict):
        rank0 = self._is_rank0
        jobs = [self.queue.get(job_id) for job_id in command["jobs"]] if rank0 else []
        self._running = [job for job in jobs if job is not None]
        settings = CacheSettings(**command["cache"]) if command.get("cache") else None
        cache = StepCache(settings, settings.coefficients) if settings is not None else None
        total = command["evaluations"]
        for job in self._running:
            job.total_evaluations = total
        samples, joint = None, {}
        began = time.monotonic()
        try:
            with self.adapters.applied(command["loras"]), self._watching(module), \
                    module.sampler.using(step_cache=cache) as sampler:  # this batch's step cache
                # with the sound a joint model samples beside the video (LTX-2's audio latents)
                samples, joint = sampler.generate_joint(command["condition"], command["seeds"],
                                                        negative=command["negative"], shape=command["shape"],
                                                        **command["overrides"])
        except Cancelled:
            pass
        finally:
            if cache is not None:
                self.cache_reused += cache.counts.reused
        self.batches += 1
        if rank0:
            self.samples += len(command["seeds"])
            try:
                self.rank0.deliver(self._running, command, samples, module.sampler, joint)
            finally:
                if self.queue.metrics is not None and self._running:
                    self.queue.metrics.batch_seconds.labels(self._running[0].request.kind).observe(
                        time.monotonic() - began)
                self._running = []
        return {}

    @contextlib.contextmanager
    def _watching(self, module: ServingModule):
        """Before each model forward: count it (progress), and stop every rank together when every job of the batch
        was cancelled or ran out of time."""
        model = module.model
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

        def before_forward(_module, _args):
            stop = 0
            if self._is_rank0:
                self.evaluations += 1
                now = time.time()
                for job in self._running:
                    job.evaluations += 1
                    if now - job.created > self.rank0.timeout_s:
                        job.cancel_requested = True
                        job.finish(FAILED, f"the job took longer than request_timeout_s="
                                           f"{self.rank0.timeout_s:g} seconds", code=504)
                stop = int(all(job.cancel_requested for job in self._running))
            if world > 1:
                vote = torch.tensor([stop], device=module.device)
                dist.all_reduce(vote)  # rank 0's decision reaches every rank at the same step
                stop = int(vote.item())
            if stop:
                raise Cancelled

        handle = model.register_forward_pre_hook(before_forward)
        try:
            yield
        finally:
            handle.remove()


class Rank0:
    """Rank 0's own part: turning jobs into a command (prompts encoded by rank 0's sampler, first frames encoded,
    seeds drawn) and the samples into files (decoded by the sampler, written by ``ringdit.sampling.writer`` as
    infer.py writes them). ``codecs``: the text encoder, the VAE and (a model that samples sound) the audio VAE and
    vocoder, held resident by rank 0's sampler."""

    def __init__(self, spec, files_dir: Path, timeout_s: float, codecs: Codecs = Codecs(),
                 cache_settings: dict | None = None):
        # cache_settings: kind -> CacheSettings that requests may pick (their threshold replaces its own)
        self.spec, self.files_dir, self.timeout_s = spec, files_dir, timeout_s
        self.codecs = codecs  # handed to rank 0's sampler (ringdit.sampling.decoding.spec_codecs)
        self.cache_settings = cache_settings or {}

    def sample_command(self, jobs: list[Job], sampler: Sampler) -> dict:
        """One model forward's worth of jobs (one key) -> the command every rank samples."""
        first = jobs[0].request
        spec, data = self.spec, self.spec.data
        seeds = [seed_of(Stream.INFERENCE, job.request.seed, i) for job in jobs for i in range(job.request.n)]
        negative = None
        if text_conditioned(data):
            prompts = [job.request.prompt for job in jobs for _ in range(job.request.n)]
            # an edit model's encoder reads each prompt with its sample's reference picture (the pipelines' way)
            pictures = [job.request.image for job in jobs for _ in range(job.request.n)] \
                if sampler.codecs.takes_images and first.image is not None else None
            condition = sampler.encode(prompts, pictures)  # (N, L, D) ...
            # the others: the empty prompt, as trained (a pipeline folder's has no stored encoding: always encoded;
            # an edit model's is encoded with each sample's picture, as QwenImageEditPipeline encodes its negative)
            if spec.pipeline or pictures is not None or any(job.request.negative_prompt for job in jobs):
                rows = sampler.encode([job.request.negative_prompt or "" for job in jobs
                                       for _ in range(job.request.n)], pictures)
                negative = rows
            if first.image is not None:
                condition = {**condition, **self.first_frames(jobs)}
            if first.control is not None:  # a control-video model: every job's clip, for each of its samples
                condition = {**condition, CONTROL_KEY: self.controls(jobs)}
        else:
            condition = torch.tensor([label for job in jobs
                                      for label in resolve_labels([job.request.prompt], job.request.n, data)])
        sampler = spec.sampling.get("sampler") or ""
        evaluations = 2 * first.steps - 1 if sampler == "heun" else first.steps
        return {"op": "sample", "jobs": [job.id for job in jobs], "seeds": seeds, "condition": condition,
                "negative": negative, "shape": first.shape,
                "overrides": {"steps": first.steps, "cfg_scale": first.cfg_scale},
                "loras": [list(pair) for pair in first.loras], "evaluations": evaluations,
                "cache": self.cache_for(*first.cache) if first.cache else None}

    def cache_for(self, kind: str, threshold: float):
        """The step cache of a request: ``cache_settings`` (infer.py's cache group, teacache's coefficients
        resolved for this model) with the request's kind and threshold."""
        from dataclasses import asdict

        return {**asdict(self.cache_settings[kind]), "threshold": threshold}  # a dict: see Engine.run

    def first_frames(self, jobs: list[Job]) -> dict[str, torch.Tensor]:
        spec, request = self.spec, jobs[0].request
        prepared = spec.data.get("image_encoder") if isinstance(spec.data.get("image_encoder"), dict) else {}
        pictures = [job.request.image for job in jobs for _ in range(job.request.n)]
        if image_kind(spec.model.config) == "reference":  # an edit model: its reference latents, as infer.py's
            return {REFERENCE_KEY: encode_reference(pictures, vae=spec.output.vae, size=request.size)}
        return first_frame_inputs(pictures, size=request.size, frames=request.frames or 1,
                                  latent="vae" in spec.data, vae=spec.output.vae,
                                  image_encoder=prepared.get("path"), channels=spec.data["channels"],
                                  setting="image")

    def controls(self, jobs: list[Job]) -> torch.Tensor:
        """(N, C_vace, T', h, w): each job's control clip encoded as infer.py control= encodes its file (the same
        ``encode_control``), repeated for the job's ``n`` samples."""
        temporal = control_family(self.spec.model.config).vae_factors[0]
        rows = []
        for job in jobs:
            request = job.request
            with tempfile.TemporaryDirectory() as folder:  # encode_control reads a file, as infer.py's control=
                path = Path(folder) / "control"
                path.write_bytes(request.control)
                encoded = encode_control(str(path), vae=self.spec.output.vae, size=request.size,
                                         frames=request.frames, temporal=temporal)  # (1, C_vace, T', h, w)
            rows.append(encoded.expand(request.n, *encoded.shape[1:]))
        return torch.cat(rows)

    def deliver(self, jobs: list[Job], command: dict, samples: torch.Tensor | None, sampler: Sampler,
                joint: dict | None = None) -> None:
        """Each job's samples as files (PNG per image, MP4 per video, with its sound where the model samples one:
        ``joint``, ``generate_joint``'s); its state finished."""
        if samples is None:  # cancelled together
            for job in jobs:
                job.finish(CANCELLED, "cancelled", code=499)
            return
        try:
            pixels = sampler.to_pixels(samples)  # uint8 (N, [T,] H, W, C)
            sounds = sampler.sounds(joint or {})  # [(waveform, rate)] one a sample, or None: silent
        except Exception as error:  # noqa: BLE001 - the jobs fail with it; the server goes on
            log.exception("decoding a batch failed")
            for job in jobs:
                job.finish(FAILED, f"decoding failed: {error}")
            return
        start = 0
        for job in jobs:
            own = pixels[start:start + job.request.n]
            own_sounds = sounds[start:start + job.request.n] if sounds else [None] * len(own)
            start += job.request.n
            if job.cancel_requested:
                job.finish(CANCELLED, "cancelled", code=499)
                continue
            try:
                job.files = [self.write(job, i, frames, sound)
                             for i, (frames, sound) in enumerate(zip(own, own_sounds))]
            except OSError as error:  # a full disk: this job fails, the server goes on
                job.finish(FAILED, f"writing its files failed: {error}")
                continue
            job.finish(COMPLETED)
            log.info("%s: %d %s(s) %s in %.1f s", job.id, job.request.n, job.request.kind,
                     "x".join(map(str, job.request.size)), time.time() - job.created)

    def write(self, job: Job, index: int, pixels, sound: tuple | None = None) -> Path:
        """One sample's file, as infer.py writes its samples (``write_sample``: whole or not there): a video's MP4
        (with ``sound`` as its AAC track), an image's PNG; an image edit (POST /v1/images/edits) is the video's last
        frame."""
        if pixels.ndim == 4 and job.request.last_frame:
            pixels = pixels[-1]
        suffix = ".mp4" if pixels.ndim == 4 else ".png"
        return write_sample(pixels, self.files_dir / f"{job.id}-{index}{suffix}", self.spec.output.fps, sound)
