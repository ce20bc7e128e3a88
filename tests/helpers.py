"""What the test modules share: the repository paths, a tiny training run's overrides, running train.py / infer.py
(in this process when the run is one process, else on ranks forked from the fork server; or train.py's checks and
setup alone: ``prepare_train``), builders of small inputs (images, latents, videos, a tiny DiT, a tiny Wan folder,
tiny LTX-Video / HunyuanVideo 1.5 VAEs, a tiny Qwen2.5-VL text encoder), a safetensors file's header and bytes
(``split``) with the parallel VAE's tile (``TILE``), and the flow sampler's time grid: diffusers' scheduler's sigmas
(``scheduler_sigmas``) and the times a run samples at (``sampled_grid``). Fixtures live in conftest.py. Importing it
makes Hydra compose each command once (``_compose_once_per_command``)."""

from __future__ import annotations

import copy
import functools

import contextlib
import csv
import io
import json
import os
import re
import runpy
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from ringdit.models import DiT
from ringdit.models.protocol import KindDefaults

REPO = Path(__file__).resolve().parents[1]


def _compose_once_per_command() -> None:
    """Hydra in the tests' processes, which compose configs hundreds of times, without two costs of each command:
    ``get_mode``, which composes the whole config once more before the run only to read ``hydra.mode`` (None, as it
    finds it when no override sets it: no config in conf/ does, test_vocabulary), and parsing each YAML file again
    in every composition (each file is parsed once, keyed by its path, size and time, and handed out as a copy, as
    Hydra mutates what it loads). Together a third of a tiny train.py run here. Set up when this module is imported:
    in every pytest worker and in its fork server, whose forked ranks run the commands of several ranks."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins
    from hydra.plugins.config_source import ConfigResult

    get_mode = Hydra.get_mode

    def run_mode(hydra, config_name, overrides):
        if any(override.lstrip("+~").startswith("hydra.mode") for override in overrides):
            return get_mode(hydra, config_name, overrides)
        return None

    def parsed_once(load_config):
        parsed = {}

        def load_parsed_config(source, config_path: str) -> ConfigResult:
            path = Path(str(source.path), source._normalize_file_name(config_path))
            try:
                stat = path.stat()
                key = (type(source), path, stat.st_size, stat.st_mtime_ns)
            except OSError:  # a package's resource (Hydra's own configs): as unchanging as the package
                key = (type(source), path)
            if key not in parsed:
                parsed[key] = load_config(source, config_path)
            result = parsed[key]
            return ConfigResult(config=copy.deepcopy(result.config), path=result.path, provider=result.provider,
                                header=dict(result.header))

        return load_parsed_config

    Hydra.get_mode = run_mode
    Plugins.instance()  # its scan defines the config sources' classes anew: patch the ones it registered
    for scheme in ("file", "pkg"):
        source = SourcesRegistry.instance().resolve(scheme)
        source.load_config = parsed_once(source.load_config)


_compose_once_per_command()


CONF = REPO / "conf"
# what a launched rank reads to join a run; a run in this process that Lightning launched leaves them behind
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                    "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


# A model and run small enough for seconds per run on 2 cores; 16 tokens per sample (8x8 digits, 2x2 patches).
TINY = [
    "model.hidden_size=32", "model.depth=2", "model.num_heads=4", "data.batch_size=16", "trainer.max_steps=3",
    "logger=csv", "callbacks.sample_grid.steps=2", "callbacks.sample_grid.per_class=1",
    "callbacks.model_checkpoint.every_n_train_steps=2", "scheduler=constant",
]


def run(script: str, run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 300):
    """Run train.py / infer.py with ``overrides``; fail with its output if it fails. A run of one process runs in this
    process (``in_process``: the same entry point, without a new interpreter's seconds of imports); one of several
    ranks on one node runs them forked from the test's fork server, each as torchrun starts a rank
    (``tests.distributed.run_command_ranks``), once this process composed its settings and found them several; one
    on several nodes runs in a subprocess, as a user starts it."""
    from tests.distributed import run_command_ranks

    overrides = (f"hydra.run.dir={run_dir}", *overrides)
    environment = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    try:
        proc, _ = in_process(script, *overrides, env=environment, one_process=True)
    except SeveralProcesses as several:
        if several.ranks:
            proc = run_command_ranks(script, overrides, several.ranks, environment, timeout)
        else:
            proc = subprocess.run([sys.executable, script, *overrides], cwd=REPO, capture_output=True, text=True,
                                  timeout=timeout, env={**os.environ, **environment})
    assert proc.returncode == 0, (f"{script} {' '.join(overrides)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                                  f"\n{proc.stderr[-5000:]}")
    return proc


class SeveralProcesses(Exception):
    """A command run by ``in_process(..., one_process=True)`` whose settings start several processes: ``ranks`` on one
    node (Lightning's ``trainer.devices``, resolved), None on several nodes. Raised once its config is composed,
    before its run folder or its task."""

    def __init__(self, ranks: int | None):
        super().__init__(f"{ranks or 'several nodes of'} processes")
        self.ranks = ranks


def _one_process_only(run_job):
    """Hydra's ``run_job``, refusing a job of several processes (``SeveralProcesses``); a config whose ranks do not
    resolve runs, for the command to report its error as it does."""

    def run_one_process(*, config, **kwargs):
        try:
            devices, nodes = int(config.trainer.devices), int(config.trainer.get("num_nodes") or 1)
        except Exception:  # noqa: BLE001 - the command reports it
            devices, nodes = 1, 1
        if (devices, nodes) != (1, 1):
            raise SeveralProcesses(devices if nodes == 1 else None)
        return run_job(config=config, **kwargs)

    return run_one_process


def in_process(script: str, *overrides: str, env: dict | None = None,
               one_process: bool = False) -> tuple[SimpleNamespace, float]:
    """``python script overrides`` (train.py / infer.py; ``-m ringdit.prepare``: a module) run in this process, as
    its command line would: argument parsing, composition, the checks, the run, the one-line report and the exit
    code. Returns (``returncode``, ``stdout``, ``stderr``) and the seconds it took. The process is left as it was:
    ``sys.argv``, the environment (``env`` is added for the run), the working directory, Hydra's global state and the
    warning filters; warnings are written to its stderr, each time, as a new interpreter writes them.
    ``one_process``: a run whose settings start several processes raises ``SeveralProcesses`` instead of running."""
    from hydra._internal import hydra as hydra_run
    from hydra.core.global_hydra import GlobalHydra

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    saved_argv, saved_env = sys.argv, dict(os.environ)
    module = script[3:] if script.startswith("-m ") else None
    sys.argv = [module or str(REPO / script), *overrides]
    os.environ.update({"WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "", **(env or {})})
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), contextlib.chdir(REPO), \
                warnings.catch_warnings(), mock.patch.object(hydra_run, "run_job",
                                  _one_process_only(hydra_run.run_job) if one_process else hydra_run.run_job):
            warnings.simplefilter("default")  # a fresh process's filters: each warning once per run, not per worker
            warnings.showwarning = show
            if module:  # as ``python -m module``; runpy's warning that this process imported it before is ours
                warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package",
                                        RuntimeWarning)
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:  # as ``python script``: Hydra finds conf/
                runpy.run_path(str(REPO / script), run_name="__main__")
    except SeveralProcesses:
        raise
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except Exception:  # noqa: BLE001 - a crash: exit code 1 and its traceback, as the interpreter reports it
        code = 1
        stderr.write(traceback.format_exc())
    finally:
        seconds = time.monotonic() - start
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue()), seconds


class LazyRuns:
    """train.py runs, one per named layout, each started the first time a test asks for it (``runs.trained("ring2")``):
    a test selected alone, or the default selection without the slow layouts, pays only for the runs it reads."""

    def __init__(self, root: Path, layouts: dict[str, list[str]], *common: str, env: dict | None = None):
        self.root, self.layouts, self.common, self.env, self.done = root, layouts, common, env, set()

    def trained(self, name: str) -> Path:
        """The run folder of layout ``name``, after training it (once)."""
        if name not in self.done:
            run("train.py", self.root / name, *self.common, *self.layouts[name], env=self.env)
            self.done.add(name)
        return self.root / name


def logged_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


def distill_losses(run_dir: Path, *names: str) -> dict[int, tuple[float, ...]]:
    """A distillation run's (the student's loss, the critic's last loss[, the other ``names`` logged]) per student
    step, from its csv/metrics.csv."""
    names = ("train/loss", "train/critic_loss", *names)
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): tuple(float(row[name]) for name in names)
                for row in csv.DictReader(f) if row.get("train/loss")}


def model_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


SGD = ["optimizer=sgd", "optimizer.lr=0.5"]


FAST_FAIL_SECONDS = 30  # generous for a loaded CI machine; these runs stop before any rank is spawned


def launch(script: str, *overrides: str, timeout: int = 240) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": ""}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, script, *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    return proc, time.monotonic() - start


def tiny_dit(video=False, **overrides) -> DiT:
    """A 2-block DiT for one device (its attention: the default backend, torch_flash on CPU); ``parallelize`` it for
    another backend or a mesh."""
    config = dict(input_size=(4, 8, 8) if video else 8, patch_size=2, in_channels=3, hidden_size=64, depth=2,
                  num_heads=4, num_classes=10, learn_sigma=True)
    if video:
        config["temporal_patch_size"] = 2
    config.update(overrides)
    torch.manual_seed(0)
    model = DiT(**config)
    # adaLN-Zero starts as the identity: perturb the zeroed layers so every parameter gets a gradient
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and p.abs().sum() == 0:
                p.normal_(std=0.05)
    return model


def original_dit_state_dict_shapes(depth, hidden, heads, patch, input_size=32, in_channels=4, num_classes=1000):
    """Key -> shape of a facebookresearch/DiT checkpoint, written out from the published models.py (timm
    PatchEmbed/Attention/Mlp, learn_sigma=True, class_dropout_prob=0.1), independent of ringdit's classes."""
    shapes = {
        "pos_embed": (1, (input_size // patch) ** 2, hidden),
        "x_embedder.proj.weight": (hidden, in_channels, patch, patch),
        "x_embedder.proj.bias": (hidden,),
        "t_embedder.mlp.0.weight": (hidden, 256),
        "t_embedder.mlp.0.bias": (hidden,),
        "t_embedder.mlp.2.weight": (hidden, hidden),
        "t_embedder.mlp.2.bias": (hidden,),
        "y_embedder.embedding_table.weight": (num_classes + 1, hidden),
        "final_layer.linear.weight": (patch * patch * in_channels * 2, hidden),
        "final_layer.linear.bias": (patch * patch * in_channels * 2,),
        "final_layer.adaLN_modulation.1.weight": (2 * hidden, hidden),
        "final_layer.adaLN_modulation.1.bias": (2 * hidden,),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        shapes |= {
            b + "attn.qkv.weight": (3 * hidden, hidden),
            b + "attn.qkv.bias": (3 * hidden,),
            b + "attn.proj.weight": (hidden, hidden),
            b + "attn.proj.bias": (hidden,),
            b + "mlp.fc1.weight": (4 * hidden, hidden),
            b + "mlp.fc1.bias": (4 * hidden,),
            b + "mlp.fc2.weight": (hidden, 4 * hidden),
            b + "mlp.fc2.bias": (hidden,),
            b + "adaLN_modulation.1.weight": (6 * hidden, hidden),
            b + "adaLN_modulation.1.bias": (6 * hidden,),
        }
    return shapes


def solid(colour, size=(12, 10), mode="RGB") -> Image.Image:
    return Image.new(mode, size, colour)


def write_classes(root, counts: dict[str, int], size=(12, 10)) -> None:
    """root/<class>/<i>.png, class k's images filled with grey level 40 * k."""
    for k, (name, count) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            solid((40 * k,) * 3, size).save(root / name / f"{i}.png")


def write_latents(path, latents, labels, names=None, fmt="safetensors"):
    """``latents`` / ``labels`` as numpy arrays, in either layout; returns data.path."""
    if fmt == "safetensors":
        file = path / "latents.safetensors"
        metadata = {"class_names": json.dumps(names)} if names is not None else None
        tensors = {"latents": torch.from_numpy(np.ascontiguousarray(latents)),
                   "labels": torch.from_numpy(np.ascontiguousarray(labels))}
        save_file(tensors, file, metadata=metadata)
        return file
    folder = path / "latents"
    folder.mkdir()
    np.save(folder / "latents.npy", latents)
    np.save(folder / "labels.npy", labels)
    if names is not None:
        (folder / "class_names.json").write_text(json.dumps(names))
    return folder


GOOD = np.zeros((10, 4, 8, 8), np.float32)


LABELS = np.arange(10) % 2


WAN = ["experiment=wan_tiny", "data.num_samples=64", "data.batch_size=4", "trainer.max_steps=3", "logger=csv",
       "scheduler=constant", "optimizer=sgd", "optimizer.lr=0.5", "callbacks.model_checkpoint.every_n_train_steps=2",
       "trainer.val_check_interval=3"]


def save_tiny_wan(folder, seed: int = 3) -> dict[str, torch.Tensor]:
    import diffusers
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load("conf/model/wan_tiny.yaml").config)
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel.from_config(config)
    model.save_pretrained(folder / "transformer")
    return model.state_dict()


def architecture(preset: str) -> dict:
    """The diffusers architecture config of ``conf/model/<preset>.yaml`` (``wan_tiny``, ``flux_tiny``, ...): tests
    build the models users get, not copies of them. A fresh dict each call (callers may change theirs)."""
    return copy.deepcopy(_preset_config(preset))


@functools.cache
def _preset_config(preset: str) -> dict:
    from ringdit.commands.cli import model_preset

    return model_preset(preset)["config"]


WORDS = ["<pad>", "</s>", "<unk>", "a", "red", "fox", "running", "blue", "cat", "sky", "green", "field"]


TEXT_LEN = 8


def write_video(path: Path, frames: int, seed: int = 0, size=(32, 24)) -> None:
    """A random H.264 clip of ``frames`` frames, ``size`` = (width, height)."""
    from ringdit.media.writing import write_mp4

    rng = np.random.default_rng(seed)
    write_mp4(rng.integers(0, 256, (frames, size[1], size[0], 3), dtype=np.uint8), path, fps=8)


def read_mp4(path: Path) -> np.ndarray:
    """Every frame of a video file, uint8 (T, H, W, 3). PyAV directly: imageio's PyAV plugin ends each file with a
    full garbage collection, ~0.25 s in a test process that has imported diffusers and transformers."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def first_frame(path: Path) -> Image.Image:
    """A clip's first frame as decoded, before any crop."""
    return Image.fromarray(read_mp4(path)[0])


def tiny_video_vae(name: str, folder: Path):
    """A tiny random VAE of each family, saved to ``folder``; LTX's latents_mean / latents_std (buffers, in its
    weights) and scaling factor set away from 0 / 1 / 1 so that the normalisation is seen; CogVideoX's with 4 blocks
    (8x spatial, 4x temporal, as the real one), 4 latent channels and CogVideoX 1.5's scaling factor 0.7."""
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLHunyuanVideo15, AutoencoderKLLTXVideo

    torch.manual_seed(0)
    if name == "cogvideox":
        model = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                       norm_num_groups=4, temporal_compression_ratio=4, scaling_factor=0.7)
    elif name == "ltx":
        model = AutoencoderKLLTXVideo(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
            patch_size=1, patch_size_t=1, scaling_factor=0.7)
        model.latents_mean.copy_(torch.randn(8) * 0.1)
        model.latents_std.copy_(torch.rand(8) + 0.5)
    else:
        model = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(16, 16, 16), layers_per_block=1,
                                            spatial_compression_ratio=4, temporal_compression_ratio=2,
                                            scaling_factor=1.03682)
    model.save_pretrained(folder)
    return model.eval()


def save_tiny_qwen(folder: Path) -> None:
    """HunyuanVideo 1.5's text encoder, tiny and random: a Qwen2.5-VL text model (hidden 16, 3 layers) in
    ``folder/text_encoder`` and the word-level tokenizer in ``folder/tokenizer``, with a chat template whose system
    part is exactly the 108 tokens HunyuanVideo15Pipeline cuts off (Qwen's is), then the prompt."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from ringdit.media.text import chat_template, word_level_tokenizer

    torch.manual_seed(0)
    Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    )).save_pretrained(folder / "text_encoder")
    template = chat_template("hunyuan_video15")
    tokenizer = word_level_tokenizer(WORDS)
    filler = template.crop - len(tokenizer(template.system, add_special_tokens=False).input_ids)
    assert filler >= 0
    tokenizer.chat_template = "{{ messages[0]['content'] }}" + " a" * filler + " {{ messages[1]['content'] }} </s>"
    tokenizer.save_pretrained(folder / "tokenizer")


def qwen_tokenizer(template: str):
    """A word-level fast tokenizer that splits Qwen-Image's prompt string as Qwen's BPE does at the template: the
    special tokens whole, each word, punctuation mark and newline one token -- so the template's tokens before the
    prompt are its 34 (checked in the test) -- and adds no special tokens, as Qwen2Tokenizer."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pieces = sorted(set(re.findall(r"\w+|[^\w\s]|\n", re.sub(r"<\|\w+\|>", " ", template))) - set(WORDS))
    vocab = {word: i for i, word in enumerate([*special, *WORDS, *pieces])}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\n"), behavior="removed", invert=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", unk_token="<unk>",
                                   additional_special_tokens=special[1:])
    return fast, len(vocab)


def save_tiny_qwenimage_encoder(root: Path) -> Path:
    """A Qwen-Image-shaped folder: text_encoder/ (a tiny random Qwen2_5_VLForConditionalGeneration, built from a tiny
    Qwen2.5-VL config as transformers' own tests build theirs) and tokenizer/ (``qwen_tokenizer``)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ringdit.media.text import chat_template

    tokenizer, vocab = qwen_tokenizer(chat_template("qwenimage").text)
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                       "fullatt_block_indexes": [0]},
        image_token_id=vocab + 1, video_token_id=vocab + 2, vision_start_token_id=vocab + 3)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")
    return root


def save_tiny_hunyuan_video15(root: Path, *, glyph: bool = False, image: bool = False) -> Path:
    """A HunyuanVideo 1.5 pipeline folder of tiny random models: vae/ (4 latent channels, 4x spatial, 2x temporal),
    text_encoder/ + tokenizer/ (Qwen2.5-VL, hidden 16, in the pipeline's template); ``glyph``: text_encoder_2/ +
    tokenizer_2/ (a T5EncoderModel of width 8 over ByT5Tokenizer's 384 byte ids, built without a download);
    ``image``: image_encoder/ (a SiglipVisionModel of width 12, 2 layers: its last hidden state, after the final
    norm, is not the penultimate one) and feature_extractor/ (its SiglipImageProcessor, 32 px), as the published
    folders name them."""
    from transformers import (ByT5Tokenizer, SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel, T5Config,
                              T5EncoderModel)

    tiny_video_vae("hunyuan_video15", root / "vae")
    save_tiny_qwen(root)
    if glyph:
        tokenizer = ByT5Tokenizer()
        torch.manual_seed(1)
        T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=8, d_ff=16, d_kv=4, num_layers=2,
                                num_heads=2)).save_pretrained(root / "text_encoder_2")
        tokenizer.save_pretrained(root / "tokenizer_2")
    if image:
        torch.manual_seed(2)
        SiglipVisionModel(SiglipVisionConfig(hidden_size=12, intermediate_size=24, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=32, patch_size=8)
                          ).save_pretrained(root / "image_encoder")
        SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "feature_extractor")
    return root


def save_tiny_flux2(root: Path) -> Path:
    """A Flux.2-shaped pipeline folder: vae/ (a tiny random AutoencoderKLFlux2 of 2 latent channels, batch-norm
    statistics set away from 0 / 1 so the normalisation is seen), text_encoder/ (a tiny random
    Mistral3ForConditionalGeneration with the 30 layers Flux2Pipeline reads) and tokenizer/ (the word-level tokenizer
    with a chat template over the pipeline's content parts: the system message, then the prompt)."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from ringdit.media.text import word_level_tokenizer

    channels = 2
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=channels,
                             norm_num_groups=4, layers_per_block=1)
    vae.bn.running_mean.copy_(torch.randn(4 * channels) * 0.1)
    vae.bn.running_var.copy_(torch.rand(4 * channels) + 0.5)
    vae.save_pretrained(root / "vae")
    Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=MistralConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=64),
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=2)).save_pretrained(root / "text_encoder")
    tokenizer = word_level_tokenizer(WORDS)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'][0]['text'] }} {% endfor %}"
    tokenizer.save_pretrained(root / "tokenizer")
    return root


