"""A request body checked against the served model and the server's bounds: the ``SampleRequest`` a job samples,
or a ``BadRequest`` naming the field."""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import secrets
import tempfile
from pathlib import Path

from ringdit.common.errors import ConfigError
from ringdit.media.frames import probe
from ringdit.models.conditioning import text_conditioned
from ringdit.sampling import resolve_labels
from ringdit.serve.bodies import DECIMAL, MAX_IMAGE_BYTES, BadRequest, ImageBody
from ringdit.serve.jobs import SampleRequest

SIZE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")  # ASCII digits only: "\uff18x\uff18" is not a size
CLASS_ID = re.compile(r"[0-9]{1,9}")  # a class-conditional prompt that is not a class name: ASCII digits only
MAX_STRENGTH = 10.0  # an adapter's strength: past it a sample is noise, and float16 activations overflow


def sample_request(body: ImageBody, kind: str, server, reference: tuple[str, bytes | None] = ("image", None),
                   last_frame: bool = False, control: bytes | None = None) -> SampleRequest:
    """``body`` checked against the model and the server's bounds (``BadRequest`` naming the field); ``reference``:
    (its field, the uploaded first frame or None); ``control``: the uploaded control clip, or None."""
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
    loras = adapter_choices(body, server)
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
    # a multipart body holds one part per name (ringdit.serve.bodies): the clip is the file or the base64 text
    clip = control_clip(control if control is not None else getattr(body, "control", None), server, size, frames)
    return SampleRequest(kind=kind, prompt=prompt, n=body.n, seed=seed, shape=tuple(shape), size=size,
                         frames=frames, steps=steps, cfg_scale=float(cfg_scale),
                         negative_prompt=body.negative_prompt or None, loras=loras,
                         cache=cache, image=image, control=clip, last_frame=last_frame,
                         fps=fps if kind == "video" else None, model=server.model_name)


def adapter_choices(body: ImageBody, server) -> tuple[tuple[str, float], ...]:
    """The request's run-time adapters as (name, strength) pairs, stacked in the order given: ``lora`` with
    ``lora_scale`` (one), or ``loras`` ([{name, scale}, ...]: several); each resident, named once, its strength a
    finite number in [-MAX_STRENGTH, MAX_STRENGTH]."""
    if body.loras is not None and (body.lora is not None or "lora_scale" in body.model_fields_set):
        raise BadRequest("loras", "give the adapters either as lora (one, with lora_scale) or as loras (several: "
                                  "[{\"name\": ..., \"scale\": ...}, ...]), not both")
    if body.lora is None and body.loras is None and "lora_scale" in body.model_fields_set:
        raise BadRequest("lora_scale", "lora_scale is the strength of the adapter named by lora; give lora too")
    if body.loras is None:
        given = [(body.lora, body.lora_scale, "lora", "lora_scale")] if body.lora is not None else []
    else:
        given = [(choice.name, choice.scale, f"loras.{i}.name", f"loras.{i}.scale")
                 for i, choice in enumerate(body.loras)]
    loaded = server.engine.adapters.loaded if server.engine.adapters is not None else {}
    seen = set()
    for name, scale, name_field, scale_field in given:
        if not (math.isfinite(scale) and -MAX_STRENGTH <= scale <= MAX_STRENGTH):
            raise BadRequest(scale_field, f"{scale_field}={scale} must be a finite number in [-{MAX_STRENGTH:g}, "
                                          f"{MAX_STRENGTH:g}]")
        if name in seen:
            raise BadRequest(name_field, f"{name_field}={name!r}: the adapter is named twice; name each once, at the "
                                         f"sum of the strengths you meant")
        seen.add(name)
        if name not in loaded:
            raise BadRequest(name_field, f"{name_field}={name!r} is not loaded (POST /v1/loras first; GET /v1/loras "
                                         f"lists them)")
    return tuple((name, float(scale)) for name, scale, _, _ in given)


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
            what = "the image to edit" if server.image_kind == "reference" else "the first frame"
            raise BadRequest(field, f"this model takes an image: give {what} as base64 in image (or upload it as the "
                                    f"file {'input_reference' if field == 'image' else field})")
        return None
    if not needs:
        raise BadRequest(field, "this model takes no image (it is not image-to-video)")
    data = file_bytes(data, field)
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


def file_bytes(data: str | bytes, field: str) -> bytes:
    """An uploaded file's bytes as they are, or base64 text (a ``data:`` URL's too) decoded."""
    if isinstance(data, bytes):
        return data
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest(field, f"{field}: more than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(field, f"{field} is not base64") from None


def control_clip(data: str | bytes | None, server, size: tuple[int, int], frames: int | None,
                 field: str = "control") -> bytes | None:
    """A control-video model's control clip (Wan VACE) -- base64 text, or an uploaded file's bytes -- checked from its
    headers, as infer.py control= checks its file, to be a video of exactly the samples' frames and size (a clip is
    never cropped or resized: it would condition on other frames than were asked for)."""
    family = server.control_family
    if data is None:
        if family is not None:
            raise BadRequest(field, f"this model denoises under a control video (model.family={family.name}): give "
                                    f"the clip of the samples' frames and size as base64 in {field} (or upload it as "
                                    f"the file {field})")
        return None
    if family is None:
        raise BadRequest(field, f"this model takes no control video (it is not a control-video model: "
                                f"model.family={server.spec.model.config.get('family')}); leave {field} out")
    data = file_bytes(data, field)
    with tempfile.TemporaryDirectory() as folder:  # PyAV reads a file: the clip is written where nothing else is
        path = Path(folder) / "control"
        path.write_bytes(data)
        try:
            height, width, count = probe(path, is_video=True)
        except Exception as problem:  # noqa: BLE001 - PyAV raises its own errors for bytes it cannot read
            raise BadRequest(field, f"{field} is not a readable video ({type(problem).__name__}); give an MP4, "
                                    f"WebM or GIF file") from None
    if (height, width, count) != (*size, frames):
        raise BadRequest(field, f"{field} has {count} frames of {width}x{height} but the samples have {frames} frames "
                                f"of {size[1]}x{size[0]}: a control clip is the samples' own frames and size; ask for "
                                f"frames={count} size=\"{width}x{height}\", or give a clip of {frames} frames at "
                                f"{size[1]}x{size[0]}")
    return data
