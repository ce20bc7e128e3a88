"""What the server tests share: a one-process server in the test's process, the API key, and readers of the images
and videos it answers with (``tests/test_serve.py``, and the families served through it)."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import threading
import time
from pathlib import Path

import numpy as np

from tests.helpers import compose_config

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def serving(run_dir: Path, *overrides: str):
    """A one-process server in this process (``ringdit.serve.Server``, the code ``python -m ringdit.serve`` runs):
    yields it once ready; drains it on leaving."""
    from ringdit.serve import Server

    saved = dict(os.environ)  # Lightning leaves LOCAL_RANK, MASTER_* behind, which later launches would read
    server = Server(compose_config("serve", run_dir, "port=0", *overrides))
    server.build()
    codes = []
    thread = threading.Thread(target=lambda: codes.append(server.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while server.state != "ok":
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not become ready"
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.drain()
        thread.join(timeout=60)
        os.environ.clear()
        os.environ.update(saved)
        assert codes == [0]


def pixels_of(item: dict) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))


def video_frames(data: bytes | Path) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data) if isinstance(data, bytes) else str(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def finished_video(url: str, job_id: str, headers=None) -> bytes:
    import httpx  # the server tests' client (they skip without it)

    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{url}/v1/videos/{job_id}", headers=headers).json())["status"] in ("queued",
                                                                                               "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job["status"] == "completed", job
    return httpx.get(f"{url}/v1/videos/{job_id}/content", headers=headers).content