# the VAE tile of the tile-parallel prepare tests (tests/test_prepare_parallel_vae.py, tests/test_prepare_i2v.py)
TILE = 32  # pixels, stride 24: a 48 x 64 frame is 2 x 3 = 6 tiles, 3 per rank


def split(path: Path) -> tuple[dict, bytes]:
    """A safetensors file as (its JSON header, parsed; the tensors' bytes)."""
    import json
    import struct

    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + length]), data[8 + length:]


def fail_fast(script: str, *overrides: str) -> tuple[SimpleNamespace, float]:
    """``in_process`` for settings that must be refused before any rank starts: the same code path as ``launch``
    without paying for a new interpreter each time. A run that is not refused would train here: use ``launch`` for
    anything that should start."""
    return in_process(script, *overrides)


def tiny_wan_pipeline(config: dict, z_dim: int, experts: list | None = None):
    """A tiny two-expert ``WanPipeline`` (T5 encoder, word-level tokenizer, a Wan VAE of ``z_dim`` latent channels,
    UniPC at flow shift 3, boundary 0.875): ``experts`` (two transformers), else two random ones of ``config``."""
    import diffusers
    from transformers import T5Config, T5EncoderModel

    from ringdit.media.text import word_level_tokenizer

    experts = experts or [diffusers.WanTransformer3DModel.from_config(config) for _ in range(2)]
    return diffusers.WanPipeline(
        tokenizer=word_level_tokenizer(WORDS),
        text_encoder=T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=16, d_ff=32, d_kv=4, num_layers=1,
                                             num_heads=2)),
        vae=diffusers.AutoencoderKLWan(base_dim=3, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                       temperal_downsample=[False, True, True]),
        scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                    flow_shift=3.0),
        transformer=experts[0], transformer_2=experts[1], boundary_ratio=0.875)


