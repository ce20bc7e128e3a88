"""Throughput and latency of ``python -m ringdit.serve`` with and without batching, at 1, 4 and 16 concurrent clients.

    python benchmarks/serve_throughput.py                       # trains the default digits DiT for 1 step first
    python benchmarks/serve_throughput.py --ckpt <run>/checkpoints/last.ckpt --requests 48 --steps 20

Each setting starts its own server (``max_batch=1``: every request alone; ``max_batch=16``: requests of one shape
batched), as a user starts it, on one CPU rank; the clients are threads of this process, each sending its requests one
after another (a new one when the last was answered). Prints requests per second and the latency percentiles, and
batching's throughput as a ratio to no batching at the same client count. Run it on an idle machine: the figures
are ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(ckpt: Path, run_dir: Path, max_batch: int, steps: int, devices: int) -> tuple[subprocess.Popen, str]:
    return launch_server([f"ckpt_path={ckpt}", "port=0", f"hydra.run.dir={run_dir}", f"max_batch={max_batch}",
                          "batch_wait_ms=20", f"diffusion.sampling.steps={steps}", "queue_size=256",
                          f"trainer.devices={devices}", f"ring_degree={devices}"], run_dir)


def launch_server(settings: list[str], run_dir: Path, env: dict | None = None,
                  timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``python -m ringdit.serve settings`` in a session of its own (its log beside run_dir), and its URL once
    /health answers; SystemExit naming the log when it exits or does not answer within ``timeout`` seconds."""
    import httpx

    log = open(run_dir.with_suffix(".log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "ringdit.serve", *settings], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: {run_dir.with_suffix('.log')}")
        info = run_dir / "server.json"
        if info.is_file():
            url = json.loads(info.read_text())["url"]
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.1)


def load(url: str, clients: int, requests: int) -> tuple[float, list[float]]:
    """``requests`` requests spread over ``clients`` threads: (seconds in all, each request's latency)."""
    import httpx

    latencies: list[float] = []
    lock = threading.Lock()
    per_client = [requests // clients + (i < requests % clients) for i in range(clients)]

    def client(index: int, count: int) -> None:
        with httpx.Client(timeout=600) as session:
            for k in range(count):
                began = time.perf_counter()
                answer = session.post(url + "/v1/images/generations",
                                      json={"prompt": str(k % 10), "seed": index * 1000 + k})
                answer.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - began)

    threads = [threading.Thread(target=client, args=(i, n)) for i, n in enumerate(per_client) if n]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="a checkpoint to serve (default: the digits DiT after 1 step)")
    parser.add_argument("--requests", type=int, default=48, help="requests per setting")
    parser.add_argument("--steps", type=int, default=20, help="sampler steps per request")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--devices", type=int, default=1, help="CPU ranks (ring attention over them)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    ckpt = args.ckpt
    if ckpt is None:
        subprocess.run([sys.executable, "train.py", "trainer.max_steps=1", "logger=csv", "callbacks.sample_grid.steps=2",
                        f"hydra.run.dir={work / 'train'}"], cwd=REPO, check=True, capture_output=True)
        ckpt = work / "train" / "checkpoints" / "last.ckpt"
    print(f"{args.requests} requests of one 8x8 digit each, {args.steps} steps, {args.devices} CPU rank(s); "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'clients':>7} {'max_batch':>9} {'req/s':>8} {'p50 s':>8} {'p90 s':>8} {'p99 s':>8} {'vs 1':>7}",
          flush=True)
    for clients in args.clients:
        rates = {}
        for max_batch in (1, 16):
            proc, url = start(ckpt, work / f"serve_{clients}_{max_batch}", max_batch, args.steps, args.devices)
            try:
                load(url, clients, min(clients, args.requests))  # warm-up: first forwards, allocator
                seconds, latencies = load(url, clients, args.requests)
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            rates[max_batch] = args.requests / seconds
            print(f"{clients:>7} {max_batch:>9} {rates[max_batch]:>8.2f} {statistics.median(latencies):>8.3f} "
                  f"{percentile(latencies, 0.9):>8.3f} {percentile(latencies, 0.99):>8.3f} "
                  f"{rates[max_batch] / rates[1]:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
