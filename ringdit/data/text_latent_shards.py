"""The ``data=text_latents`` format: the shards text-to-video / text-to-image models train on, written and checked.

On disk, ``data.path`` is one ``.safetensors`` file or a folder of them (shards, read in name order). Each shard
holds, for its N samples (one shape per shard: shards of different latent ``([T,] H, W)`` are the set's buckets,
and every training step reads one bucket; see ringdit/data/steps.py):

    latents     float  (N, C, T, H, W) video or (N, C, H, W) image latents, as the model consumes them (already
                       normalised with the VAE's scaling factor / mean / std; Flux.2's per channel of its 2x2
                       latent patches, then unpatchified: C = 32 at 1/8 of the pixels)
    text        float  (N, L, D)  the text encoder's last hidden states, zero-padded after each prompt to L tokens;
                       with prepare's prompt_template, the template's hidden layers joined per token (Flux.2: layers
                       10, 20, 30 of its Mistral3, D = 3 x 5120, every state kept and text_mask all True)
    text_mask   bool   (N, L)     True on real tokens (optional; default all True)
    pooled      float  (N, P)     a pooled text embedding, for models that take one (optional)
    glyph_text  float  (N, G, D_g)  HunyuanVideo 1.5's glyph text (optional; prepare's glyph_encoder): its ByT5's last
                       hidden states of the prompt's quoted text, G = 256 tokens, kept on the padding too; zero
                       where the prompt quotes nothing (HunyuanVideo15Pipeline's encoder_hidden_states_2)
    glyph_text_mask  bool  (N, G)  True on its real tokens; all False where the prompt quotes nothing (with
                       glyph_text, always both)
    audio_text  float  (N, L, D_a)  LTX-2's audio prompt states (optional; prepare's prompt_template=ltx2): its text
                       connectors' audio output, beside their video output in ``text``; ``text_mask`` is the mask of
                       both, as LTX2Pipeline hands it to the transformer
    null_text, null_text_mask, null_pooled, null_glyph_text, null_glyph_text_mask, null_audio_text   (1, ...)   the
                       EMPTY prompt's
                       embedding, used for the condition drop of classifier-free guidance and as the default negative
                       prompt (optional: zeros, all masked, if absent)

and, for image-to-video (optional, video latents only; ``python -m ringdit.prepare task=i2v`` writes them, by
ringdit/media/image_condition.py, which ``infer.py image=`` uses too; the condition drop keeps them):

    image_latents    float  (N, C, 1, H, W)  the clip's first frame encoded ALONE as a 1-frame video, normalised
                            like latents (Wan 2.2 TI2V's first latent frame: WanImageToVideoPipeline with
                            expand_timesteps; HunyuanVideo 1.5 I2V's condition latents)
    image_condition  float  (N, C, T, H, W)  the latents of [first frame ; zero frames] at the clip's frame count,
                            normalised like latents (Wan 2.1 I2V: the pipeline's latent_condition, without the mask)
    image_embeds     float  (N, N_img, D_img)  the first frame's image-encoder states (the pipeline's encode_image:
                            CLIP's penultimate hidden states for Wan 2.1 I2V, SigLIP's last hidden state for
                            HunyuanVideo 1.5 I2V; only when prepare is given image_encoder=)

and, for a control video (optional, video latents only; Wan VACE reads it; ``data=synthetic_text_latents
data.control=`` writes one, prepare does not; the condition drop keeps it):

    control          float  (N, C_ctrl, T, H, W)  the control video's latents at the clip's frames and size (Wan
                            VACE: WanVACEPipeline's [inactive ; reactive] latents and packed mask, vace_in_channels)

and, for a masked loss (optional; ``python -m ringdit.prepare mask_path=`` writes it, by ringdit/media/masks.py):

    loss_mask   float  (N, 1, [T,] H, W)  each latent cell's weight in the loss, in [0, 1] (0: ignored), on the
                       latents' grid; every shard of a set has one, or none

Text kept apart (what ``python -m ringdit.prepare`` writes): the shard holds the latents, the image keys and the loss
mask, and ``text/<its name>`` beside it the text keys (``text``, ``text_mask``, ``pooled``, the glyph text, the empty
prompt's ``null_*``) with the ``captions``, ``files`` and ``text_encoder`` metadata, so new captions or another text
encoder rewrite only the text file (ringdit/media/retext.py). A shard with a text file reads every text key from it;
one without reads them from itself.

and the metadata keys ``format`` (``ringdit.text_latents/1``) and, optionally, ``captions`` (a JSON list of N
strings) and ``vae`` (JSON: the VAE class, folder and per-channel ``shift`` / ``scale`` with latents =
(z - shift) * scale -- ``patch`` 2 (Flux.2): per channel of the 2x2-patchified z, C x 4 values --, written by
prepare so decoding can invert it; see ringdit/media/vae.py) and ``text_encoder`` (JSON: its folders, ``max_len``,
``masked``, and ``prompt_template`` / ``pooled_encoder`` / ``glyph_encoder`` where prepare was given them). Every
shard has the same C, L, D, P and (G, D_g), the same image keys and the same number of latent dims; T, H and W may
differ between shards (buckets). ``write_text_latents`` writes a shard; ``python -m ringdit.prepare`` makes them
from captioned media, and ``SyntheticTextLatentsDataModule`` makes a small procedural set for tests and CPU demos (no
download).

A sample is ``(latents (C, [T,] H, W), {"text": (L, D), "text_mask": (L,)[, "pooled": (P,)][, "glyph_text": (G, D_g),
"glyph_text_mask": (G,)][, the image keys][, "loss_mask": (1, [T,] H, W)]})``: the model reads the keys of its
family; the training loss reads ``loss_mask``.

This module holds the format: its writer, its reader with every check of a user's shard, and the prompt
reader; ringdit/data/text_latents.py reads folders of shards as a data module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ringdit.common.atomic import atomic_write
from ringdit.data.latents import count_nonfinite
from ringdit.common.errors import ConfigError
from ringdit.models.conditioning import GLYPH_KEYS, NULL_KEYS, SAMPLE_KEYS
from ringdit.common.safe_json import parse_json

FORMAT = "ringdit.text_latents/1"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
LAYOUT = ("a .safetensors file, or a folder of them, holding 'latents' (N, C, [T,] H, W) and 'text' (N, L, D), "
          "or the text in text/<the shard's name> beside it as prepare writes it (see "
          "ringdit/data/text_latent_shards.py)")
NULL_OF = {"null_text": "text (1, L, D)", "null_text_mask": "text_mask (1, L)", "null_pooled": "pooled (1, P)",
           "null_glyph_text": "glyph_text (1, G, D_g)", "null_glyph_text_mask": "glyph_text_mask (1, G)",
           "null_audio_text": "audio_text (1, L, D)"}
IMAGE_OF = {"image_latents": "the first frame encoded alone as a 1-frame video (Wan 2.2 TI2V, HunyuanVideo 1.5 I2V)",
            "image_condition": "the latents of [first frame ; zero frames] (Wan 2.1 I2V)",
            "image_embeds": "the image encoder's states (Wan 2.1 I2V with image_dim: CLIP's penultimate; "
                            "HunyuanVideo 1.5 I2V: SigLIP's last)",
            "control": "a control video's latents at the clip's frames and size (Wan VACE: vace_in_channels)",
            "audio": "the clip's sound as audio-VAE latents (LTX-2: (N, C_audio, L, mel bins))",
            "reference": "a reference image's latents at the image's size (Qwen-Image-Edit: the latents' shape)"}
MASK_KEY = "loss_mask"  # a masked loss's weights, optional, per sample (ringdit.media.masks writes them)
TEXT_DIR = "text"  # prepare's text cache: the text of shard-i.safetensors in text/shard-i.safetensors beside it
AUDIO_TEXT = "audio_text"  # LTX-2's audio prompt states, optional, per sample: (N, L, D_a)
TEXT_KEYS = ("text", "text_mask", "pooled", *GLYPH_KEYS, AUDIO_TEXT, *NULL_KEYS.values())  # what a text file holds

Tensor = torch.Tensor


def write_text_latents(path: str | Path, latents: Tensor, text: Tensor, text_mask: Tensor | None = None,
                       pooled: Tensor | None = None, null: dict[str, Tensor] | None = None,
                       captions: list[str] | None = None, metadata: dict[str, str] | None = None,
                       image: dict[str, Tensor] | None = None, glyph: dict[str, Tensor] | None = None,
                       loss_mask: Tensor | None = None, audio_text: Tensor | None = None) -> Path:
    """Write one shard (see the module docstring); ``null`` holds the empty prompt's ``text`` (L, D) [, mask, pooled,
    glyph_text (G, D_g), glyph_text_mask (G,)]; ``metadata`` adds string keys (prepare records ``vae``: the VAE's class
    and normalisation, as JSON); ``image`` the image-to-video and control conditioning, ``SAMPLE_KEYS`` (N, ...)
    each; ``glyph`` the glyph text, ``GLYPH_KEYS`` (N, ...) both; ``loss_mask`` the loss's weights (N, 1, [T,] H, W);
    ``audio_text`` LTX-2's audio prompt states (N, L, D_a)."""
    tensors = {"latents": latents, "text": text}
    if audio_text is not None:
        tensors[AUDIO_TEXT] = audio_text
    if text_mask is not None:
        tensors["text_mask"] = text_mask.bool()
    if pooled is not None:
        tensors["pooled"] = pooled
    unknown = sorted(set(image or {}) - set(SAMPLE_KEYS))
    if unknown:  # a misspelt key would be written and never read
        raise ValueError(f"write_text_latents: image holds {unknown}; its keys are {', '.join(SAMPLE_KEYS)}")
    tensors.update(image or {})
    if glyph and sorted(glyph) != sorted(GLYPH_KEYS):  # one without the other could not be read
        raise ValueError(f"write_text_latents: glyph holds {sorted(glyph)}; give both {', '.join(GLYPH_KEYS)}")
    tensors.update({key: value.bool() if key.endswith("mask") else value for key, value in (glyph or {}).items()})
    if loss_mask is not None:
        tensors[MASK_KEY] = loss_mask.float()
    for key, value in (null or {}).items():
        states = key in ("text", "glyph_text", "audio_text")  # (L, D) rows; the others (L,) or (P,)
        value = value.bool() if key.endswith("mask") else value
        tensors[NULL_KEYS[key]] = value.reshape(1, *value.shape[-(2 if states else 1):])
    metadata = dict(metadata or {})
    if captions is not None:
        metadata["captions"] = json.dumps(list(captions))
    return save_tensors(path, tensors, metadata)


