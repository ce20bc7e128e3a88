"""The real-model recipes (conf/experiment/<model>_<task>.yaml): each composes, its header's planner command builds
the model on the meta device at the recipe's real shapes and recommends the layout the recipe sets (so the memory it
quotes is the planner's), and its tiny twin -- the same settings on the family's tiny architecture and synthetic
latents, on one process -- trains a few steps.

The recipe pages (docs/recipes/*.md) show the presets and nothing else: every ``train.py`` command on them is
``experiment=<preset>`` plus the model folder, the data and the run folder (the same line as the preset's header),
the tiny twin runs the page's own train and export commands, and every row of a page's settings table ("Settings of
`experiment=X`") holds the value X composes to."""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ringdit.commands.cli import CONF_DIR, register_resolvers
from tests.helpers import REPO, TEXT_LEN, architecture, fail_fast, in_process, read_mp4, run, solid, write_video

# recipe -> its tiny twin: the family's tiny architecture and synthetic latents it reads (one process, CPU)
IMAGES = ["data.frames=0", "data.channels=1"]
TWINS = {
    "wan21_1_3b_lora": ["model=wan_tiny"],
    "wan21_1_3b_full": ["model=wan_tiny"],
    "wan21_14b_lora": ["model=wan_tiny"],
    "wan21_14b_full": ["model=wan_tiny"],
    "wan22_ti2v_5b_lora": ["model=wan22_ti2v_tiny", "data.image=true"],
    "wan22_a14b_t2v_lora": ["model=wan22_a14b_tiny"],
    "wan22_a14b_i2v_lora": ["model=wan22_i2v_a14b_tiny", "data.image=true"],
    "hunyuan_video15_t2v_lora": ["model=hunyuan_video15_tiny"],
    "hunyuan_video15_i2v_lora": ["model=hunyuan_video15_i2v_tiny", "data.image=true", "data.image_dim=12"],
    "ltx_video_lora": ["model=ltx_video_tiny"],
    "skyreels_v2_lora": ["model=skyreels_v2_tiny"],
    "flux_dev_lora": ["model=flux_tiny", *IMAGES, "data.text_dim=32", "data.pooled_dim=32",
                      "model.config.guidance_embeds=true"],  # FLUX.1-dev is guidance-distilled, the tiny one not
    "flux2_lora": ["model=flux2_tiny", *IMAGES, "data.text_dim=32", "lora.base_dtype=null"],
    "qwenimage_lora": ["model=qwenimage_tiny", "data.frames=0", "data.channels=4", "data.text_dim=16"],
    "cogvideox15_lora": ["model=cogvideox15_tiny", "data.frames=4"],
    "qwenimage_edit_2511_lora": ["model=qwenimage_edit_tiny", "data.frames=0", "data.channels=4", "data.text_dim=16",
                                 "data.reference=true", "+model.config.zero_cond_t=true"],
    "wan21_vace_1_3b_lora": ["model=wan_vace_tiny", "data.control=72"],
    "ltx2_lora": ["model=ltx2_tiny", "data.audio=[2,5,2]"],
    # its sizes are latent cells (data.latent=false), which synthetic latents are already: 3 = 5 x 0 + 3 frames
    "minimax_h3_lora": ["model=minimax_h3_tiny", "data.audio=[2,3,8]", "data.frames=3", "data.size=6",
                        "~data.latent"],
}
# the recipe pages of the presets (dit.md: the original class-conditional checkpoints, no preset; index.md: the list)
PAGES = sorted(page for page in (REPO / "docs" / "recipes").glob("*.md") if page.name not in ("index.md", "dit.md"))
# what a page's train command may add to experiment=<preset>: where the model, the data (one folder, or several with
# their repeats) and the run are
PLACES = {"model.pretrained", "data.path", "data.datasets", "hydra.run.dir"}


def twin_sizes(name: str) -> list[str]:
    """The synthetic latents' sizes in place of the preset's clips' (``data.size`` / ``data.frames``: pixels of the
    real clips): 8 x 8 latents, 3 frames for a video model, unless the twin says otherwise."""
    return [word for word in ("data.size=8", "data.frames=3")
            if not any(w.startswith(word.split("=")[0] + "=") for w in TWINS[name])]


