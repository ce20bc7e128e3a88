"""Jobs and the queue between the HTTP handlers (many threads) and the sampling loop (rank 0's main thread).

A ``Job`` is one request: its samples, its state and, when done, its files. ``JobQueue.next_batch`` hands the sampling
loop the oldest waiting job together with the later ones it can share a model forward with -- the same ``Job.key``
(shape, steps, guidance, sampler, LoRA adapters and strengths in order, step cache) -- up to ``max_batch`` samples,
waiting at most ``batch_wait_s`` for them to arrive. Each sample keeps its own seed, so its result does not depend on
its batch.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
FINISHED = (COMPLETED, FAILED, CANCELLED)


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(frozen=True)
class SampleRequest:
    """A validated request (``ringdit.serve.validate``): what to sample and how."""

    kind: str                        # "image" | "video"
    prompt: str                      # text, or a class name / id for a class-conditional model
    n: int
    seed: int                        # sample i of the request starts from noise seeded by (seed, i), as infer.py's
    shape: tuple[int, ...]           # ([T,] H, W) in the data's cells
    size: tuple[int, int]            # (H, W) as asked
    frames: int | None
    steps: int
    cfg_scale: float
    negative_prompt: str | None = None
    loras: tuple[tuple[str, float], ...] = ()  # (resident adapter, strength), stacked in this order
    cache: tuple[str, float] | None = None  # (kind, threshold)
    image: Any = None                # image-to-video: the first frame, a PIL image
    control: bytes | None = None     # a control-video model's (Wan VACE) control clip, as uploaded (checked)
    last_frame: bool = False         # POST /v1/images/edits: a video whose last frame is written, as a PNG
    fps: int | None = None           # a video's frames per second (its MP4's): the job reports frames / fps seconds
    model: str = ""                  # the served model's name, as GET /v1/models lists it

    @property
    def key(self) -> tuple:
        """Requests of one key share a model forward."""
        return (self.kind, self.shape, self.steps, self.cfg_scale, self.loras, self.cache, self.image is not None)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.loras)


@dataclass
class Job:
    request: SampleRequest
    id: str = field(default_factory=lambda: f"job_{secrets.token_hex(8)}")
    created: float = field(default_factory=time.time)
    status: str = QUEUED
    evaluations: int = 0             # model forwards done for this job's batch
    total_evaluations: int = 1
    error: str | None = None
    error_code: int = 500
    files: list[Path] = field(default_factory=list)
    cancel_requested: bool = False
    started: float | None = None     # when its batch started
    finished: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_finish: Callable[[Job], None] | None = field(default=None, repr=False)  # the server's metrics

    @property
    def progress(self) -> int:
        """Percent of the sampler's model forwards done (100 once completed)."""
        if self.status == COMPLETED:
            return 100
        return min(99, int(100 * self.evaluations / max(1, self.total_evaluations)))

    def finish(self, status: str, error: str | None = None, code: int = 500) -> None:
        if self.status in FINISHED:
            return
        self.status, self.error, self.error_code = status, error, code
        self.finished = time.time()
        if self.on_finish is not None:
            self.on_finish(self)
        self.done.set()

    @property
    def is_video(self) -> bool:
        """A job of ``POST /v1/videos`` (an image edit samples a video too, but answers with its last frame)."""
        return self.request.kind == "video" and not self.request.last_frame

    def describe(self) -> dict:
        """The job as OpenAI's Video object (id, object, status, progress, created_at, completed_at, model, size,
        seconds, prompt, error) plus ringdit's own (step, steps, n, seed, frames)."""
        request = self.request
        steps = request.steps
        described = {"id": self.id, "object": "video" if self.is_video else "image.generation",
                     "status": self.status, "created_at": int(self.created), "progress": self.progress,
                     "completed_at": int(self.finished) if self.status == COMPLETED else None,
                     "model": request.model, "prompt": request.prompt,
                     "step": min(steps, round(steps * self.evaluations / max(1, self.total_evaluations)))
                     if self.status != COMPLETED else steps, "steps": steps,
                     "size": f"{request.size[1]}x{request.size[0]}", "n": request.n, "seed": request.seed}
        if request.frames is not None:
            described["frames"] = request.frames
            if request.fps:  # the MP4's length (OpenAI's seconds is a string: "4")
                described["seconds"] = f"{request.frames / request.fps:.4g}"
        if request.loras:
            described["loras"] = [{"name": name, "scale": scale} for name, scale in request.loras]
        if self.error:
            described["error"] = {"message": self.error}
        return described