def compose_config(config_name: str, run_dir: Path, *overrides: str):
    """``conf/<config_name>.yaml`` composed with ``overrides`` as the command would (its run folder ``run_dir``)."""
    from ringdit.commands.cli import command_config

    return command_config(config_name, overrides, run_dir)


def compose_train(overrides: list[str], run_dir: Path):
    """The config ``python train.py overrides`` would run with, composed in this process, with Hydra's own config set
    as a run has it (``HydraConfig``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from ringdit.commands.cli import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def prepare_train(overrides: list[str], run_dir):
    """train.py's checks and setup (``train.prepare``) in this process: what a launch does before spawning."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    import train

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        cfg.paths.output_dir = str(run_dir)
        return train.prepare(cfg)


def assert_refused(proc, message: str | None = None, *, text: str | None = None, seconds: float | None = None,
                   run_dir: Path | None = None) -> str:
    """``proc`` (``fail_fast``'s, ``launch``'s or a subprocess's result) is a run refused before any rank started: exit
    code 2, one ``Error: ...`` line -- matching the regex ``message``, or holding ``text`` verbatim -- and no
    traceback, nothing spawned, within ``FAST_FAIL_SECONDS`` (given ``seconds``), no checkpoint under ``run_dir``.
    Returns the error line. The one check for "refused before spawning", whatever the command."""
    output = f"{proc.stderr}{proc.stdout}"
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    if message is not None:
        assert re.search(message, errors[0]), errors[0]
    if text is not None:
        assert text in errors[0], errors[0]
    assert "Initializing distributed" not in output  # no rank was started
    if seconds is not None:
        assert seconds < FAST_FAIL_SECONDS, f"refused after {seconds:.1f} s"
    if run_dir is not None:
        assert not (run_dir / "checkpoints").exists()
    return errors[0]

