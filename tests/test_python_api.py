"""The Python API (``ringdit.config``, ``train``, ``sample``, ``serve``) refuses bad arguments with the command
line's one line, as a ``ConfigError`` a caller can catch; following each refusal's advice works."""

import pytest

import ringdit
from ringdit.common.errors import ConfigError


def test_a_misspelt_setting_is_the_command_lines_one_line(capsys):
    """The same words as ``python -m ringdit.plan bogus_setting=1`` prints, and the advice works."""
    from ringdit.plan import main

    assert main(["bogus_setting=1"]) == 2
    command_line = capsys.readouterr().err.splitlines()[0].removeprefix("Error: ")
    with pytest.raises(ConfigError) as refused:
        ringdit.config("plan", ["bogus_setting=1"])
    assert str(refused.value) == command_line
    assert command_line.startswith("no setting named 'bogus_setting'; (python -m ringdit.plan --cfg job lists them; "
                                   "a new key is added with +bogus_setting=...)")
    assert ringdit.config("plan", ["+bogus_setting=1"]).bogus_setting == 1


@pytest.mark.parametrize("command, override, message, fix", [
    ("train", "bogus_setting=1", "no setting named 'bogus_setting'; (python train.py --cfg job lists them; a new key "
                                 "is added with +bogus_setting=...)", "+bogus_setting=1"),
    ("infer", "steps=2", "no setting named 'steps'; did you mean diffusion.sampling.steps? (python infer.py --cfg job",
     "diffusion.sampling.steps=2"),
    ("train", "model=wan_15b", "model=wan_15b: no such option; did you mean model=wan_14b?", "model=wan_14b"),
    ("train", "trainer.max_steps=[", "could not parse an override: ", "trainer.max_steps=3"),
    ("plan", "optimizer=adamw9bit", "optimizer=adamw9bit: no such option; did you mean optimizer=adamw8bit?",
     "optimizer=adamw8bit"),
])
def test_config_refuses_a_bad_override_with_advice_that_works(command, override, message, fix):
    with pytest.raises(ConfigError) as refused:
        ringdit.config(command, [override])
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), refused.value
    ringdit.config(command, [fix])


@pytest.mark.parametrize("command, message, fix", [
    ("trian", "no command named 'trian'; did you mean 'train'? (commands: train, infer, export, prepare, decode, plan, "
              "calibrate, serve)", "train"),
    ("", "no command named ''; (commands: train, infer", "infer"),
    (None, "no command named None; (commands: train", "plan"),
])
def test_config_names_the_command_and_the_choices(command, message, fix):
    with pytest.raises(ConfigError) as refused:
        ringdit.config(command)
    assert str(refused.value).startswith(message), refused.value
    ringdit.config(fix)


@pytest.mark.parametrize("command", ["export", "prepare", "decode", "plan", "calibrate"])
def test_config_composes_every_command(command):
    """Those without a run folder (no paths group) too."""
    assert ringdit.config(command) is not None


@pytest.mark.parametrize("overrides, run_dir, message", [
    ("trainer.max_steps=3", None, "overrides must be a list of strings such as ['model=wan_tiny', "
                                  "'trainer.max_steps=10'], got 'trainer.max_steps=3'"),
    (["trainer.max_steps=3", 3], None, "overrides must be a list of strings"),
    (3, None, "overrides must be a list of strings"),
    ([], 5, "run_dir must be a folder path (a str or a pathlib.Path) or None, got 5"),
])
def test_config_refuses_arguments_of_the_wrong_type(overrides, run_dir, message, tmp_path):
    with pytest.raises(ConfigError) as refused:
        ringdit.config("train", overrides, run_dir)
    assert str(refused.value).startswith(message), refused.value
    assert ringdit.config("train", ["trainer.max_steps=3"], tmp_path).trainer.max_steps == 3


@pytest.mark.parametrize("run, command", [(ringdit.train, "train"), (ringdit.sample, "infer"),
                                          (ringdit.serve, "serve")])
@pytest.mark.parametrize("wrong", [None, "train", {"trainer": {}}, "another command's"])
def test_a_run_refuses_what_is_not_its_commands_config(run, command, wrong):
    """Nothing starts: a ConfigError names what was passed and says which config to pass."""
    if wrong == "another command's":
        wrong = ringdit.config("plan")
    with pytest.raises(ConfigError, match=rf"^ringdit\.{run.__name__} takes the settings of {command}, .*; pass "
                                          rf"ringdit\.config\('{command}', \[\.\.\.\]\)$"):
        run(wrong)


def test_a_run_refuses_a_bad_setting_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps must be a positive integer, got 'abc'"):
        ringdit.train(ringdit.config("train", ["trainer.max_steps=abc"], tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_ringdit_serve_stays_callable_once_the_server_package_is_imported():
    """Importing ``ringdit.serve`` (the package; every call of ``ringdit.serve`` does) puts it in the function's
    place on ``ringdit``: the second call still checks its settings and serves, it does not find a module."""
    import ringdit.serve.api  # noqa: F401 - what any server code, or a first ringdit.serve(cfg), imports

    for _ in range(2):
        with pytest.raises(ConfigError, match=r"ringdit.serve takes the settings of serve"):
            ringdit.serve(ringdit.config("plan"))
