"""One vocabulary: a setting that infer.py, calibration or the planner share with train.py carries train.py's name,
and a user who types another command's name is pointed to this one's."""

import pytest

import ringdit.training  # noqa: F401 - imported here, not first under capsys in a planner test: lightning's
from ringdit.commands.cli import hydra_error_message, known_keys  # loggers would keep capsys's stream, and later in-process
#                                                          runs in this worker log a traceback to it

SHARED = ("diffusion.", "model.", "trainer.", "lora.")  # the groups a run's settings live in


@pytest.mark.parametrize("command", ["infer", "calibrate", "plan"])
def test_every_run_setting_of_a_command_is_named_as_train_py_names_it(command):
    train = set(known_keys("train"))
    keys = known_keys(command)
    leaves = [key for key in keys if not any(other.startswith(f"{key}.") for other in keys)]
    shared = [key for key in leaves if key.startswith(SHARED)]
    assert shared, f"conf/{command}.yaml names no run setting: the test reads the wrong file"
    assert sorted(set(shared) - train) == [], f"conf/{command}.yaml names settings train.py does not have"


@pytest.mark.parametrize("command, key, hint", [
    ("infer", "steps", "did you mean diffusion.sampling.steps?"),
    ("infer", "guidance", "did you mean model.guidance?"),
    ("plan", "expert", "did you mean diffusion.expert?"),
    ("plan", "strategy", "did you mean trainer/strategy=...?"),  # a config group: chosen with a slash
    ("plan", "precision", "did you mean trainer.precision?"),
    ("prepare", "resolution", "did you mean size?"),  # the pixel size, as infer.py's size= and the planner's data.size=
])
def test_another_commands_name_is_pointed_to_this_ones(command, key, hint):
    from hydra.errors import ConfigCompositionException

    error = ConfigCompositionException(f"Could not override '{key}'.")
    error.__cause__ = KeyError(f"Key '{key}' is not in struct")
    assert hint in hydra_error_message(error, command, in_task=False)


@pytest.mark.parametrize("command", ["train", "infer", "prepare", "plan", "calibrate", "decode", "export", "serve"])
def test_no_command_config_sets_hydras_run_mode(command):
    """A command's run mode is Hydra's default (one run; ``-m`` for a sweep): no config sets ``hydra.mode``. The
    in-process runs of the tests rely on it (``tests/helpers.in_process`` skips Hydra's composition that reads it)."""
    from hydra import compose, initialize_config_dir

    from tests.helpers import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        assert compose(command, return_hydra_config=True).hydra.mode is None


# ---- the planner takes what its own "Run it" line gives train.py ------------------------------------------------


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    from ringdit.plan import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_it(out: str) -> list[str]:
    """The train.py settings of the plan's last line: ``Run it: python train.py ... (with the run's data=...)``."""
    import re

    line = re.search(r"^Run it: python train\.py (.*) \(with the run's data=\.\.\.\)$", out, flags=re.M)
    assert line, out
    return line.group(1).split()


def recommended(out: str) -> str:
    import re

    return re.search(r"^Recommended: (.*?) -- ", out, flags=re.M).group(1)


@pytest.mark.parametrize("shape, hardware, run", [
    # multi-node FSDP (trainer.devices x trainer.num_nodes), checkpointing, 8-bit states searched
    (["model=wan_14b", "data.frames=81", "data.size=[480,832]"], ["gpus=16", "gpu_memory_gb=80"], []),
    # LoRA on an fp8 base, every block checkpointed and offloaded
    (["model=wan_14b", "data.frames=81", "data.size=[720,1280]"], ["gpus=2", "gpu_memory_gb=24"],
     ["lora.rank=32", "optimizer=adamw8bit"]),
    # DDP, plain SGD, no EMA, fp32
    (["model=dit_xl", "data.size=512"], ["gpus=4"], ["trainer/strategy=ddp", "optimizer=sgd", "ema_decay=null",
                                                     "trainer.precision=32-true"]),
    (["model=dit_digits", "data.latent=false", "data.size=8", "data.batch_size=128"], ["gpus=2"],
     ["optimizer_states=1", "distill=dmd2"]),
])
def test_the_planner_takes_back_every_setting_its_run_it_line_prints(shape, hardware, run, capsys):
    """Its "Run it" line, given back to the planner (with the data shape and the GPU's memory, which train.py does
    not name), is taken, plans the same layout and prints the same line; and train.py composes it."""
    import ringdit

    code, out, err = plan(capsys, *shape, *hardware, *run, "show=2")
    assert code == 0, err
    words = run_it(out)
    memory = [h for h in hardware if h.startswith("gpu_memory_gb")]
    code, again, err = plan(capsys, *shape, *memory, *words, "show=2")
    assert code == 0, err
    assert recommended(again) == recommended(out) and run_it(again) == words
    assert ringdit.config("train", [w for w in words if not w.startswith("model=")] + [words[0]])