def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the ranks a launcher spawned), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def assert_same_numbers(actual, expected, *, rtol: float = 0.0, atol: float = 0.0, of_max: float = 0.0,
                        where: str = "") -> None:
    """``actual`` -- computed under another layout, strategy or process count -- equals ``expected`` (one device, or
    the reference layout) element-wise up to ``atol + rtol * |expected| + of_max * max|expected|``.

    Tensors, or dicts of named tensors (weights, gradients): then every key must be on both sides, and a None (a
    parameter no loss reaches, e.g. QwenImage's last text-stream MLP) on one side must be None on the other, for at
    most a quarter of the entries. Each test says why its tolerances hold where it calls this.
    """
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: other keys {sorted(actual.keys() ^ expected.keys())[:5]}"
        unused = {key for key, value in expected.items() if value is None}
        assert unused == {key for key, value in actual.items() if value is None}, f"{where}: other entries are None"
        assert len(unused) <= len(expected) // 4, f"{where}: most entries are None: {sorted(unused)[:5]}"
        for key, value in expected.items():
            if value is not None:
                assert_same_numbers(actual[key], value, rtol=rtol, atol=atol, of_max=of_max, where=f"{where} {key}")
        return
    expected = expected.detach()
    if not expected.is_floating_point():  # integer and bool buffers (a text mask): exactly equal
        assert torch.equal(actual, expected), f"{where}: {actual} != {expected}"
        return
    bound = atol + rtol * expected.abs() + of_max * expected.abs().max()
    error = (actual.detach() - expected).abs()
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (f"{where}: |difference| {error.flatten()[worst].item():.3g} > allowed "
                                         f"{bound.flatten()[worst].item() if bound.dim() else bound.item():.3g} "
                                         f"(max |expected| {expected.abs().max().item():.3g})")


