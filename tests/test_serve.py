"""The HTTP server (``python -m ringdit.serve``, issue 42), called with a real HTTP client on 127.0.0.1.

A one-process server of the tiny DiT runs in this process (its sampling loop in a thread): results equal infer.py's
for the same seeds, batching (model forwards counted) changes no sample, the API key, bad requests, run-time LoRA
(load, swap, unload: exactly the base merged with the adapter). A tiny Wan 2.2 TI2V (text encoder, VAE, image-to-video)
is served at ring 2 by ``python -m ringdit.serve`` as a user starts it: its videos equal infer.py's, a job is
cancelled, SIGTERM drains. A ring-2 DiT server whose rank is killed answers 503 and exits non-zero. OpenAI's own
client (``openai``) drives both in this process (issue 55): images, videos from ``seconds`` and an uploaded
``input_reference``, the paged video list, image edits, and ``/metrics`` read by Prometheus' parser.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import LAUNCH_VARIABLES, REPO, TINY, compose_config, run, write_video
from tests.serving import AUTH, KEY, finished_video, pixels_of, serving, video_frames

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# ---- the tiny DiT, one process, in this process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_dit")
    run("train.py", root / "train", *TINY, "trainer.max_steps=1")
    loras = root / "loras"
    loras.mkdir()
    ckpt = root / "train" / "checkpoints" / "last.ckpt"
    with serving(root / "serve", f"ckpt_path={ckpt}", f"api_key={KEY}", f"lora_dir={loras}",
                 "diffusion.sampling.steps=4",
                 "trainer.precision=64-true", "max_batch=4", "batch_wait_ms=300", "queue_size=64") as server:
        yield server, ckpt, loras, root


def post(server, path: str, body: dict, headers=AUTH, timeout: float = 120):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def test_samples_equal_infer_and_batching_changes_none(dit):
    """A request's samples are infer.py's for the same seed (sample i from noise seeded by (seed, i)); 50 concurrent
    requests are all answered, in batches of up to 4 (at most a third as many model-forward batches as requests),
    each sample equal to the same request sent alone."""
    server, ckpt, _, root = dit
    run("infer.py", root / "infer", f"ckpt_path={ckpt}", "labels=[3]", "num_samples=3", "seed=5",
        "diffusion.sampling.steps=4",
        "trainer.precision=64-true")
    expected = np.load(root / "infer" / "samples.npz")["images"][..., 0]  # (3, 8, 8) uint8
    answer = post(server, "/v1/images/generations", {"prompt": "3", "n": 3, "seed": 5}).json()
    np.testing.assert_array_equal(np.stack([pixels_of(item) for item in answer["data"]]), expected)

    before = httpx.get(server.url + "/v1/stats", headers=AUTH).json()
    results = {}

    def ask(seed):
        results[seed] = post(server, "/v1/images/generations", {"prompt": str(seed % 10), "seed": seed})

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(100, 150)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = httpx.get(server.url + "/v1/stats", headers=AUTH).json()
    assert all(r.status_code == 200 for r in results.values()) and len(results) == 50
    batches = after["batches"] - before["batches"]
    assert batches <= 50 // 3, f"50 requests in {batches} batches: little was batched"
    assert after["model_evaluations"] - before["model_evaluations"] == batches * 7  # Heun, 4 steps: 7 per batch
    for seed in (100, 125, 149):  # alone now: the same pixels
        alone = post(server, "/v1/images/generations", {"prompt": str(seed % 10), "seed": seed})
        np.testing.assert_array_equal(pixels_of(alone.json()["data"][0]), pixels_of(results[seed].json()["data"][0]))


def test_only_callers_with_the_key_are_served(dit):
    server = dit[0]
    assert httpx.get(server.url + "/health").status_code == 200  # health checks need no key
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong-key-0000000"}).status_code == 401
    refused = post(server, "/v1/images/generations", {"prompt": "3"}, headers={})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "dit"


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "3", "n": 9}, "n", 400),
    ({"prompt": "3", "steps": 101}, "steps", 400),
    ({"prompt": "3", "size": "10x8"}, "size", 400),            # 80 pixels > the model's 64
    ({"prompt": "3", "size": "7x9"}, "size", 400),
    ({"prompt": "3", "size": "huge"}, "size", 400),
    ({"prompt": "eleven"}, "prompt", 400),                     # not a class id or name
    ({"prompt": "3", "guidance_scale": -1}, "guidance_scale", 400),
    ({"prompt": "3", "lora": "none-such"}, "lora", 400),
    ({"prompt": "3", "image": "aGVsbG8="}, "image", 400),      # the DiT takes no image
    ({"prompt": "3", "cache": "teacache"}, "cache", 400),      # no polynomial known for it
    ({"prompt": "3", "unknown": 1}, "unknown", 400),
    ({"prompt": "3", "seed": -1}, "seed", 400),
    ({"n": 1}, "prompt", 400),
    ({"prompt": "3", "lora_scale": "inf"}, "lora_scale", 400),
    ({"prompt": "3", "guidance_scale": "NaN"}, "guidance_scale", 400),
    ({"prompt": "3", "response_format": "file"}, "response_format", 400),
    # strict types (issue 53): a boolean is not a number, a string not an integer, sizes and class ids ASCII digits
    ({"prompt": "3", "n": True}, "n", 400),
    ({"prompt": "3", "n": "2"}, "n", 400),
    ({"prompt": "3", "steps": 2.0}, "steps", 400),
    ({"prompt": "3", "seed": True}, "seed", 400),
    ({"prompt": "3", "guidance_scale": True}, "guidance_scale", 400),
    ({"prompt": "3", "size": "\uff18x\uff18"}, "size", 400),     # full-width digits
    ({"prompt": "3", "size": "9" * 5000 + "x8"}, "size", 400),     # once a 500 (int() of over 4300 digits)
    ({"prompt": "3", "size": ""}, "size", 400),                    # once the default size, silently
    ({"prompt": "\uff13"}, "prompt", 400),                         # a full-width class id
    ({"prompt": "\ud800"}, "prompt", 400),                         # a lone surrogate: not Unicode text
    ({"prompt": "3", "model": "m" * 300}, "model", 400),
    # a setting that applies only with another (once ignored silently)
    ({"prompt": "3", "cache_threshold": 0.5}, "cache_threshold", 400),
    ({"prompt": "3", "lora_scale": 0.5}, "lora_scale", 400),
])
def test_bad_requests_name_the_field(dit, body, param, status):
    # json.dumps escapes what httpx's encoder would refuse to send (a lone surrogate)
    answer = httpx.post(dit[0].url + "/v1/images/generations", content=json.dumps(body).encode(),
                        headers={**AUTH, "Content-Type": "application/json"}, timeout=120)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()


def test_a_body_that_is_not_json_is_a_400(dit):
    answer = httpx.post(dit[0].url + "/v1/images/generations", content=b"not json",
                        headers={**AUTH, "Content-Type": "application/json"})
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]


def api_error(answer, status: int) -> dict:
    """The answer's error, checked to be in the API's shape with ``status``."""
    assert answer.status_code == status, answer.text[:500]
    error = answer.json()["error"]
    assert set(error) == {"message", "param", "type"} and error["message"], error
    return error


def test_every_refusal_is_in_the_api_shape(dit):
    """Answers that FastAPI and Starlette make themselves -- a body its JSON parser gives up on (100,000 arrays deep:
    a RecursionError inside it), no such endpoint, a method not allowed --, a body too large (by its Content-Length,
    or streamed without one), and names that no file system takes: all in ``{"error": {"message", "param", "type"}}``,
    none a 500."""
    from ringdit.serve.bodies import MAX_BODY_BYTES

    url, json_type = dit[0].url, {**AUTH, "Content-Type": "application/json"}
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "not valid JSON" in api_error(httpx.post(url + "/v1/images/generations", content=deep, headers=json_type),
                                         400)["message"]
    assert "JSON object" in api_error(httpx.post(url + "/v1/images/generations", content=b"[]", headers=json_type),
                                      400)["message"]
    api_error(httpx.get(url + "/v1/no-such-endpoint", headers=AUTH), 404)
    assert api_error(httpx.put(url + "/v1/models", headers=AUTH), 405)["message"] == "PUT is not allowed on /v1/models"
    large = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    api_error(httpx.post(url + "/v1/images/generations", content=large, headers=json_type), 413)

    def streamed():  # chunked: no Content-Length to refuse it by
        yield large[:len(large) // 2]
        yield large[len(large) // 2:]

    api_error(httpx.post(url + "/v1/images/generations", content=streamed(), headers=json_type), 413)
    assert api_error(httpx.get(url + "/v1/files/a%00b.png", headers=AUTH), 404)["param"] == "name"
    assert api_error(httpx.get(url + "/v1/files/" + "a" * 5000 + ".png", headers=AUTH), 404)["param"] == "name"
    for path in ("a\x00.safetensors", "a" * 300 + ".safetensors"):  # once a 500 (ValueError, OSError)
        assert api_error(post(dit[0], "/v1/loras", {"name": "x", "path": path}), 400)["param"] == "path"
    assert httpx.get(url + "/health").status_code == 200


def test_fuzzed_requests_from_the_openapi_schema(dit):
    """Schemathesis draws requests for every endpoint from the API's OpenAPI schema -- valid ones and ones that break
    it (wrong types, missing and extra fields, hostile strings) -- and sends them in-process (ASGI) to the app over the
    running tiny server: no 500, and every 4xx in the API's error shape. Bounded: 120 requests, a few seconds."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from ringdit.serve.api import create_app

    app = create_app(dit[0])
    schema = schemathesis.openapi.from_dict(app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 15, [f"{op.method} {op.path}" for op in operations]
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    answered = []

    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of([op.as_strategy(generation_mode=mode) for op in operations for mode in modes]))
    def check(case):
        answer = case.call(app=app, headers=AUTH)
        answered.append(answer.status_code)
        assert answer.status_code < 500, (case.as_curl_command(), answer.text[:500])
        if answer.status_code >= 400:
            error = answer.json().get("error")
            assert isinstance(error, dict) and set(error) == {"message", "param", "type"}, (
                case.as_curl_command(), answer.text[:500])

    check()
    assert len(answered) >= 100 and any(code == 200 for code in answered)