def page_commands(script: str) -> list[tuple[str, list[str]]]:
    """(page, words after ``script``) of every command running ``script`` in the recipe pages' shell blocks."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^```bash[^\n]*\n(.*?)^```", page.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line.split(" #")[0]) if line.strip() and not line.lstrip().startswith("#") else []
                if script in words:
                    found.append((page.name, words[words.index(script) + 1:]))
    return found


def page_train_command(name: str) -> list[str]:
    """The overrides of the recipe page's train command for preset ``name``."""
    (words,) = [w for _, w in page_commands("train.py") if f"experiment={name}" in w]
    return words


def page_exports(run_dir: str) -> list[list[str]]:
    """The recipe pages' export commands of the run in ``run_dir`` (their ``ckpt_path`` lies in it)."""
    return [words for _, words in page_commands("ringdit.export")
            if any(word.startswith(f"ckpt_path={run_dir}/") for word in words)]


def compose_preset(name: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"experiment={name}"])


def settings_tables() -> list[tuple[str, list[str], list[tuple[str, str]]]]:
    """(page, presets, [(setting, ours)]) of each "Settings of `experiment=X`, ..." table on the recipe pages."""
    tables = []
    for page in PAGES:
        for title, table in re.findall(r"^#+ Settings of (.*)\n\n((?:\|.*\n)+)", page.read_text(), re.M):
            rows = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in table.splitlines()[2:]]
            tables.append((page.name, re.findall(r"`experiment=(\w+)`", title),
                           [(row[0].strip("`"), row[1].strip("`")) for row in rows]))
    return tables


def recipe_header(name: str) -> tuple[list[str], dict]:
    """The planner command a recipe's header quotes, and the layout it says the planner recommends."""
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    command = re.search(r"# Layout: `python -m ringdit\.plan ([^`]+)` recommends (dp=\d+ ring=\d+ ulysses=\d+ \w+)",
                        text)
    assert command, f"{name}.yaml quotes no planner command"
    return shlex.split(command.group(1)), dict(pair.split("=") for pair in command.group(2).split()[:3]) | {
        "strategy": command.group(2).split()[3]}


def test_every_real_model_has_a_recipe_with_sources():
    assert sorted(TWINS) == sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")
                                   if "Sources of the settings" in p.read_text())


def test_every_command_on_the_recipe_pages_is_a_preset():
    """One recipe per model: each train command on the pages is ``experiment=<preset>`` and where things are, the
    line the preset's header quotes; every preset has one."""
    commands = page_commands("train.py")
    shown = []
    for page, words in commands:
        (preset,) = [w.split("=", 1)[1] for w in words if w.startswith("experiment=")] or [None]
        assert preset in TWINS, f"{page}: train.py {' '.join(words)} is not experiment=<a real preset>"
        extra = {w.split("=", 1)[0] for w in words} - PLACES - {"experiment"}
        assert not extra, f"{page}: the {preset} command sets {sorted(extra)} beside the preset: put them in it"
        # the header's shell line as its words (a quoted override, data.datasets=[...], without its quotes)
        header = (CONF_DIR / "experiment" / f"{preset}.yaml").read_text().replace("\\\n#", " ").replace("'", "")
        assert " ".join(["train.py", *words]) in " ".join(header.split()), f"{preset}.yaml's header quotes another command"
        shown.append(preset)
    assert sorted(shown) == sorted(TWINS), "each preset has exactly one train command on the recipe pages"


def test_every_settings_table_holds_what_its_presets_compose():
    tables = settings_tables()
    assert sorted({p for _, presets, _ in tables for p in presets}) == sorted(TWINS), "a preset has no settings table"
    for page, presets, rows in tables:
        for name in presets:
            cfg = compose_preset(name)
            for setting, ours in rows:
                value = OmegaConf.select(cfg, setting, default="<unset>")
                value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
                expected = yaml.safe_load(ours)
                if isinstance(expected, str) and isinstance(value, float):
                    expected = float(expected)  # 1e-4: YAML 1.1 reads it as a string
                assert value == expected, f"{page}: {name} composes {setting}={value!r}, its table says {ours}"