def save_tensors(path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> Path:
    """``tensors`` to the .safetensors file ``path`` (its folder made), whole or not at all, marked as this format."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={**metadata, "format": FORMAT})
    return Path(path)


def text_file(path: Path) -> Path:
    """Where prepare keeps the text of the latent shard ``path``: ``text/<its name>`` beside it."""
    return path.parent / TEXT_DIR / path.name


class Shard:
    """One shard's headers: shapes and dtypes, read without loading the tensors. Its text comes from its text file
    (``text_file``) when there is one -- every text key from there, none from the latent file --, else from the latent
    file itself (shards written whole: ``write_text_latents``, and folders prepared before the text was kept apart)."""

    def __init__(self, path: Path):
        self.path = path
        self.file_of: dict[str, Path] = {}  # tensor -> the file that holds it
        self.shapes, self.dtypes, self.metadata = _header(path)
        self.file_of = dict.fromkeys(self.shapes, path)
        self.text_path = text_file(path) if text_file(path).is_file() else None
        if self.text_path is not None:
            shapes, dtypes, metadata = _header(self.text_path)
            for key in [key for key in self.shapes if key in TEXT_KEYS]:  # stale text of a re-captioned old shard
                del self.shapes[key], self.dtypes[key], self.file_of[key]
            texts = [key for key in shapes if key in TEXT_KEYS]
            self.shapes.update({key: shapes[key] for key in texts})
            self.dtypes.update({key: dtypes[key] for key in texts})
            self.file_of.update(dict.fromkeys(texts, self.text_path))
            if "files" in metadata and "files" in self.metadata and metadata["files"] != self.metadata["files"]:
                raise ConfigError(f"data.path: {self.text_path} holds the text of other samples than {path.name}; "
                                  f"run python -m ringdit.prepare over the folder again (it re-encodes only the "
                                  f"text), or delete {self.text_path}")
            self.metadata.update({key: metadata[key] for key in ("captions", "text_encoder") if key in metadata})
        self.check()
        where = f"data.path: {path}"
        self.captions = parse_captions(where, self.metadata["captions"], self.size) \
            if "captions" in self.metadata else None
        for key in ("vae", "text_encoder", "image_encoder", "bucket", "audio_vae"):  # what describe() hands on: decoding,
            if key in self.metadata:  # prompt encoding; prepare's bucket (its pixel size)
                parse_json_object(where, key, self.metadata[key])

    @property
    def size(self) -> int:
        return self.shapes["latents"][0]

    def check(self) -> None:
        where = f"data.path: {self.path}"
        for key in ("latents", "text"):
            if key not in self.shapes:
                raise ValueError(f"{where} has no tensor {key!r} (it holds {sorted(self.shapes)}); expected {LAYOUT}")
            if self.dtypes[key] not in FLOAT_DTYPES:
                raise ValueError(f"{where}: {key} is {self.dtypes[key]}; store floating-point values")
        latents, text = self.shapes["latents"], self.shapes["text"]
        if len(latents) not in (4, 5):
            raise ValueError(f"{where}: latents have shape {latents}; expected (N, C, H, W) or (N, C, T, H, W)")
        if len(text) != 3 or text[0] != latents[0]:
            raise ValueError(f"{where}: text has shape {text}; expected (N, L, D) with N = {latents[0]} as latents")
        if latents[0] == 0:
            raise ValueError(f"{where} holds no samples")
        for key, expected in (("text_mask", text[:2]), ("pooled", (latents[0], None))):
            shape = self.shapes.get(key)
            if shape is not None and (len(shape) != len(expected) or
                                      any(e is not None and s != e for s, e in zip(shape, expected))):
                raise ValueError(f"{where}: {key} has shape {shape}; expected {tuple(expected)} "
                                 f"(None = any)")
        pooled = self.shapes.get("pooled")
        for key, expected in (("null_text", (1, *text[1:])), ("null_text_mask", (1, text[1])),
                              ("null_pooled", (1, pooled[1]) if pooled else None)):
            shape = self.shapes.get(key)
            if shape is not None and shape != expected:
                wanted = f"{expected}, the empty prompt's {NULL_OF[key]}" if expected else \
                    "no null_pooled: the shard holds no pooled embeddings"
                raise ConfigError(f"{where}: {key} has shape {shape}; expected {wanted} (write the shard with "
                                  f"write_text_latents(..., null=...))")
        self.check_glyph()
        self.check_audio_text()
        self.check_images()
        self.check_loss_mask()

    def check_loss_mask(self) -> None:
        """The loss mask, where present: float (N, 1, [T,] H, W), one weight per latent cell."""
        shape, latents = self.shapes.get(MASK_KEY), self.shapes["latents"]
        wanted = (latents[0], 1, *latents[2:])
        if shape is not None and (shape != wanted or self.dtypes[MASK_KEY] not in FLOAT_DTYPES):
            raise ConfigError(f"data.path: {self.path}: {MASK_KEY} is {self.dtypes[MASK_KEY]} {shape}; expected float "
                              f"{wanted}, one weight in [0, 1] per latent cell (prepare's mask_path= writes it)")

    def check_glyph(self) -> None:
        """The glyph text, where present: ``glyph_text`` float (N, G, D_g) and ``glyph_text_mask`` (N, G), both or
        neither, and the empty prompt's (1, ...) of the same G, D_g."""
        where, count = f"data.path: {self.path}", self.size
        for pair in (GLYPH_KEYS, tuple(NULL_KEYS[key] for key in GLYPH_KEYS)):
            present = [key for key in pair if key in self.shapes]
            if len(present) == 1:
                missing = next(key for key in pair if key not in self.shapes)
                raise ConfigError(f"{where} holds {present[0]} but no {missing}; write both (write_text_latents(..., "
                                  f"glyph=..., null=...), as prepare's glyph_encoder does)")
        glyph = self.shapes.get("glyph_text")
        expected = {"glyph_text": (count, None, None), "glyph_text_mask": (count, glyph[1] if glyph else None),
                    "null_glyph_text": (1, *glyph[1:]) if glyph else None,
                    "null_glyph_text_mask": (1, glyph[1]) if glyph else None}
        for key, wanted in expected.items():
            shape = self.shapes.get(key)
            if shape is None:
                continue
            if wanted is None:
                raise ConfigError(f"{where} holds {key} but no glyph_text: the empty prompt's glyph text without the "
                                  f"samples'; write both (write_text_latents(..., glyph=..., null=...))")
            fits = len(shape) == len(wanted) and all(w is None or s == w for s, w in zip(shape, wanted))
            states = key.endswith("glyph_text")
            if not fits or (states and self.dtypes[key] not in FLOAT_DTYPES):
                raise ConfigError(f"{where}: {key} is {self.dtypes[key]} {shape}; expected {'float ' if states else ''}"
                                  f"{wanted} (None = any), {NULL_OF.get(key, 'the glyph text of each sample')}")

    def check_audio_text(self) -> None:
        """LTX-2's audio prompt states, where present: float (N, L, D_a) on the text's tokens, and the empty prompt's
        (1, L, D_a) only beside them."""
        where, (count, length) = f"data.path: {self.path}", self.shapes["text"][:2]
        audio = self.shapes.get(AUDIO_TEXT)
        for key, wanted in ((AUDIO_TEXT, (count, length, None)),
                            (NULL_KEYS[AUDIO_TEXT], (1, length, audio[2]) if audio else (1, length, None))):
            shape = self.shapes.get(key)
            if shape is None:
                continue
            fits = len(shape) == 3 and all(w is None or s == w for s, w in zip(shape, wanted))
            if not fits or self.dtypes[key] not in FLOAT_DTYPES:
                raise ConfigError(f"{where}: {key} is {self.dtypes[key]} {shape}; expected float {wanted} (None = "
                                  f"any), {NULL_OF.get(key, 'the audio prompt states of each sample')} on the text's "
                                  f"{length} tokens (prepare's prompt_template=ltx2 writes both)")

    @property
    def image_keys(self) -> tuple[str, ...]:
        """The per-sample conditioning this shard holds (``SAMPLE_KEYS``: image-to-video's, a control video's), in
        that order."""
        return tuple(key for key in SAMPLE_KEYS if key in self.shapes)

    def check_images(self) -> None:
        """The first-frame conditioning and the control video, where present, fit the latents (N, C, T, H, W):
        ``image_latents`` (N, C, 1, H, W), ``image_condition`` (N, C, T, H, W), ``image_embeds`` (N, N_img, D_img),
        ``control`` (N, C_control, T, H, W), ``audio`` (N, C_audio, L, mel bins); an image's ``reference`` the latents'
        own shape (N, C, H, W)."""
        latents = self.shapes["latents"]
        expected = {"image_latents": (*latents[:2], 1, *latents[3:]), "image_condition": latents,
                    "image_embeds": (latents[0], None, None), "control": (latents[0], None, *latents[2:]),
                    "audio": (latents[0], None, None, None), "reference": latents}
        for key in self.image_keys:
            shape, wanted = self.shapes[key], expected[key]
            videos = len(latents) == 5 or key == "reference"  # an image's reference has the image latents' shape
            fits = videos and len(shape) == len(wanted) and self.dtypes[key] in FLOAT_DTYPES and \
                all(w is None or s == w for s, w in zip(shape, wanted))
            if key == "audio" and len(latents) != 5:  # sound beside an image: no clip for it to go with
                raise ConfigError(f"data.path: {self.path} holds audio latents {shape} beside image latents {latents}, "
                                  f"but sound goes with a clip's video latents (N, C, T, H, W); prepare videos with "
                                  f"their sound (python -m ringdit.prepare audio_vae=...), or drop 'audio' from it")
            if not fits:
                raise ConfigError(f"data.path: {self.path}: {key} is {self.dtypes[key]} {shape}; expected float "
                                  f"{wanted} (None = any) for latents {latents}: {IMAGE_OF[key]}")

    def check_values(self) -> None:
        """Every floating-point tensor (latents, text, pooled, null_*, a float text_mask, any other) holds only
        finite values: read ``CHUNK_BYTES`` at a time (ringdit.data.latents), so a shard larger than RAM is checked
        too. A NaN here would surface as a NaN loss many steps later, looking like a learning-rate problem."""
        from safetensors import safe_open

        found, bad = [], []
        for key in sorted(self.shapes, key=lambda k: (k not in ("latents", "text"), k)):
            dtype, shape = self.dtypes[key], self.shapes[key]
            if not (dtype in FLOAT_DTYPES or dtype.startswith("F8")):
                continue
            with safe_open(str(self.file_of[key]), framework="pt") as f:
                rows = f.get_slice(key) if shape else f.get_tensor(key).reshape(1)  # a 0-d tensor: one row
                values, bad_rows, first = count_nonfinite(rows, shape[0] if shape else 1, tuple(shape[1:]))
                if values:
                    found.append(key)
                    several = shape and shape[0] > 1  # not the empty prompt's (1, ...) tensors: one row
                    where = f" in {bad_rows} of its {shape[0]} rows (the first: row {first})" if several else ""
                    bad.append(f"{key} {shape} holds {values} NaN or Inf values{where}")
        if MASK_KEY in self.shapes and not found:  # weights outside [0, 1] (a 0-255 mask) would rescale the loss
            with safe_open(str(self.path), framework="pt") as f:
                weights = f.get_tensor(MASK_KEY)
            if weights.numel() and (weights.min() < 0 or weights.max() > 1):
                raise ConfigError(f"data.path: {self.path}: {MASK_KEY} holds weights from {weights.min().item()} to "
                                  f"{weights.max().item()}; a loss mask's are in [0, 1] (0: ignored, 1: trained): "
                                  f"divide 0-255 masks by 255, or prepare them with mask_path=")
        if found:
            empty = [key for key in found if key.startswith("null_")]
            fixes = (["re-encode those samples or drop them"] if len(empty) < len(found) else []) \
                + (["encode the empty prompt again (null_*)"] if empty else [])
            raise ConfigError(f"data.path: {self.path}: {'; '.join(bad)}; {', and '.join(fixes)} (an encoder may "
                              f"have overflowed, e.g. in float16)")

    def layout(self) -> tuple:
        """What must agree across shards: latent channels and dims, text (L, D), pooled (P,) and glyph text (G, D_g)
        shapes. The latent ``([T,] H, W)`` may differ: each shape is a bucket."""
        latents, text = self.shapes["latents"], self.shapes["text"]
        pooled, glyph = self.shapes.get("pooled"), self.shapes.get("glyph_text")
        return (latents[1], len(latents) - 2), text[1:], pooled[1:] if pooled else None, \
            glyph[1:] if glyph else None  # (C, [T,] H, W dims), (L, D), (P,), (G, D_g)

    @property
    def bucket(self) -> tuple[int, ...]:
        """The latent ``([T,] H, W)`` of every sample in this shard."""
        return tuple(self.shapes["latents"][2:])

    def read(self, keys: tuple[str, ...], start: int, stop: int) -> dict[str, Tensor]:
        from safetensors import safe_open

        values = {}
        for file in dict.fromkeys(self.file_of[key] for key in keys if key in self.shapes):
            with safe_open(str(file), framework="pt") as f:
                values.update({key: f.get_slice(key)[start:stop] for key in keys if self.file_of.get(key) == file})
        return values


def _header(path: Path) -> tuple[dict, dict, dict]:
    """A .safetensors file's shapes, dtypes and metadata, without its tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
            dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}  # noqa: SIM118
            return shapes, dtypes, f.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"data.path: {path} is not a readable .safetensors file ({error})") from None


def condition_of(values: dict[str, Tensor], row: int) -> dict[str, Tensor]:
    """The conditioning dict of one row: text (L, D) float32, text_mask (L,) bool [, pooled (P,)] [, glyph_text
    (G, D_g) float32, glyph_text_mask (G,) bool] [, the image and control keys (SAMPLE_KEYS) float32]."""
    text = values["text"][row].float()
    mask = values["text_mask"][row].bool() if "text_mask" in values else torch.ones(text.shape[0], dtype=torch.bool)
    cond = {"text": text, "text_mask": mask}
    if "pooled" in values:
        cond["pooled"] = values["pooled"][row].float()
    if "glyph_text" in values:
        cond["glyph_text"] = values["glyph_text"][row].float()
        cond["glyph_text_mask"] = values["glyph_text_mask"][row].bool()
    if AUDIO_TEXT in values:  # LTX-2's audio prompt states (L, D_a)
        cond[AUDIO_TEXT] = values[AUDIO_TEXT][row].float()
    for key in (*SAMPLE_KEYS, MASK_KEY):
        if key in values:
            cond[key] = values[key][row].float()
    return cond


def parse_captions(where: str, text: str, count: int) -> list[str]:
    """The ``captions`` metadata: a JSON list of ``count`` strings, one per sample, else a ``ConfigError``."""
    fix = f"store json.dumps(captions), a list of {count} strings, one per sample (or leave the key out)"
    captions = _json_metadata(where, "captions", text, list, fix)
    odd = next((i for i, c in enumerate(captions) if not isinstance(c, str)), None)
    if odd is not None:
        raise ConfigError(f"{where}: captions[{odd}] is {captions[odd]!r} ({type(captions[odd]).__name__}), not a "
                          f"string; {fix}")
    if len(captions) != count:
        raise ConfigError(f"{where}: the captions metadata lists {len(captions)} captions for {count} samples; {fix}")
    return captions


def parse_json_object(where: str, key: str, text: str) -> dict:
    return _json_metadata(where, key, text, dict, "it is written by python -m ringdit.prepare: prepare the shard "
                                                  "again, or leave the key out")


def _json_metadata(where: str, key: str, text: str, kind: type, fix: str):
    """Metadata entry ``key``: JSON of type ``kind`` (list or dict), else a ``ConfigError`` that ends with ``fix``."""
    value = parse_json(text, f"{where}: the {key} metadata", fix=fix, excerpt=True)
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: the {key} metadata is a JSON {type(value).__name__}, not "
                          f"{'a list' if kind is list else 'an object'}; {fix}")
    return value


def read_prompts(path: str, setting: str = "text_embeds") -> tuple[dict[str, Tensor], list[str] | None]:
    """Prompt embeddings from a file in this format (``latents`` not needed; a prepared shard's from its text file):
    ``text`` (N, L, D) [+ ``text_mask``, ``pooled``, ``glyph_text`` and ``glyph_text_mask``] and the ``captions``
    metadata if present. Returns the conditioning batch and the captions."""
    from safetensors import SafetensorError, safe_open

    file = Path(os.path.expanduser(str(path)))
    if file.is_file() and text_file(file).is_file():  # a prepared shard: its text is in its text file
        file = text_file(file)
    if not file.is_file() or file.suffix != ".safetensors":
        raise ValueError(f"{setting}={path} is not a .safetensors file; give one holding text (N, L, D) embeddings "
                         f"(and optionally text_mask (N, L), pooled (N, P)): a text_latents shard works")
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            if "text" not in keys:
                raise ValueError(f"{setting}={path} has no tensor 'text' (it holds {sorted(keys)})")
            values = {key: f.get_tensor(key) for key in ("text", "text_mask", "pooled", *GLYPH_KEYS, AUDIO_TEXT)
                      if key in keys}
            metadata = f.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"{setting}={path} is not a readable .safetensors file ({error})") from None
    if values["text"].dim() != 3 or not values["text"].is_floating_point():
        raise ValueError(f"{setting}={path}: text has shape {tuple(values['text'].shape)} "
                         f"({values['text'].dtype}); expected float (N, L, D)")
    for key, value in values.items():
        if value.is_floating_point() and not (finite := torch.isfinite(value)).all():
            where = f" in {int((~finite).flatten(1).any(dim=1).sum())} of its {len(value)} rows" if value.dim() > 1 \
                else ""
            raise ConfigError(f"{setting}={path}: {key} {tuple(value.shape)} holds {int((~finite).sum())} NaN or Inf "
                              f"values{where}; encode those prompts again")
    count = values["text"].shape[0]
    conds = [condition_of(values, row) for row in range(count)]
    captions = parse_captions(f"{setting}={path}", metadata["captions"], count) if "captions" in metadata else None
    return {key: torch.stack([c[key] for c in conds]) for key in conds[0]}, captions