class JobQueue:
    """Bounded FIFO of waiting jobs plus every job still known by id (finished ones until ``keep`` newer exist)."""

    def __init__(self, size: int, max_batch: int, batch_wait_s: float, keep: int = 256, metrics=None):
        self.size, self.max_batch, self.batch_wait_s, self.keep = size, max_batch, batch_wait_s, keep
        self.metrics = metrics  # ringdit.serve.metrics.Metrics, or None
        self._waiting: list[Job] = []
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Condition()
        self.closed = False
        self._woken = False  # wake(): the sampling loop is wanted for something else

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self.closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.size:
                raise QueueFull(f"{len(self._waiting)} jobs are waiting (queue_size={self.size}); retry later")
            if self.metrics is not None:
                job.on_finish = self.metrics.job_finished
            self._waiting.append(job)
            self._jobs[job.id] = job
            self._forget_old()
            self._lock.notify_all()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def jobs(self) -> list[Job]:
        """Every job still known, oldest first."""
        with self._lock:
            return list(self._jobs.values())

    def naming(self, lora: str) -> list[Job]:
        """The unfinished (waiting or running) jobs that sample with adapter ``lora`` (among any others)."""
        with self._lock:
            return [job for job in self._jobs.values()
                    if job.status not in FINISHED and lora in job.request.adapter_names]

    def cancel(self, job_id: str) -> Job | None:
        """A waiting job leaves the queue at once; a running one stops at its batch's next model forward (when every
        job of the batch is cancelled; otherwise its samples are dropped when the batch ends)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            job.cancel_requested = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.finish(CANCELLED, "cancelled", code=499)
            return job

    def next_batch(self, timeout: float) -> list[Job]:
        """The oldest waiting job and the later ones of its key, up to ``max_batch`` samples ([] after ``timeout``
        seconds without a job). Once the first job is there, waits up to ``batch_wait_s`` for the batch to fill."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._waiting:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed or self._woken:
                    self._woken = False
                    return []
                self._lock.wait(left)
            fill_until = self._waiting[0].created + self.batch_wait_s
            while self._fits() < self.max_batch and time.time() < fill_until and not self.closed:
                self._lock.wait(max(0.0, fill_until - time.time()))
            batch, samples = [], 0
            key = self._waiting[0].request.key
            for job in list(self._waiting):
                if job.request.key == key and samples + job.request.n <= max(self.max_batch, self._waiting[0].request.n):
                    batch.append(job)
                    samples += job.request.n
                    self._waiting.remove(job)
            now = time.time()
            for job in batch:
                job.status, job.started = RUNNING, now
                if self.metrics is not None:
                    self.metrics.job_started(job)
            return batch

    def wake(self) -> None:
        """The sampling loop, if it waits for a job, returns from ``next_batch`` at once (a LoRA command waits for its
        turn: without this, up to a tick)."""
        with self._lock:
            self._woken = True
            self._lock.notify_all()

    def _fits(self) -> int:
        """Samples of the first waiting job's key."""
        key = self._waiting[0].request.key
        return sum(job.request.n for job in self._waiting if job.request.key == key)

    def close(self, reason: str, code: int = 503) -> None:
        """No new jobs; the waiting ones fail with ``reason``."""
        with self._lock:
            self.closed = True
            for job in self._waiting:
                job.finish(FAILED, reason, code=code)
            self._waiting.clear()
            self._lock.notify_all()

    def fail_all(self, reason: str) -> None:
        """Every unfinished job fails (a rank crashed)."""
        with self._lock:
            self.closed = True
            for job in self._jobs.values():
                job.finish(FAILED, reason, code=503)
            self._waiting.clear()
            self._lock.notify_all()

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._lock:
            return sum(job.status == RUNNING for job in self._jobs.values())

    def _forget_old(self) -> None:
        finished = [job_id for job_id, job in self._jobs.items() if job.status in FINISHED]
        for job_id in finished[:max(0, len(finished) - self.keep)]:
            job = self._jobs.pop(job_id)
            for file in job.files:
                file.unlink(missing_ok=True)