def test_video_endpoints_refuse_an_image_model(dit):
    answer = post(dit[0], "/v1/videos", {"prompt": "3"})
    assert answer.status_code == 400 and "POST /v1/images/generations" in answer.json()["error"]["message"]


LAYERS = ("blocks.0.adaLN_modulation.1", "blocks.0.attn.qkv", "final_layer.linear")


def write_adapter(path: Path, model: torch.nn.Module, rank: int = 2, alpha: float = 4.0, seed: int = 0) -> dict:
    """A diffusers-format LoRA (what ``ringdit.export lora=true`` writes) of three of the DiT's layers: the first
    block's modulation (its zero-initialised gates open), attention input, and the output layer."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    tensors = {}
    for name in LAYERS:
        layer = modules[name]
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=generator) * 0.3
        tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=generator) * 0.3
    save_file(tensors, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(
        {"transformer.r": rank, "transformer.lora_alpha": alpha})})
    return tensors


def test_lora_load_swap_unload_equal_the_merged_base(dit):
    """A request with an adapter at a strength samples exactly what the base merged with it at that strength samples;
    two adapters resident, swapped per request; unloading brings the base back."""
    from ringdit.common.seeding import Stream, seed_of

    server, _, loras, _ = dit
    model = server.module.model
    first = write_adapter(loras / "a.safetensors", model, seed=1)
    write_adapter(loras / "b.safetensors", model, seed=2)
    (loras / "c.pt").write_bytes(b"not safetensors")
    for name, path in (("a", "a.safetensors"), ("b", "b.safetensors")):
        assert post(server, "/v1/loras", {"name": name, "path": path}).status_code == 200
    for path, why in (("../outside.safetensors", "outside lora_dir"), ("c.pt", "not a .safetensors"),
                      ("missing.safetensors", "does not exist")):
        refused = post(server, "/v1/loras", {"name": "x", "path": path})
        assert refused.status_code == 400 and why in refused.json()["error"]["message"]
    assert sorted(a["name"] for a in httpx.get(server.url + "/v1/loras", headers=AUTH).json()["data"]) == ["a", "b"]

    def image(**extra):
        return pixels_of(post(server, "/v1/images/generations", {"prompt": "4", "seed": 7, **extra}).json()["data"][0])

    base, with_a, with_b = image(), image(lora="a", lora_scale=0.5), image(lora="b")
    assert not np.array_equal(base, with_a) and not np.array_equal(with_a, with_b)
    # the base merged with adapter a at strength 0.5 (alpha 4 / rank 2), sampled directly by the server's module
    weights = dict(model.named_parameters())
    saved = {}
    with torch.no_grad():
        for name in LAYERS:
            weight = weights[f"{name}.weight"]
            saved[name] = weight.clone()
            delta = first[f"transformer.{name}.lora_B.weight"] @ first[f"transformer.{name}.lora_A.weight"]
            weight += 0.5 * 4.0 / 2 * delta.to(weight)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # as Lightning's trainer.precision=64-true samples
        try:
            merged = server.module.sampler.generate(torch.tensor([4]), [seed_of(Stream.INFERENCE, 7, 0)], steps=4)
        finally:
            torch.set_default_dtype(default)
            for name, weight in saved.items():
                weights[f"{name}.weight"].copy_(weight)
    from ringdit.media.images import to_uint8

    np.testing.assert_array_equal(with_a, to_uint8(merged).numpy()[0, ..., 0])
    assert httpx.delete(server.url + "/v1/loras/a", headers=AUTH).status_code == 200
    assert post(server, "/v1/images/generations", {"prompt": "4", "lora": "a"}).status_code == 400
    np.testing.assert_array_equal(image(), base)


def test_stacked_adapters_equal_infer_and_every_one_is_held(dit):
    """A request with two adapters at strengths (0.5, -0.8) (``loras=[{name, scale}, ...]``) samples exactly what
    infer.py's ``lora=[{path, strength}, ...]`` stacks on the model (``read_lora_stack`` + ``stack_adapters``, its
    code, on the same files); the hooks are gone after the batch; one adapter in the list equals the ``lora`` form;
    bad lists name the entry's field; unloading either adapter while a waiting job names both is refused (409)."""
    from ringdit.checkpoints.lora_formats import LoraFile, read_lora_stack
    from ringdit.media.images import to_uint8
    from ringdit.models.lora import adapted_modules, stack_adapters
    from ringdit.common.seeding import Stream, seed_of

    server, _, loras, _ = dit
    model = server.module.model
    for i, name in enumerate(("s1", "s2")):
        write_adapter(loras / f"{name}.safetensors", model, seed=5 + i)
        assert post(server, "/v1/loras", {"name": name, "path": f"{name}.safetensors"}).status_code == 200
    layers = [model.get_submodule(name) for name in LAYERS]
    hooks = [len(layer._forward_hooks) for layer in layers]

    def image(**extra):
        answer = post(server, "/v1/images/generations", {"prompt": "4", "seed": 7, **extra})
        assert answer.status_code == 200, answer.text[:500]
        return pixels_of(answer.json()["data"][0])

    both = image(loras=[{"name": "s1", "scale": 0.5}, {"name": "s2", "scale": -0.8}])
    assert [len(layer._forward_hooks) for layer in layers] == hooks
    files = tuple(LoraFile(f"lora[{i}]", (loras / f"{name}.safetensors",), strength)
                  for i, (name, strength) in enumerate((("s1", 0.5), ("s2", -0.8))))
    handles = stack_adapters(adapted_modules(model), read_lora_stack(files, model), device=server.module.device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as Lightning's trainer.precision=64-true samples
    try:
        with torch.no_grad():
            stacked = server.module.sampler.generate(torch.tensor([4]), [seed_of(Stream.INFERENCE, 7, 0)], steps=4)
    finally:
        torch.set_default_dtype(default)
        for handle in handles:
            handle.remove()
    np.testing.assert_array_equal(both, to_uint8(stacked).numpy()[0, ..., 0])
    alone = image(lora="s1", lora_scale=0.5)
    np.testing.assert_array_equal(image(loras=[{"name": "s1", "scale": 0.5}]), alone)
    assert not np.array_equal(both, alone)

    for loras_given, param in (([{"name": "s1"}, {"name": "s1"}], "loras.1.name"), ([{"name": "nope"}], "loras.0.name"),
                               ([{"name": "s1", "scale": 11}], "loras.0.scale"),
                               ([{"name": "s1", "scale": float("nan")}], "loras.0.scale"),
                               ([{"name": "s1", "scale": "1"}], "loras.0.scale"), ([], "loras"),
                               ([{"name": "s1", "strength": 1}], "loras.0.strength"),
                               ([{"name": f"a{i}"} for i in range(9)], "loras")):
        answer = httpx.post(server.url + "/v1/images/generations", headers={**AUTH, "Content-Type": "application/json"},
                            content=json.dumps({"prompt": "4", "loras": loras_given}).encode())
        assert api_error(answer, 400)["param"] == param, answer.text
    assert api_error(post(server, "/v1/images/generations", {"prompt": "4", "lora": "s1", "loras": [{"name": "s2"}]}),
                     400)["param"] == "loras"

    answers = []
    with batches_held(server):
        waiting = threading.Thread(target=lambda: answers.append(post(
            server, "/v1/images/generations", {"prompt": "4", "loras": [{"name": "s1"}, {"name": "s2"}]})))
        waiting.start()
        deadline = time.monotonic() + 30
        while not server.queue.naming("s2"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        job_id = server.queue.naming("s2")[0].id
        for name in ("s1", "s2"):
            error = api_error(httpx.delete(f"{server.url}/v1/loras/{name}", headers=AUTH), 409)
            assert job_id in error["message"], error
    waiting.join(timeout=60)
    assert answers[0].status_code == 200, answers[0].text[:500]
    for name in ("s1", "s2"):
        assert httpx.delete(f"{server.url}/v1/loras/{name}", headers=AUTH).status_code == 200


@contextlib.contextmanager
def batches_held(server):
    """Inside, the sampling loop takes no job from the queue (it still ticks and carries out LoRA commands): requests
    wait there, as they would behind a long batch."""
    queue, held, entered = server.queue, threading.Event(), threading.Event()
    held.set()
    original = queue.next_batch

    def next_batch(timeout):
        if held.is_set():
            entered.set()
            time.sleep(0.05)
            return []
        return original(timeout)

    queue.next_batch = next_batch
    queue.wake()  # out of the original, which may be waiting for a job
    try:
        assert entered.wait(timeout=30)
        yield
    finally:
        held.clear()
        del queue.next_batch


def test_unloading_an_adapter_that_queued_jobs_name_is_refused(dit):
    """Issue 53: DELETE /v1/loras/<name> while a waiting request names the adapter once unloaded it, and the request's
    batch then failed on every rank (KeyError), killing the server. Now the unload is refused with 409 naming the jobs
    (and so is replacing the adapter under its name); the request is served with the adapter; once it is done the unload succeeds. A job that still names an adapter
    unloaded before its turn (accepted in the moment between the check and the unload) fails alone with a 409 job
    error, and the server serves on."""
    from ringdit.serve.bodies import ImageBody
    from ringdit.serve.jobs import Job
    from ringdit.serve.validate import sample_request

    server, _, loras, _ = dit
    write_adapter(loras / "busy.safetensors", server.module.model, seed=3)
    assert post(server, "/v1/loras", {"name": "busy", "path": "busy.safetensors"}).status_code == 200
    answers = []
    with batches_held(server):
        waiting = threading.Thread(target=lambda: answers.append(
            post(server, "/v1/images/generations", {"prompt": "5", "seed": 1, "lora": "busy"})))
        waiting.start()
        deadline = time.monotonic() + 30
        while not server.queue.naming("busy"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        job_id = server.queue.naming("busy")[0].id
        refused = httpx.delete(server.url + "/v1/loras/busy", headers=AUTH)
        error = api_error(refused, 409)
        assert error["param"] == "name" and "'busy'" in error["message"] and job_id in error["message"], error
        replaced = post(server, "/v1/loras", {"name": "busy", "path": "busy.safetensors"})  # a replacement
        assert api_error(replaced, 409)["param"] == "name"
    waiting.join(timeout=60)
    assert answers[0].status_code == 200, answers[0].text[:500]
    assert httpx.delete(server.url + "/v1/loras/busy", headers=AUTH).status_code == 200

    # the race's other side: a job accepted with the adapter, which is then unloaded before the job's turn
    assert post(server, "/v1/loras", {"name": "brief", "path": "busy.safetensors"}).status_code == 200
    request = sample_request(ImageBody(prompt="5", lora="brief"), "image", server)
    assert httpx.delete(server.url + "/v1/loras/brief", headers=AUTH).status_code == 200
    job = server.queue.submit(Job(request))
    assert job.done.wait(timeout=60)
    assert job.status == "failed" and job.error_code == 409 and "lora='brief' was unloaded" in job.error, job
    assert server.state == "ok" and post(server, "/v1/images/generations", {"prompt": "5"}).status_code == 200


def test_lora_commands_sent_together_are_all_answered(dit):
    """Two adapter loads that reach the sampling loop at one turn are both carried out and answered (the loop once
    took every waiting command and answered only the first: the other request waited out its timeout, then a 500)."""
    server, _, loras, _ = dit
    write_adapter(loras / "together.safetensors", server.module.model, seed=4)
    queue, entered, go_on = server.queue, threading.Event(), threading.Event()
    original = queue.next_batch

    def next_batch(timeout):  # the loop waits here, as behind a long batch, while both commands arrive
        entered.set()
        go_on.wait(timeout=30)
        return original(timeout)

    queue.next_batch = next_batch
    answers = {}
    threads = [threading.Thread(target=lambda name=name: answers.update({name: post(
        server, "/v1/loras", {"name": name, "path": "together.safetensors"}, timeout=30)})) for name in ("t1", "t2")]
    try:
        assert entered.wait(timeout=30)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(server.control._commands) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        del queue.next_batch
        go_on.set()
    for thread in threads:
        thread.join(timeout=60)
    assert {name: answer.status_code for name, answer in answers.items()} == {"t1": 200, "t2": 200}
    for name in ("t1", "t2"):
        assert httpx.delete(f"{server.url}/v1/loras/{name}", headers=AUTH).status_code == 200


def test_two_expert_adapters_equal_each_expert_merged(tmp_path):
    """A two-expert model (Wan 2.2 A14B) takes one adapter file per expert (path, path_2): with both applied, each
    transformer computes what it would with its adapter merged into its weights."""
    from safetensors.torch import save_file

    from ringdit.models.build import build_model
    from ringdit.commands.cli import model_preset
    from ringdit.serve.adapters import AdapterError, Adapters

    torch.manual_seed(0)
    model, _ = build_model(model_preset("wan22_a14b_tiny"))
    model = model.double()
    deltas = []
    for i, transformer in enumerate((model.transformer, model.transformer_2)):
        layer = dict(transformer.named_modules())["blocks.0.attn1.to_q"]
        down, up = torch.randn(2, layer.in_features).double(), torch.randn(layer.out_features, 2).double()
        save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": down,
                   "transformer.blocks.0.attn1.to_q.lora_B.weight": up}, str(tmp_path / f"e{i}.safetensors"))
        deltas.append((layer, 0.7 * up @ down))  # strength 0.7; no alpha in the file: alpha = rank, scale 1
    adapters = Adapters(model, "cpu")
    adapters.add(adapters.read(tmp_path, "pair", ["e0.safetensors", "e1.safetensors"]))
    with pytest.raises(AdapterError, match="2 transformer"):
        adapters.read(tmp_path, "three", ["e0.safetensors", "e1.safetensors", "e0.safetensors"])
    x = torch.randn(1, 4, 2, 16, 16, dtype=torch.float64)
    cond = {"text": torch.randn(1, 8, model.transformer.config.text_dim, dtype=torch.float64)}
    times = [torch.tensor([t], dtype=torch.float64) for t in (900.0, 100.0)]  # one on each expert's side
    with adapters.applied([("pair", 0.7)]):
        hooked = [model(x, t, cond) for t in times]
    with torch.no_grad():
        for layer, delta in deltas:
            layer.weight += delta
    for t, output in zip(times, hooked):
        merged = model(x, t, cond)
        torch.testing.assert_close(output, merged, rtol=0, atol=1e-12 * merged.abs().max().item())


def test_the_queue_bounds_batches_and_cancels():
    from ringdit.serve.jobs import CANCELLED, Job, JobQueue, QueueFull, SampleRequest

    def job(n=1, steps=4, seed=0):
        return Job(SampleRequest(kind="image", prompt="3", n=n, seed=seed, shape=(8, 8), size=(8, 8), frames=None,
                                 steps=steps, cfg_scale=1.0))

    queue = JobQueue(size=3, max_batch=4, batch_wait_s=0.0)
    jobs = [queue.submit(job(n=2)), queue.submit(job(steps=8)), queue.submit(job(n=2))]
    with pytest.raises(QueueFull):
        queue.submit(job())
    assert queue.next_batch(timeout=0.1) == [jobs[0], jobs[2]]  # one key, up to max_batch samples, in order
    assert queue.cancel(jobs[1].id).status == CANCELLED and queue.next_batch(timeout=0.05) == []


def test_refusals_before_anything_starts(dit, tmp_path):
    from ringdit.common.errors import ConfigError
    from ringdit.serve import Server

    ckpt = dit[1]
    for overrides, message in (
        (["host=0.0.0.0"], "listens beyond this machine and no api_key is set"),
        (["api_key=short"], "at least 8 characters"),
        (["lora_dir=/no/such/folder"], "lora_dir=/no/such/folder is not a folder"),
        (["max_batch=0"], "max_batch"),
        (["dp_degree=2", "trainer.devices=2"], "a server samples one batch at a time"),
    ):
        with pytest.raises(ConfigError, match=message):
            Server(compose_config("serve", tmp_path / "refused", f"ckpt_path={ckpt}", *overrides))
    Server(compose_config("serve", tmp_path / "allowed", f"ckpt_path={ckpt}", "host=0.0.0.0",
                          "allow_unauthenticated=true"))


# ---- served as a user starts it: ring 2 ----------------------------------------------------------------------------


@contextlib.contextmanager
def launched(run_dir: Path, *overrides: str):
    """``python -m ringdit.serve`` in its own process (its output in ``run_dir``.log); yields (process, url) once
    ready."""
    log = run_dir.with_suffix(".log")
    with open(log, "w") as output:
        proc = subprocess.Popen([sys.executable, "-m", "ringdit.serve", "port=0", f"hydra.run.dir={run_dir}",
                                 *overrides], cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                env=launch_environment(), start_new_session=True)
    try:
        yield proc, ready_url(run_dir, lambda: proc.poll() is None, lambda: log.read_text()[-3000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ready_url(run_dir: Path, alive=lambda: True, output=lambda: "") -> str:
    """The URL of the server writing ``run_dir`` once it answers /health (within 120 s, while ``alive()``)."""
    deadline, url = time.monotonic() + 120, None
    while url is None or not healthy(url):
        assert alive() and time.monotonic() < deadline, f"the server did not become ready:\n{output()}"
        if url is None and (run_dir / "server.json").is_file():
            url = json.loads((run_dir / "server.json").read_text())["url"]
        time.sleep(0.1)
    return url


def launch_environment() -> dict:
    """This worker's environment without what the in-process server's Lightning left in it (LOCAL_RANK, MASTER_*...),
    which the launched server would take for one rank of an external launch."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}, "HF_HUB_OFFLINE": "1"}


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


@pytest.fixture(scope="module")
def ti2v(models, tmp_path_factory):
    """A tiny Wan 2.2 TI2V (1 step) on prepared clips: text through the T5 encoder, videos through the VAE, the first
    frame given as an image."""
    from PIL import Image

    from ringdit.prepare import main as prepare

    root = tmp_path_factory.mktemp("serve_ti2v")
    clips = root / "clips"
    clips.mkdir()
    for i, caption in enumerate(["a red fox running", "a blue cat"]):
        write_video(clips / f"{i}.mp4", 9, seed=i, size=(48, 16))
        (clips / f"{i}.txt").write_text(caption)
    Image.fromarray(np.random.default_rng(9).integers(0, 256, (16, 48, 3), dtype=np.uint8)).save(root / "first.png")
    prepare([f"input={clips}", f"out={root / 'data'}", f"vae={models['wan']}", f"text_encoder={models['wan']}",
             "size=[16,48]", "frames=9", "max_text_len=8", "task=i2v"])
    run("train.py", root / "train", "experiment=wan_tiny", "model=wan22_ti2v_tiny", "model.config.in_channels=16",
        "model.config.out_channels=16", "data=text_latents", f"data.path={root / 'data'}", "data.batch_size=2",
        "data.val_fraction=0.5", "trainer.max_steps=1", "logger=csv", "scheduler=constant",
        "callbacks.model_checkpoint.every_n_train_steps=1", "trainer.val_check_interval=1")
    return root


def test_videos_at_ring_2_equal_infer_then_cancel_and_sigterm(ti2v):
    """Served at ring 2 (fp64), a video equals infer.py's on one process for the same prompt, first frame and seed; a
    long job is cancelled by DELETE; SIGTERM while a job runs: it finishes, new requests get 503, exit code 0."""
    ckpt = ti2v / "train" / "checkpoints" / "last.ckpt"
    common = [f"ckpt_path={ckpt}", "trainer.precision=64-true", "diffusion.sampling.steps=3",
              "diffusion.sampling.cfg_scale=2.0"]
    run("infer.py", ti2v / "infer", *common, "prompts=[a red fox running]", f"image={ti2v / 'first.png'}",
        "num_samples=1", "seed=11")
    expected = video_frames(ti2v / "infer" / "sample-000.mp4")
    image = base64.b64encode((ti2v / "first.png").read_bytes()).decode()
    with launched(ti2v / "serve", *common, "ring_degree=2", "max_steps=2000") as (proc, url):
        body = {"prompt": "a red fox running", "seed": 11, "image": image}
        job = httpx.post(url + "/v1/videos", json=body).json()
        while job["status"] not in ("completed", "failed"):
            time.sleep(0.1)
            job = httpx.get(f"{url}/v1/videos/{job['id']}").json()
        assert job["status"] == "completed" and job["progress"] == 100 and job["step"] == 3, job
        content = httpx.get(f"{url}/v1/videos/{job['id']}/content")
        assert content.headers["content-type"] == "video/mp4"
        np.testing.assert_array_equal(video_frames(content.content), expected)
        # step caching per request: threshold 0 never reuses (the same video); a high one reuses (counted)
        cached = httpx.post(url + "/v1/videos", json={**body, "cache": "fbcache", "cache_threshold": 0.0}).json()
        assert video_frames(finished_video(url, cached["id"])).tolist() == expected.tolist()
        before = httpx.get(url + "/v1/stats").json()["cache_reused"]
        finished_video(url, httpx.post(url + "/v1/videos", json={**body, "cache": "fbcache",
                                                                  "cache_threshold": 10.0}).json()["id"])
        assert httpx.get(url + "/v1/stats").json()["cache_reused"] > before

        refused = httpx.post(url + "/v1/videos", json={"prompt": "a blue cat"})  # image-to-video needs the image
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "image"

        long = httpx.post(url + "/v1/videos", json={**body, "steps": 2000}).json()
        while httpx.get(f"{url}/v1/videos/{long['id']}").json()["status"] != "in_progress":
            time.sleep(0.05)
        httpx.delete(f"{url}/v1/videos/{long['id']}")
        deadline = time.monotonic() + 30
        while (state := httpx.get(f"{url}/v1/videos/{long['id']}").json())["status"] == "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert state["status"] == "cancelled" and state["step"] < 2000

        running = httpx.post(url + "/v1/videos", json={**body, "steps": 40}).json()
        while httpx.get(f"{url}/v1/videos/{running['id']}").json()["status"] != "in_progress":
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        while (health := httpx.get(url + "/health")).json()["status"] == "ok":  # until the signal is handled
            time.sleep(0.01)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert httpx.post(url + "/v1/videos", json=body).status_code == 503
        # the running job finishes and the server exits 0 (0.2 s after the last job: a poll may find it gone)
        assert proc.wait(timeout=300) == 0  # generous: a loaded machine runs a step in a fraction of a second or less
        assert (ti2v / "serve" / "files" / f"{running['id']}-0.mp4").is_file()  # written before it completed
        assert f"{running['id']}: 1 video(s)" in (ti2v / "serve").with_suffix(".log").read_text()  # logged as done


def test_a_killed_rank_makes_the_server_answer_503_and_exit(dit, tmp_path):
    """A ring-2 server (its ranks forked as torchrun starts them; served as a user starts it: the test above) whose
    rank 1 is SIGKILLed answers 503 and exits non-zero within seconds."""
    from tests.distributed import run_command_ranks

    run_dir = tmp_path / "serve"
    timing = {}

    def kill_rank_1_when_serving(pids: list[int]) -> None:
        url = ready_url(run_dir)
        timing["killed"] = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 503:
                    break
            except httpx.TransportError:
                break  # already gone
            assert time.monotonic() - timing["killed"] < 10
            time.sleep(0.05)

    proc = run_command_ranks("-m ringdit.serve", ("port=0", f"hydra.run.dir={run_dir}", f"ckpt_path={dit[1]}",
                                                  "ring_degree=2"), 2, {"HF_HUB_OFFLINE": "1"}, timeout=120,
                             while_running=kill_rank_1_when_serving)
    assert proc.returncode == 1, proc.stderr[-3000:]  # rank 0's own code (rank 1's is -9): the server ended itself
    assert time.monotonic() - timing["killed"] < 15


# ---- OpenAI compatibility (issue 55): the openai client, seconds, uploads, the list, edits, /metrics -----------------


def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_the_openai_client_generates_images_and_unknown_fields_are_named(dit):
    """``images.generate`` of OpenAI's client: the same pixels as ringdit's own JSON request; OpenAI's fields ringdit
    has no use for (quality) are ignored and named in the headers; a misspelt field of ringdit's own, and stream=true,
    are refused by name (as OpenAI refuses a parameter it does not know)."""
    import openai

    server = dit[0]
    client = openai_client(server)
    raw = client.images.with_raw_response.generate(model="dit", prompt="3", n=2, size="8x8", quality="high",
                                                   response_format="b64_json", extra_body={"seed": 5})
    assert raw.headers["x-ringdit-ignored-fields"] == "quality" and "quality" in raw.headers["warning"]
    result = raw.parse()
    own = post(server, "/v1/images/generations", {"prompt": "3", "n": 2, "seed": 5})
    assert "x-ringdit-ignored-fields" not in own.headers
    np.testing.assert_array_equal(np.stack([pixels_of({"b64_json": item.b64_json}) for item in result.data]),
                                  np.stack([pixels_of(item) for item in own.json()["data"]]))
    for extra, param in (({"step": 3}, "step"), ({"stream": True}, "stream")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(prompt="3", extra_body=extra)
        assert refused.value.status_code == 400 and refused.value.body["param"] == param, refused.value.body
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_are_prometheus_text(dit):
    """GET /metrics: the queue, the engine's counts (equal to /v1/stats), latency histograms and answers per route, in
    Prometheus' text format as its own parser reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    server = dit[0]
    assert post(server, "/v1/images/generations", {"prompt": "2", "seed": 1}).status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 401  # behind the key, as every endpoint but /health
    stats = httpx.get(server.url + "/v1/stats", headers=AUTH).json()
    answer = httpx.get(server.url + "/metrics", headers=AUTH)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(answer.text) for s in family.samples}
    assert samples[("ringdit_batches_total", ())] == stats["batches"]
    assert samples[("ringdit_samples_total", ())] == stats["samples"]
    assert samples[("ringdit_model_evaluations_total", ())] == stats["model_evaluations"]
    assert samples[("ringdit_queue_waiting", ())] == 0 and samples[("ringdit_state", (("state", "ok"),))] == 1
    done = (("kind", "image"), ("status", "completed"))
    assert samples[("ringdit_job_seconds_count", done)] >= 1
    every = (("kind", "image"), ("le", "+Inf"), ("status", "completed"))
    assert samples[("ringdit_job_seconds_bucket", every)] == samples[("ringdit_job_seconds_count", done)]
    assert samples[("ringdit_batch_seconds_count", (("kind", "image"),))] == stats["batches"]
    assert samples[("ringdit_queue_wait_seconds_count", (("kind", "image"),))] >= 1
    assert samples[("ringdit_http_requests_total", (("code", "200"), ("route", "/v1/images/generations")))] >= 1
    assert samples[("ringdit_http_requests_total", (("code", "401"), ("route", "/metrics")))] >= 1


def test_edits_refuse_a_model_without_a_reference_image(dit):
    answer = httpx.post(dit[0].url + "/v1/images/edits", data={"prompt": "3"},
                        files={"image": ("a.png", png_bytes((8, 8)), "image/png")}, headers=AUTH)
    error = api_error(answer, 400)
    assert error["param"] == "model" and "not image-to-video" in error["message"]
    assert httpx.get(dit[0].url + "/health").status_code == 200


def png_bytes(size: tuple[int, int], seed: int = 0) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def ti2v_served(ti2v):
    """The tiny Wan 2.2 TI2V (24 fps, 1 + 4k frames) served in this process, 2 steps."""
    with serving(ti2v / "serve_openai", f"ckpt_path={ti2v / 'train' / 'checkpoints' / 'last.ckpt'}", f"api_key={KEY}",
                 "diffusion.sampling.steps=2") as server:
        yield server


def test_the_openai_client_makes_lists_and_downloads_videos_and_edits(ti2v, ti2v_served):
    """``videos.create`` of OpenAI's client (multipart: the first frame as input_reference, seconds as text) makes
    the video ringdit's own JSON request makes with frames and a base64 image: 0.3 s at the model's 24 fps is 7.2
    frames, and the nearest count Wan takes (1 + 4k) is 9. ``videos.retrieve`` follows it, ``download_content`` fetches
    the MP4, ``videos.list`` pages through the jobs; ``images.edit`` answers with that video's last frame."""
    import warnings

    server, png = ti2v_served, (ti2v / "first.png").read_bytes()
    client = openai_client(server)
    written = {}
    original = server.rank0.write

    def write(job, index, pixels, sound=None):  # the pixels each job's file is written from (its MP4 is lossy)
        written[job.id] = pixels.copy()
        return original(job, index, pixels, sound)

    server.rank0.write = write
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks the Videos API deprecated
            video = client.videos.create(prompt="a red fox running", input_reference=("first.png", png, "image/png"),
                                         seconds="0.3", size="48x16", extra_body={"seed": 11})
            assert video.status == "queued" and video.seconds == "0.375" and video.size == "48x16"
            deadline = time.monotonic() + 60
            while (video := client.videos.retrieve(video.id)).status in ("queued", "in_progress"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert video.status == "completed" and video.progress == 100 and video.model == server.model_name
            mp4 = client.videos.download_content(video.id).content
            own = post(server, "/v1/videos", {"prompt": "a red fox running", "frames": 9, "seed": 11,
                                              "image": base64.b64encode(png).decode()}).json()
            np.testing.assert_array_equal(video_frames(mp4), video_frames(finished_video(server.url, own["id"],
                                                                                         AUTH)))
            page = client.videos.list(limit=1)
            assert [v.id for v in page.data] == [own["id"]] and page.has_more
            assert [v.id for v in client.videos.list(limit=1)][:2] == [own["id"], video.id]  # newest first, paged
            assert [v.id for v in client.videos.list(order="asc")][-2:] == [video.id, own["id"]]
        edit = client.images.with_raw_response.edit(image=("first.png", png, "image/png"), prompt="a red fox running",
                                                    quality="high", extra_body={"seed": 11, "frames": 9})
        assert edit.headers["x-ringdit-ignored-fields"] == "quality"
        last = pixels_of({"b64_json": edit.parse().data[0].b64_json})
        np.testing.assert_array_equal(last, written[video.id][-1])  # the same video's last frame, exactly
    finally:
        del server.rank0.write


FIRST = base64.b64encode(png_bytes((16, 48))).decode()


@pytest.mark.parametrize("path, body, upload, param", [
    ("/v1/videos", {"seconds": "abc"}, None, "seconds"),
    ("/v1/videos", {"seconds": 0}, None, "seconds"),
    ("/v1/videos", {"seconds": -1.5}, None, "seconds"),
    ("/v1/videos", {"seconds": "nan"}, None, "seconds"),
    ("/v1/videos", {"seconds": "1e400"}, None, "seconds"),      # inf
    ("/v1/videos", {"seconds": True}, None, "seconds"),
    ("/v1/videos", {"seconds": 100}, None, "seconds"),          # 2400 frames, more than max_frames (the data's 9)
    ("/v1/videos", {"seconds": 0.375, "frames": 5}, None, "seconds"),  # 9 frames at 24 fps, not 5
    ("/v1/videos", {"second": 4}, None, "second"),              # a typo: refused, not ignored
    ("/v1/videos", {"seconds": "-2"}, "input_reference", "seconds"),   # multipart: the same checks
    ("/v1/videos", {"frames": "nine"}, "input_reference", "frames"),
    ("/v1/videos", {"loras": "fox"}, "input_reference", "loras"),  # a form's loras is JSON text
    ("/v1/videos", {"loras": '[{"name": "nope", "scale": 0.5}]'}, "input_reference", "loras.0.name"),
    ("/v1/videos", {"input_reference": "https://example.com/a.png"}, None, "input_reference"),  # nothing fetched
    ("/v1/videos", {}, "not an image", "input_reference"),
    ("/v1/images/edits", {}, "not an image", "image"),
    ("/v1/images/edits", {"mask": "x"}, "image", "mask"),
    ("/v1/images/edits", {"stream": "true"}, "image", "stream"),
])
def test_bad_openai_style_requests_name_the_field(ti2v_served, path, body, upload, param):
    """``seconds`` that is not a positive number, or disagrees with frames; a typo; an upload that is not an image: a
    400 whose error.param names the field, in JSON and in multipart alike; the server serves on."""
    server = ti2v_served
    body = {"prompt": "a red fox running", **body}
    if upload is None:
        answer = post(server, path, {**body, "image": FIRST} if "input_reference" not in body else body)
    else:
        field = "image" if path.endswith("edits") else "input_reference"
        content = b"%PDF-1.4 not an image" if upload == "not an image" else base64.b64decode(FIRST)
        answer = httpx.post(server.url + path, data={k: str(v) for k, v in body.items()},
                            files={field: ("first.png", content, "image/png")}, headers=AUTH, timeout=60)
    assert api_error(answer, 400)["param"] == param, answer.json()
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_video_list_refuses_bad_pages(ti2v_served):
    url = ti2v_served.url + "/v1/videos"
    assert api_error(httpx.get(url, params={"limit": 0}, headers=AUTH), 400)["param"] == "limit"
    assert api_error(httpx.get(url, params={"limit": "x"}, headers=AUTH), 400)["param"] == "limit"
    assert api_error(httpx.get(url, params={"order": "up"}, headers=AUTH), 400)["param"] == "order"
    assert api_error(httpx.get(url, params={"after": "job_0"}, headers=AUTH), 404)["param"] == "after"
    assert httpx.get(url, headers=AUTH).json()["object"] == "list"
