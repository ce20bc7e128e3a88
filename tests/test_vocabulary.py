"""One vocabulary: a setting that infer.py, calibration or the planner share with train.py carries train.py's name,
and a user who types another command's name is pointed to this one's."""

import pytest

from ringdit.cli import hydra_error_message, known_keys

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