def test_the_planner_takes_train_pys_degrees_and_refuses_one_no_layout_has(capsys):
    """ulysses_degree=3 does not divide 8 GPUs: refused with the values that work, and one of them plans only
    layouts with it; on 12 GPUs it splits Wan's 40 heads unevenly; a degree above the heads is refused."""
    import re

    wan = ["model=wan_14b", "data.frames=81", "show=3"]
    code, out, err = plan(capsys, *wan, "ulysses_degree=3")
    assert code == 2 and not out
    assert "Error: ulysses_degree=3 does not divide gpus=8; with the others free, use ulysses_degree=1, 2, 4 or 8" \
        in err, err
    code, out, err = plan(capsys, *wan, "ulysses_degree=4")
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+) (?:ddp|fsdp) ", out, flags=re.M)
    assert code == 0 and rows and all(ulysses == "4" for *_, ulysses in rows), out
    assert "ulysses=4" in recommended(out) and "ulysses_degree=4" in run_it(out)
    code, out, err = plan(capsys, *wan, "gpus=12", "gpus_per_node=12", "ulysses_degree=3")
    assert code == 0 and "ulysses=3" in recommended(out), err  # 40 heads over 3 ranks: 14, 13, 13
    code, out, err = plan(capsys, *wan, "gpus=48", "ulysses_degree=48")
    assert code == 2 and "ulysses_degree=48 is more than the model's 40 heads (Ulysses gives each rank whole heads); " \
                         "with the others free, use ulysses_degree=1, 2, 3, 4, 6, 8, 12, 16 or 24" in err, err
    code, out, err = plan(capsys, *wan, "gpus=8", "dp_degree=2", "ring_degree=2", "ulysses_degree=1")
    assert code == 2 and "dp_degree=2 ring_degree=2 ulysses_degree=1: dp_degree x ring_degree x ulysses_degree " \
                         "must be gpus=8; with ring_degree=2 ulysses_degree=1, use dp_degree=4" in err, err
    code, out, err = plan(capsys, *wan, "dp_degree=4", "ring_degree=2", "ulysses_degree=1")
    assert code == 0 and recommended(out).startswith("dp=4 ring=2 ulysses=1"), err


@pytest.mark.parametrize("strategy", [[], ["trainer/strategy=fsdp"]])  # none: both strategies laid out
@pytest.mark.parametrize("override, fix", [("trainer.strategy.ulysses_degree=2", "ulysses_degree=2"),
                                           ("trainer.strategy.ring_degree=4", "ring_degree=4")])
def test_a_degree_set_on_the_strategy_is_pointed_to_train_pys_name(override, fix, strategy, capsys):
    """conf/trainer/strategy/*.yaml take the degrees from the top-level settings, and the strategy is built from the
    layout: a degree set there would be overruled, in train.py and the planner alike, so it is refused."""
    import ringdit
    from ringdit.common.errors import ConfigError
    from ringdit.parallel.layout import Layout

    wan = ["model=wan_14b", "data.frames=81", "show=1", *strategy]
    code, out, err = plan(capsys, *wan, override)
    assert code == 2 and f"; use {fix}" in err, err
    code, out, err = plan(capsys, *wan, fix)
    assert code == 0 and fix in run_it(out), err
    with pytest.raises(ConfigError, match=f"{override} is set from .*; use {fix}$"):
        Layout.from_config(ringdit.config("train", [override]), training=True)
    layout = Layout.from_config(ringdit.config("train", [fix, "trainer=cpu", "attention_backend=math"]), training=True)
    assert layout.ranks == int(fix.split("=")[1])


@pytest.mark.parametrize("argv, message, fix", [
    (["optimizer=sgd", "optimizer_states=2"], "optimizer_states=2 but optimizer=sgd keeps 0 states per parameter; "
                                              "drop optimizer_states=", ["optimizer=sgd"]),
    (["optimizer=adamw", "optimizer_8bit=true"], "optimizer_8bit=true but optimizer=adamw keeps 2 states per "
                                                 "parameter; drop optimizer_8bit=", ["optimizer=adamw"]),
    (["gpus=16", "gpus_per_node=8", "trainer.num_nodes=4"], "gpus=16 but gpus_per_node x trainer.num_nodes = 8 x 4 = "
                                                            "32; give gpus or trainer.num_nodes, not both",
     ["gpus=16", "gpus_per_node=8"]),
    (["gpus_per_node=4", "trainer.devices=8"], "gpus_per_node=4 and trainer.devices=8 both name the GPUs of one "
                                               "node; give one of them", ["trainer.devices=8"]),
    (["gpus=12"], "gpus=12 do not fill whole nodes of gpus_per_node=8", ["gpus=16"]),
    (["gpus=12"], "or gpus_per_node=6", ["gpus=12", "gpus_per_node=6"]),
    (["trainer=cpu"], "trainer.accelerator=cpu: the planner lays out GPUs; use trainer=gpu", ["trainer=gpu"]),
    # train.py's distill.* checks, as train.py words them
    (["distill=dmd2", "distill.cfg_scale=-2"], "distill.cfg_scale=-2 is not a teacher's guidance scale: give a "
                                               "number in [1, 100]", ["distill=dmd2", "distill.cfg_scale=1.5"]),
])
def test_the_planners_settings_agree_with_train_pys_names(argv, message, fix, capsys):
    wan = ["model=wan_14b", "data.frames=81", "show=1"]
    code, out, err = plan(capsys, *wan, *argv)
    assert code == 2 and message in err and not out, err
    code, out, err = plan(capsys, *wan, *fix)
    assert code == 0, err