def index_row(name: str) -> list[str]:
    """The cells of preset ``name``'s row in docs/recipes/index.md's table of recipes."""
    (row,) = [line for line in (REPO / "docs" / "recipes" / "index.md").read_text().splitlines()
              if line.startswith(f"| `{name}` |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_recipe_is_laid_out_as_the_planner_recommends(name, capsys):
    """The header's planner command (``experiment=<name>``: the preset itself, at its clips' size) recommends the
    layout the recipe sets, with the memory and the previews' cost the header and the recipe index say."""
    from ringdit.plan import main as plan

    arguments, quoted = recipe_header(name)
    assert arguments == [f"experiment={name}"]
    assert plan(arguments) == 0
    printed = capsys.readouterr().out
    recommended = re.search(r"^Recommended: dp=(\d+) ring=(\d+) ulysses=(\d+) (\w+).*? -- ([\d.]+) of", printed,
                            re.M)
    assert recommended, printed[-2000:]
    dp, ring, ulysses, strategy, peak = recommended.groups()
    assert {"dp": dp, "ring": ring, "ulysses": ulysses, "strategy": strategy} == quoted
    assert "(the preset's own layout is the recommendation)" in printed
    assert f"-- {peak} of" in (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    preview = re.search(r"^Previews \(callbacks.sample_grid: (\d+) samples.*?about ([\d.]+) GiB per rank with the "
                        r"training state, fits; ~(\d+) s each", printed, re.M)
    assert preview, printed[-1000:]
    row = index_row(name)
    layout = " x ".join([f"dp {dp}", *([f"ring {ring}"] if ring != "1" else []),
                         *([f"ulysses {ulysses}"] if ulysses != "1" else [])]) + f", {strategy.upper()}"
    assert row[2:5] == [layout, f"{peak} GiB", "{} samples, {} GiB, ~{} s".format(*preview.groups())], row
    cfg = compose_preset(name)
    assert (cfg.dp_degree, cfg.ring_degree, cfg.ulysses_degree) == (int(dp), int(ring), int(ulysses))
    assert cfg.trainer.strategy._target_.lower().endswith(f"{strategy}strategy")


# wan21_1_3b_lora's twin is wan21_14b_lora's run (the presets differ in the model alone, which the twin replaces)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "wan21_1_3b_lora" else name
                                  for name in sorted(TWINS)])
def test_a_recipes_tiny_twin_trains(name, tmp_path):
    """The recipe page's train command on its tiny architecture (the model, data and run folder replaced): the
    preset's optimizer, schedule, time sampling, LoRA and sampler settings, two optimizer steps on one CPU process
    (activation checkpointing kept where the recipe sets it); then the page's export commands of that run on its
    checkpoint, and its sample line (the twin's size, 2 steps, one process; a LoRA twin's random base given as its
    refusal advises, base=<a diffusers folder>)."""
    train = page_train_command(name)
    run_dir = dict(word.split("=", 1) for word in train)["hydra.run.dir"]
    exports = page_exports(run_dir)
    samples = [w for _, w in page_commands("infer.py") if any(x.startswith(f"ckpt_path={run_dir}/") for x in w)]
    # previews off (the twin's data have no VAE to decode with); a checkpoint when the page exports or samples it
    callbacks = ["~callbacks.sample_grid", *([] if exports or samples else ["~callbacks.model_checkpoint"])]
    with contextlib.redirect_stdout(io.StringIO()):
        proc, _ = fail_fast("train.py", *[w for w in train if w.split("=", 1)[0] not in PLACES],
                            "data=synthetic_text_latents", *twin_sizes(name), *TWINS[name], "data.num_samples=8",
                            "trainer=cpu",
                            "dp_degree=1", "ring_degree=1", "ulysses_degree=1", "trainer.max_steps=2", "logger=csv",
                            *callbacks, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "csv" / "metrics.csv").read_text().count("\n") >= 2
    for number, words in enumerate(exports):  # the page's export command on the twin's checkpoint
        out = tmp_path / f"export-{number}"
        words = [f"ckpt_path={tmp_path}{w.split('=', 1)[1][len(run_dir):]}" if w.startswith("ckpt_path=") else
                 f"out={out}" if w.startswith("out=") else w for w in words]
        proc, _ = in_process("-m ringdit.export", *words)
        assert proc.returncode == 0, f"ringdit.export {' '.join(words)}:\n{proc.stderr[-3000:]}"
        assert list(out.rglob("*.safetensors")), f"{out} holds no weights"
    for number, words in enumerate(samples):  # the page's sample line on the twin: its guidance, steps, experts
        # and degrees' settings, at the twin's size, 2 steps, one process; the data's own prompts (no text encoder)
        out = tmp_path / f"infer-{number}"
        size = dict(w.split("=", 1) for w in twin_sizes(name) + TWINS[name] if w.startswith("data."))
        frames = int(size.get("data.frames", 3)) if size.get("data.frames") != "0" else None
        words = with_values([w for w in words if w.split("=", 1)[0] not in ("prompts", "image", "text_embeds",
                                                                             "frames")],
                            hydra__run__dir=str(out), ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"),
                            num_samples="2", size="[8,8]", diffusion__sampling__steps="2", dp_degree="1",
                            ring_degree="1", **({"frames": str(frames)} if frames else {}))
        proc, _ = in_process("infer.py", *words)
        if "holds only LoRA adapters, and its run recorded no base model" in proc.stderr:  # the twin's random
            # base: its refusal's advice, base=<a diffusers folder of the weights they were trained on>
            words.append(f"base={random_base(tmp_path / 'checkpoints' / 'last.ckpt', tmp_path / 'base')}")
            proc, _ = in_process("infer.py", *words)
        assert proc.returncode == 0, f"infer.py {' '.join(words)}:\n{proc.stderr[-3000:]}"
        assert (out / "samples.npz").is_file()


def random_base(ckpt, folder):
    """A diffusers folder holding the random init a LoRA twin trained on (its transformer(s), as materialized from
    the run's seed): what the checkpoint's adapters go on."""
    import diffusers
    import torch

    from ringdit.checkpoints.loading import safe_torch_load
    from ringdit.models.diffusers.families import get_family
    from ringdit.spec.model import model_class

    hparams = safe_torch_load(ckpt)["hyper_parameters"]
    config = hparams["model"]
    torch.manual_seed(hparams["seed"])
    model = model_class(config)(**{k: v for k, v in config.items() if k != "_target_"})
    transformer_class = getattr(diffusers, get_family(config["family"]).model_class)
    for name in ("transformer", "transformer_2"):
        if hasattr(model, name):
            transformer = transformer_class.from_config(getattr(model, name).config)
            transformer.load_state_dict(getattr(model, name).state_dict())
            transformer.save_pretrained(folder / name)
    return folder


def test_every_prepare_and_sample_line_on_the_recipe_pages_composes():
    """Every ``ringdit.prepare`` and ``infer.py`` line of the recipe pages takes only settings its command has, with
    values that parse (no shell variables left to define)."""
    import ringdit

    lines = [("prepare", words) for words in (w for _, w in page_commands("ringdit.prepare"))]
    lines += [("infer", words) for words in (w for _, w in page_commands("infer.py"))]
    assert len(lines) >= 20
    for command, words in lines:
        assert not any("$" in word for word in words), f"{command} {' '.join(words)}: a shell variable"
        ringdit.config(command, words)  # a ConfigError names the setting


def with_values(words: list[str], **values: str) -> list[str]:
    """``words`` (key=value) with the values of ``values`` put in (a key's dots as __), the others kept."""
    values = {key.replace("__", "."): value for key, value in values.items()}
    kept = [word for word in words if word.split("=", 1)[0] not in values]
    return [*kept, *(f"{key}={value}" for key, value in values.items())]


@pytest.mark.timeout(600)
def test_the_wan21_page_prepare_train_sample_on_its_tiny_twin(models, tmp_path):
    """docs/recipes/wan21.md's own lines, in order, on tiny random models (nothing downloaded): prepare captioned
    clips with the page's settings (the model folders, sizes and frames made tiny), train its preset on the tiny Wan,
    sample its prompts from the checkpoint with the data's text encoder and VAE (found from the checkpoint), written
    at Wan 2.1's 16 fps."""
    import shutil

    import av
    import numpy as np
    import torch
    from diffusers import WanTransformer3DModel

    clips = tmp_path / "clips"
    clips.mkdir()
    captions = ["a red fox running", "a blue cat", "green field", "a red sky"]
    for i in range(8):
        write_video(clips / f"{i}.mp4", 5, seed=i, size=(40, 32))
        (clips / f"{i}.txt").write_text(captions[i % 4])
    # the model folder: a tiny Wan 2.1 pipeline (its transformer of wan_tiny's architecture, 16 latent channels
    # as the tiny VAE's z_dim, text width 16 as the tiny T5's)
    folder = tmp_path / "Wan2.1-tiny"
    for part in ("vae", "text_encoder", "tokenizer"):
        shutil.copytree(models["wan"] / part, folder / part)
    torch.manual_seed(0)
    WanTransformer3DModel.from_config({**architecture("wan_tiny"), "in_channels": 16, "out_channels": 16}
                                      ).save_pretrained(folder / "transformer")
    (prepare,) = [w for page, w in page_commands("ringdit.prepare") if page == "wan21.md"]
    data = tmp_path / "data"
    env = {"HF_HUB_OFFLINE": "1"}
    proc, _ = in_process("-m ringdit.prepare", *with_values(
        prepare, input=str(clips), out=str(data), vae=str(folder), text_encoder=str(folder), size="32", frames="5",
        max_text_len=str(TEXT_LEN), shard_size="4"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(data.glob("*.safetensors"))) == 2

    train = page_train_command("wan21_14b_lora")  # the page's line, its places here and one CPU process
    run("train.py", tmp_path / "run", *with_values(train, model__pretrained=str(folder), data__path=str(data),
                                                  hydra__run__dir=str(tmp_path / "run")),
        "trainer=cpu", "dp_degree=1", "ring_degree=1", "ulysses_degree=1", "trainer.max_steps=2", "logger=csv",
        "data.batch_size=4", "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.sample_grid.steps=2",
        env=env)
    (infer,) = [w for page, w in page_commands("infer.py") if page == "wan21.md"]
    out = tmp_path / "infer"
    proc, _ = in_process("infer.py", *with_values(
        infer, hydra__run__dir=str(out), ckpt_path=str(tmp_path / "run" / "checkpoints" / "last.ckpt"),
        size="[32,32]", frames="5", diffusion__sampling__steps="2", ring_degree="1"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = np.load(out / "samples.npz")
    assert samples["latents"].shape == (2, 16, 2, 4, 4)  # (N, C, 1 + (5 - 1) / 4, 32 / 8, 32 / 8)
    assert list(samples["captions"]) == ["a red fox running through fresh snow", "a paper boat on a rainy street"]
    assert int(samples["fps"]) == 16  # Wan 2.1's rate, kept for python -m ringdit.media.decode
    assert read_mp4(out / "sample-001.mp4").shape == (5, 32, 32, 3)
    with av.open(str(out / "sample-001.mp4")) as container:
        assert container.streams.video[0].average_rate == 16


def test_the_planner_takes_a_preset_the_command_line_wins_and_mistakes_are_one_line(capsys):
    """``experiment=`` on the planner: settings given beside it win (larger clips: the preset's own layout is no longer
    the best, and the run line says which degrees to change; the previews' own ``+`` settings are taken); an unknown
    preset and a demo preset (no prepared clips to plan) are one line each, exit code 2."""
    from ringdit.plan import main as plan

    assert plan(["experiment=wan21_14b_lora", "data.size=[720,1280]", "+callbacks.sample_grid.batch_size=2"]) == 0
    printed = capsys.readouterr().out
    assert "Run it: python train.py experiment=wan21_14b_lora dp_degree=2 ring_degree=4 model.pretrained=..." in printed
    assert "(the preset sets dp=4 ring=2 ulysses=1 ddp; the recommendation differs)" in printed
    assert "Previews (callbacks.sample_grid: 2 samples, 2 a forward x2 (guidance), 50 steps)" in printed
    for preset, message in (("nope", "experiment=nope: no such option (options: "),
                            ("moving_digits", "experiment=moving_digits trains on data=moving_digits, not on "
                                              "prepared clips; the planner lays out the real-model presets")):
        assert plan([f"experiment={preset}"]) == 2
        assert message in capsys.readouterr().err
    assert plan(["model=wan_14b", "data.size=[480,832]", "data.frames=81"]) == 0  # the advice: the model and sizes


# recipe page -> the tiny stack its prepare lines run on (the model folders' paths replaced): the Wan VAE and T5 of
# the `models` fixture, LTX-Video's or CogVideoX's VAE with that T5, Qwen-Image's (the Wan VAE's code, a tiny
# Qwen2.5-VL with its template), HunyuanVideo 1.5's (its VAE, Qwen2.5-VL, ByT5 glyph and SigLIP image encoders), or
# Flux's and Flux.2's (its VAE, that T5 and a CLIP for the pooled prompt);
# wan21.md's line runs in its end-to-end test above
PREPARE_STACKS = {"wan22.md": "wan", "skyreels_v2.md": "wan", "ltx_video.md": "ltx", "flux.md": "flux",
                  "cogvideox15.md": "cogvideox", "qwenimage.md": "qwenimage", "hunyuan_video15.md": "hunyuan",
                  "flux2.md": "flux2"}


@pytest.mark.parametrize("page, words", [(page, words) for page, words in page_commands("ringdit.prepare")
                                         if page in PREPARE_STACKS])
def test_a_recipe_pages_prepare_line_runs_on_tiny_encoders(page, words, models, tmp_path):
    """The page's own prepare line (its task, text length and settings) on captioned clips, with tiny random model
    folders in place of the real ones and a small size: it writes its shards."""
    import shutil

    from tests.helpers import save_tiny_flux2, save_tiny_hunyuan_video15, save_tiny_qwenimage_encoder, tiny_video_vae

    clips = tmp_path / "clips"
    clips.mkdir()
    stack = PREPARE_STACKS[page]
    for i, caption in enumerate(["a red fox running", "a blue cat"]):
        if stack in ("flux", "flux2", "qwenimage"):
            solid((40 * i, 80, 160), size=(40, 32)).save(clips / f"{i}.png")
        else:
            write_video(clips / f"{i}.mp4", 9, seed=i, size=(40, 32))
        (clips / f"{i}.txt").write_text(caption)
    folder, extra = models["wan"], {"frames": "9"}
    if stack == "flux":
        folder, extra = models["flux"], {"text_encoder": str(models["wan"]), "pooled_encoder": str(models["flux"]),
                                         "max_pooled_len": "8"}  # the tiny CLIP has 16 positions, not 77
    if stack == "hunyuan":
        folder = save_tiny_hunyuan_video15(tmp_path / "HunyuanVideo-1.5-tiny", glyph=True, image=True)
        extra = {"frames": "9", "glyph_encoder": str(folder),
                 **({"image_encoder": str(folder)} if any(w.startswith("image_encoder=") for w in words) else {})}
    if stack == "flux2":  # its template keeps the system message: room for it and the prompt
        folder, extra = save_tiny_flux2(tmp_path / "FLUX.2-tiny"), {"max_text_len": "40"}
    if stack == "qwenimage":
        folder, extra = save_tiny_qwenimage_encoder(tmp_path / "Qwen-Image-tiny"), {"vae": str(models["wan"])}
    if stack in ("ltx", "cogvideox"):
        folder = tmp_path / f"{stack}-tiny"
        tiny_video_vae(stack, folder / "vae")
        for part in ("text_encoder", "tokenizer"):
            shutil.copytree(models["wan"] / part, folder / part)
    out = tmp_path / "data"
    proc, _ = in_process("-m ringdit.prepare", *with_values(
        words, **{"input": str(clips), "out": str(out), "vae": str(folder), "text_encoder": str(folder), "size": "32",
                  "max_text_len": str(TEXT_LEN), **extra}), env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(out.glob("*.safetensors"))