def scheduler_sigmas(config: dict, steps: int, mu: float | None = None) -> torch.Tensor:
    """The sigmas (float64, ending in 0) of diffusers' FlowMatchEulerDiscreteScheduler of ``config`` after
    ``retrieve_timesteps(scheduler, steps, sigmas=linspace(1, 1 / steps, steps), mu=mu)``, as LTXPipeline and
    Flux2Pipeline call it."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import retrieve_timesteps

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    retrieve_timesteps(scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas.double()


class VelocityIsX(KindDefaults, torch.nn.Module):  # the model contract's defaults, as every kind
    """A model whose velocity is its input and that records the sigma of each call: each Euler step then multiplies x
    by 1 + (t_next - t), so a sample over its noise is the product of these over the whole grid, the last step to 0
    included."""

    in_channels = 1

    def __init__(self, patch_shape: tuple[int, ...]):
        super().__init__()
        self.patch_shape, self.sigmas = patch_shape, []

    def model_condition(self, condition):
        return condition

    def forward(self, x, t, condition):
        self.sigmas.append(t[0].item() / 1000)
        return x


def sampled_grid(overrides: list[str], shape: tuple[int, ...], patch: tuple[int, ...], steps: int) -> torch.Tensor:
    """The times 1 .. 0 (float64) that ``Sampler.generate`` steps through for one sample of ``shape`` (latent
    cells; ``patch`` cells a token) in ``steps`` Euler steps, in a run of train.py's config with ``overrides``: its
    objective and sampling settings resolved as train.py resolves them (the model family's defaults), the shift as
    the module computes it for the sample's token count. Checked against the samples: ``VelocityIsX``."""
    import math

    from hydra import compose, initialize_config_dir

    from ringdit.diffusion import initial_noise
    from ringdit.spec.diffusion import training_diffusion
    from ringdit.sampling import Sampler

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    tokens = math.prod(s // p for s, p in zip(shape, patch))
    objective, sampling = training_diffusion(cfg, {"_target_": cfg.model._target_, "family": cfg.model.family}, tokens)
    model = VelocityIsX(patch)
    sampler = Sampler.for_run(model, objective, sampling, {"image_size": list(shape), "latent_scale": 1.0})
    samples = sampler.generate({"text": torch.zeros(1, 1)}, [0], shape=shape, steps=steps, cfg_scale=1.0)
    noise = initial_noise((1, *shape), [0])
    times = torch.tensor([*model.sigmas, 0.0], dtype=torch.float64)
    factor = torch.prod(1 + times.diff()).item()
    torch.testing.assert_close(samples, noise * factor, rtol=1e-5, atol=0)  # the sampler stepped through these
    return times


def served_video(ckpt, run_dir, prompt: str, *, seed: int, steps: int, size: int, frames: int, extra=()) -> bytes:
    """The MP4 ``python -m ringdit.serve ckpt_path=ckpt`` returns for one video request (a server in this process)."""
    import threading

    import httpx

    from ringdit.serve import Server

    saved = dict(os.environ)  # Lightning leaves LOCAL_RANK, MASTER_* behind, which later launches would read
    server = Server(compose_config("serve", run_dir, f"ckpt_path={ckpt}", "port=0",
                                   f"diffusion.sampling.steps={steps}", f"size=[{size},{size}]", f"frames={frames}",
                                   *extra))
    server.build()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while server.state != "ok":
            assert thread.is_alive()
            time.sleep(0.02)
        job = httpx.post(server.url + "/v1/videos", json={"prompt": prompt, "size": f"{size}x{size}",
                                                          "frames": frames, "seed": seed}).json()
        while job["status"] in ("queued", "in_progress"):
            time.sleep(0.05)
            job = httpx.get(f"{server.url}/v1/videos/{job['id']}").json()
        assert job["status"] == "completed", job
        return httpx.get(f"{server.url}/v1/videos/{job['id']}/content").content
    finally:
        server.drain()
        thread.join(timeout=60)
        os.environ.clear()
        os.environ.update(saved)


def read_prepared(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A prepared shard's tensors and metadata, its text file's (``text/<its name>`` beside it) in place of any text
    inside it, as ``data=text_latents`` reads them."""
    from safetensors import safe_open

    from ringdit.data.text_latent_shards import TEXT_KEYS, text_file

    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {key: f.get_tensor(key) for key in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
    if text_file(Path(path)).is_file():
        with safe_open(str(text_file(Path(path))), framework="pt") as f:
            tensors = {**{k: v for k, v in tensors.items() if k not in TEXT_KEYS},
                       **{key: f.get_tensor(key) for key in f.keys()}}  # noqa: SIM118
            text_metadata = f.metadata() or {}
        metadata.update({key: text_metadata[key] for key in ("captions", "text_encoder") if key in text_metadata})
    return tensors, metadata


def sampling_encoding(described: dict, prompts: list[str], *, text_len: int, text_dim: int) -> tuple[dict, dict]:
    """(the prompts' conditions (N, ...), the empty prompt's (1, ...)) as a sampling run encodes them for a model
    trained on data whose text encoder ``described`` records (``TextEncoder.describe()``): ``data_text_encoder`` at the
    data's length and width, through ``Codecs.encode`` -- what infer.py, the previews, the server and ringdit.load
    call."""
    from ringdit.media.text import data_text_encoder
    from ringdit.sampling.sampler import Codecs

    data = {"text_len": text_len, "text_dim": text_dim, "text_encoder": described}
    codecs = Codecs(text_encoder=data_text_encoder(data, described["path"], described.get("tokenizer")))
    return codecs.encode(prompts), codecs.encode([""])
