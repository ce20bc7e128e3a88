"""A soak of ``python -m ringdit.serve``: two ring-2 servers (gloo, CPU ranks) under concurrent load for a while.

    python benchmarks/serve_soak.py                      # 600 s; trains the tiny image and video DiTs (1 step) first
    python benchmarks/serve_soak.py --duration 60 --sample-every 5

One server samples images (the digits DiT), the other videos (the moving-digits video DiT), each on two ranks
(ring_degree=2), started as a user starts them, on 127.0.0.1 only. Threads of this process send, until the duration
is over: image requests (b64_json and url, some with a LoRA adapter at a random strength), video jobs that are
polled to the end -- some cancelled at a random moment (DELETE) --, and adapter loads and unloads on both servers
while requests name them. A sampler records the resident memory (RSS) of every process of each server.

It asserts, and exits 1 naming what failed otherwise:
- no 5xx answer (no 503 either: nothing drains or fails during the soak), and no 4xx but the documented races
  (a request naming an adapter unloaded meanwhile: 400 at the request or a 409 job error; an unload or a replacement
  refused with 409 while jobs name the adapter; an unload of one already gone: 404);
- no request lost: every image request answered, every video job ends completed, cancelled or failed (its reason one
  of the above) and is known to the server to the end;
- every completed job's files intact: each PNG decodes to the size asked, each MP4 to its frames at that size;
- resident memory flat after warm-up: each server's last samples within ``--rss-tolerance`` of its first samples
  after the warm-up (the first fifth of the run).
Prints the counts and the RSS curve (MiB, each server's processes summed), then drains both servers (SIGTERM: exit 0).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=32", "model.depth=2", "model.num_heads=4", "trainer.max_steps=1", "logger=csv",
        "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=1", "scheduler=constant"]
MODELS = {"image": ["data.batch_size=16"], "video": ["experiment=moving_digits", "data.batch_size=4"]}
ADAPTERS = ("a", "b", "c")


def train(kind: str, run_dir: Path) -> Path:
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        subprocess.run([sys.executable, "train.py", *MODELS[kind], *TINY, f"hydra.run.dir={run_dir}"], cwd=REPO,
                       check=True, capture_output=True)
    return ckpt


def write_adapters(ckpt: Path, lora_dir: Path) -> None:
    """Diffusers-format LoRA files of every block's attention input (``model.blocks.<i>.attn.qkv``), from the
    checkpoint's own shapes: what ``python -m ringdit.export lora=true`` writes."""
    import torch
    from safetensors.torch import save_file

    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    for i, name in enumerate(ADAPTERS):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for key, weight in state.items():
            if key.startswith("model.blocks.") and key.endswith(".attn.qkv.weight"):
                layer = key.removeprefix("model.").removesuffix(".weight")
                out_features, in_features = weight.shape
                tensors[f"transformer.{layer}.lora_A.weight"] = torch.randn(2, in_features, generator=generator) * .3
                tensors[f"transformer.{layer}.lora_B.weight"] = torch.randn(out_features, 2, generator=generator) * .3
        save_file(tensors, str(lora_dir / f"{name}.safetensors"),
                  metadata={"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 2})})


def start(ckpt: Path, run_dir: Path, lora_dir: Path, steps: int) -> tuple[subprocess.Popen, str]:
    from serve_throughput import launch_server  # this folder's: the same start and wait as the throughput table's

    return launch_server([f"ckpt_path={ckpt}", "host=127.0.0.1", "port=0", f"hydra.run.dir={run_dir}",
                          "trainer.devices=2", "ring_degree=2", f"lora_dir={lora_dir}",
                          f"diffusion.sampling.steps={steps}", "max_batch=4", "batch_wait_ms=20", "queue_size=64", "keep_files=64", "request_timeout_s=300"],
                         run_dir, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def rss_mib(pid: int) -> float:
    """The resident memory of ``pid`` and all its descendants (the server's ranks), MiB."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class Soak:
    def __init__(self, urls: dict[str, str], end: float, seed: int):
        self.urls, self.end = urls, end
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.loaded: dict[str, set[str]] = {kind: set() for kind in urls}
        self.jobs: dict[str, tuple[str, str]] = {}  # video job id -> its final status, why

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)
        print("FAILED:", what, flush=True)

    def pick_lora(self, kind: str) -> dict:
        with self.lock:
            names = sorted(self.loaded[kind])
            if not names or self.random.random() < 0.5:
                return {}
            return {"lora": self.random.choice(names), "lora_scale": round(self.random.uniform(-2, 2), 3)}

    def answer_is_a_race(self, answer, body: dict) -> bool:
        """A documented answer to a request that named an adapter unloaded meanwhile."""
        if "lora" not in body:
            return False
        try:
            error = answer.json()["error"]
        except (ValueError, KeyError, TypeError):
            return False
        return (answer.status_code == 400 and error.get("param") == "lora") or (
            answer.status_code == 409 and "was unloaded before this job ran" in error.get("message", ""))

    # ---- the clients (each loop ends at self.end) ------------------------------------------------------------------
    def images(self, index: int) -> None:
        import httpx

        from PIL import Image

        rng = random.Random(index)
        with httpx.Client(base_url=self.urls["image"], timeout=300) as client:
            while time.monotonic() < self.end:
                body = {"prompt": str(rng.randrange(10)), "seed": rng.randrange(2**31), "n": rng.choice((1, 2)),
                        "response_format": rng.choice(("b64_json", "url")), **self.pick_lora("image")}
                answer = client.post("/v1/images/generations", json=body)
                self.count(f"image {answer.status_code}")
                if answer.status_code != 200:
                    if not self.answer_is_a_race(answer, body):
                        self.fail(f"image request {body}: {answer.status_code} {answer.text[:300]}")
                    continue
                items = answer.json()["data"]
                if len(items) != body["n"]:
                    self.fail(f"image request {body}: {len(items)} images")
                for item in items:
                    data = base64.b64decode(item["b64_json"]) if "b64_json" in item else self.fetch(client, item["url"])
                    try:
                        with Image.open(io.BytesIO(data)) as picture:
                            picture.load()
                            intact = picture.size == (8, 8)
                    except Exception as error:  # noqa: BLE001 - reported as a broken file
                        intact, picture = False, error
                    self.count("image file intact" if intact else "image file broken")
                    if not intact:
                        self.fail(f"image of {body}: {picture}")

    def fetch(self, client, url: str) -> bytes:
        answer = client.get(url)
        if answer.status_code != 200:
            self.fail(f"GET {url}: {answer.status_code} {answer.text[:200]}")
        return answer.content

    def videos(self, index: int) -> None:
        import httpx

        rng = random.Random(1000 + index)
        with httpx.Client(base_url=self.urls["video"], timeout=300) as client:
            while time.monotonic() < self.end:
                body = {"prompt": str(rng.randrange(10)), "seed": rng.randrange(2**31), **self.pick_lora("video")}
                answer = client.post("/v1/videos", json=body)
                self.count(f"video submit {answer.status_code}")
                if answer.status_code != 200:
                    if not self.answer_is_a_race(answer, body):
                        self.fail(f"video request {body}: {answer.status_code} {answer.text[:300]}")
                    continue
                job = answer.json()
                cancel_at = time.monotonic() + rng.uniform(0, 3) if rng.random() < 0.25 else None
                deadline = time.monotonic() + 300  # request_timeout_s: the server ends a job by then
                while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
                    time.sleep(0.1)
                    if cancel_at is not None and time.monotonic() > cancel_at:
                        cancelled = client.delete(f"/v1/videos/{job['id']}")
                        self.count(f"video cancel {cancelled.status_code}")
                        if cancelled.status_code != 200:
                            self.fail(f"DELETE /v1/videos/{job['id']}: {cancelled.status_code} {cancelled.text[:200]}")
                        cancel_at = None
                    polled = client.get(f"/v1/videos/{job['id']}")
                    if polled.status_code != 200:
                        self.fail(f"GET /v1/videos/{job['id']}: {polled.status_code} {polled.text[:200]} (lost)")
                        break
                    job = polled.json()
                self.finished_video(client, job, body)

    def finished_video(self, client, job: dict, body: dict) -> None:
        status = job["status"]
        self.count(f"video {status}")
        with self.lock:
            self.jobs[job["id"]] = (status, job.get("error", {}).get("message", ""))
        if status == "failed":
            message = job.get("error", {}).get("message", "")
            if not ("lora" in body and "was unloaded before this job ran" in message):
                self.fail(f"video job {job['id']} {body} failed: {message}")
        elif status == "completed":
            data = client.get(f"/v1/videos/{job['id']}/content")
            try:
                frames = video_frames(data.content)
                intact = data.status_code == 200 and frames.shape[0] == job["frames"] and frames.shape[1:3] == (
                    int(job["size"].split("x")[1]), int(job["size"].split("x")[0]))
            except Exception as error:  # noqa: BLE001 - reported as a broken file
                intact, frames = False, error
            self.count("video file intact" if intact else "video file broken")
            if not intact:
                self.fail(f"video {job['id']}: {getattr(frames, 'shape', frames)} for {job['frames']} frames of "
                          f"{job['size']}")
        elif status != "cancelled":
            self.fail(f"video job {job['id']} still {status} after 300 s (lost)")

    def adapters(self, kind: str, seed: int) -> None:
        """Loads (or replaces) and unloads adapters while requests name them: 200, or 409 (jobs name it: neither
        replaced nor unloaded) / 404 (unloaded already)."""
        import httpx

        rng = random.Random(seed)
        with httpx.Client(base_url=self.urls[kind], timeout=300) as client:
            while time.monotonic() < self.end:
                name = rng.choice(ADAPTERS)
                if rng.random() < 0.5:
                    answer = client.post("/v1/loras", json={"name": name, "path": f"{name}.safetensors"})
                    self.count(f"lora load {answer.status_code}")
                    if answer.status_code == 200:
                        with self.lock:
                            self.loaded[kind].add(name)
                    elif answer.status_code != 409:
                        self.fail(f"{kind} POST /v1/loras {name}: {answer.status_code} {answer.text[:200]}")
                else:
                    with self.lock:  # requests picking it from now on may still race with the unload: documented
                        self.loaded[kind].discard(name)
                    answer = client.delete(f"/v1/loras/{name}")
                    self.count(f"lora unload {answer.status_code}")
                    if answer.status_code == 409:
                        with self.lock:
                            self.loaded[kind].add(name)  # still resident
                    elif answer.status_code not in (200, 404):
                        self.fail(f"{kind} DELETE /v1/loras/{name}: {answer.status_code} {answer.text[:200]}")
                time.sleep(rng.uniform(0.2, 2.0))

    def lost(self) -> None:
        """Every video job still known to the server with the status its client saw last."""
        import httpx

        with self.lock:  # in the order they finished; keep_files=64: the newest 64 are still known
            newest = list(self.jobs.items())[-32:]
        for job_id, (status, _) in newest:
            answer = httpx.get(f"{self.urls['video']}/v1/videos/{job_id}", timeout=30)
            if answer.status_code != 200 or answer.json()["status"] != status:
                self.fail(f"video job {job_id}: the server says {answer.status_code} {answer.text[:200]}, the client "
                          f"saw {status}")


def video_frames(data: bytes):
    import av
    import numpy as np

    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--sample-every", type=float, default=15, help="seconds between RSS samples")
    parser.add_argument("--image-clients", type=int, default=3)
    parser.add_argument("--video-clients", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="sampler steps per request")
    parser.add_argument("--rss-tolerance", type=float, default=0.05,
                        help="the largest growth of a server's RSS after warm-up, as a fraction (default 5%%)")
    parser.add_argument("--work", type=Path, help="a folder for the checkpoints and runs (default: a new temp one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.duration <= 0 or args.sample_every <= 0:
        parser.error("--duration and --sample-every must be > 0 (seconds)")
    work = args.work or Path(tempfile.mkdtemp(prefix="serve_soak_"))
    work.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for kind in ("image", "video"):
            ckpt = train(kind, work / f"train_{kind}")
            lora_dir = work / f"loras_{kind}"
            lora_dir.mkdir(exist_ok=True)
            write_adapters(ckpt, lora_dir)
            servers[kind] = start(ckpt, work / f"serve_{kind}", lora_dir, args.steps)
        return soak(args, servers)
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def soak(args, servers: dict) -> int:
    urls = {kind: url for kind, (_, url) in servers.items()}
    print(f"servers: {urls} (ring 2 each); {args.duration:g} s of load; load average before: "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    began = time.monotonic()
    run = Soak(urls, began + args.duration, args.seed)
    threads = [threading.Thread(target=run.images, args=(i,)) for i in range(args.image_clients)]
    threads += [threading.Thread(target=run.videos, args=(i,)) for i in range(args.video_clients)]
    threads += [threading.Thread(target=run.adapters, args=(kind, 7 + i)) for i, kind in enumerate(urls)]
    for thread in threads:
        thread.start()
    samples = []  # (seconds, {kind: MiB})
    while any(thread.is_alive() for thread in threads):
        samples.append((time.monotonic() - began, {kind: rss_mib(proc.pid) for kind, (proc, _) in servers.items()}))
        print(f"{samples[-1][0]:7.0f} s  " + "  ".join(f"{kind} {mib:7.1f} MiB" for kind, mib in samples[-1][1].items())
              + f"  requests so far: {sum(run.counts.values())}", flush=True)
        next_sample = began + len(samples) * args.sample_every
        while time.monotonic() < next_sample and any(thread.is_alive() for thread in threads):
            time.sleep(0.2)
    for thread in threads:
        thread.join()
    run.lost()
    for kind, (proc, url) in servers.items():
        import httpx

        stats = httpx.get(url + "/v1/stats", timeout=30).json()
        print(f"{kind} server: {stats}", flush=True)
    print("\nanswers:", flush=True)
    for what, count in sorted(run.counts.items()):
        print(f"  {what:28} {count}", flush=True)
    print("\nresident memory (MiB, each server's processes summed):", flush=True)
    print(f"{'seconds':>8} " + " ".join(f"{kind:>10}" for kind in servers), flush=True)
    for seconds, mib in samples:
        print(f"{seconds:8.0f} " + " ".join(f"{mib[kind]:10.1f}" for kind in servers), flush=True)
    after_warmup = [mib for seconds, mib in samples if seconds >= args.duration / 5]
    if len(after_warmup) >= 4:
        third = max(1, len(after_warmup) // 3)
        for kind in servers:
            first = sum(s[kind] for s in after_warmup[:third]) / third
            last = sum(s[kind] for s in after_warmup[-third:]) / third
            growth = (last - first) / first
            print(f"{kind}: {first:.1f} MiB after warm-up -> {last:.1f} MiB at the end ({growth:+.1%})", flush=True)
            if growth > args.rss_tolerance:
                run.fail(f"{kind} server's RSS grew {growth:+.1%} after warm-up (more than {args.rss_tolerance:.0%})")
    else:
        print("too few RSS samples after warm-up to judge the curve (lower --sample-every)", flush=True)
    codes = {}
    for kind, (proc, _) in servers.items():
        proc.send_signal(signal.SIGTERM)
        codes[kind] = proc.wait(timeout=120)
        if codes[kind] != 0:
            run.fail(f"the {kind} server exited {codes[kind]} on SIGTERM (not 0)")
    print(f"exit codes on SIGTERM: {codes}", flush=True)
    if run.failures:
        print(f"\n{len(run.failures)} failure(s); the first: {run.failures[0]}", flush=True)
        return 1
    print("\nno 5xx, no undocumented 4xx, no request lost, every file intact", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
