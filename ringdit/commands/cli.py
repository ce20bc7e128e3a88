"""The command-line entry of every ringdit command (``train.py``, ``infer.py``, ``python -m ringdit.*``): Hydra's
composition with one-line errors (exit code 2) for mistakes in the settings, did-you-mean hints for misspelt keys,
and the resolvers the configs use.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import secrets
import sys
import time
from pathlib import Path

from hydra.errors import InstantiationException
from omegaconf import OmegaConf, open_dict

from ringdit.common.errors import ConfigError

from ringdit.reference import commands, help_settings


def register_resolvers() -> None:
    """``${mul:a,b,c}``: the product (the default device count dp x ring x ulysses); ``${min:a,b}``;
    ``${run_id:}``: a short random suffix that keeps two runs started in the same second apart, and ``${run_name:}``:
    a run folder's name, the time stamp and that suffix (both cached per config, like Hydra's ``${now:}``, so that a
    run and the jobs of one sweep see one value)."""
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs), replace=True)
    OmegaConf.register_new_resolver("min", lambda *xs: min(int(x) for x in xs), replace=True)
    OmegaConf.register_new_resolver("run_id", lambda: secrets.token_hex(3), use_cache=True, replace=True)
    OmegaConf.register_new_resolver("run_name", run_name, use_cache=True, replace=True)


def run_name() -> str:
    """The name of a run's folder: ``<time>_<random id>``. The ranks of one torchrun or srun job each compose the
    config themselves, so a time and a random id would give each rank a folder of its own (a sharded checkpoint
    scattered over them): there the name is the job's, the same on every rank."""
    environ = os.environ
    if environ.get("TORCHELASTIC_RUN_ID") and int(environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: the rendezvous id
        return f"torchrun-{environ['TORCHELASTIC_RUN_ID']}"
    if environ.get("SLURM_JOB_ID") and int(environ.get("SLURM_NTASKS", "1")) > 1:  # srun: the job and its step
        return f"slurm-{environ['SLURM_JOB_ID']}.{environ.get('SLURM_STEP_ID', '0')}"
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(3)}"


SETTINGS_ERRORS = (ValueError, TypeError, FileNotFoundError, InstantiationException)


@contextlib.contextmanager
def user_errors(*kinds: type[BaseException]):
    """Show an error of ``kinds`` (default: what checking settings raises) as its one-line cause and exit with code
    2; ``HYDRA_FULL_ERROR=1`` shows the traceback. Wrap only the phase where such errors mean a user mistake."""
    try:
        yield
    except kinds or SETTINGS_ERRORS as error:
        exit_with_one_line(error)


def exit_with_one_line(error: BaseException) -> None:
    """The one line of a settings error (a Hydra instantiation's with its cause) and exit code 2; re-raised when
    ``HYDRA_FULL_ERROR=1`` asks for the traceback. Call it in an ``except``."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    message = str(error).strip()
    if isinstance(error, InstantiationException) and error.__cause__ is not None:
        message = f"{message.splitlines()[0]} {error.__cause__}"
    _exit_with(message)


# ---- Hydra's own errors (composition, overrides, ???, the run folder) as one line and exit code 2 -----------------

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# settings renamed so that every command names one thing alike (prepare's size, as infer.py's and the planner's):
# the former name is pointed to the new one
FORMER_NAMES = {"prepare": {"resolution": "size"}}
FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra's own switch: "1" = re-raise errors instead of reporting them


def model_preset(name: str) -> dict:
    """The model config that ``model=<name>`` selects (``conf/model/<name>.yaml`` with what it inherits), for code
    that builds a preset without a run: ``hydra.utils.instantiate(model_preset("dit_xl"), input_size=32, ...)``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=[f"model={name}"]).model)


def command_config(command: str = "train", overrides=(), run_dir: str | Path | None = None):
    """``conf/<command>.yaml`` with ``overrides`` (``["model=wan_tiny", "trainer.max_steps=10"]``), composed as the
    command line would compose it, for ``ringdit.train`` / ``sample`` / ``serve``: its run folder ``run_dir``, or the
    command's own (``outputs/<task>/runs/<time>_<id>``). A mistake -- an unknown command, a misspelt key or option,
    an override that does not parse -- raises ``ConfigError`` with the command line's one line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    check_command(command)
    if isinstance(overrides, (str, bytes)) or not all(isinstance(item, str) for item in _iterable(overrides)):
        raise ConfigError(f"overrides must be a list of strings such as ['model=wan_tiny', 'trainer.max_steps=10'], "
                          f"got {overrides!r}")
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise ConfigError(f"run_dir must be a folder path (a str or a pathlib.Path) or None, got {run_dir!r}")
    register_resolvers()
    extra = [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(command, overrides=[*overrides, *extra], return_hydra_config=True)
    except Exception as error:  # noqa: BLE001 - what is not a settings mistake is raised again, in full
        message = hydra_error_message(error, command, in_task=False)
        if message is None:
            raise
        raise ConfigError(message) from error
    HydraConfig.instance().set_config(cfg)  # ${hydra:...} interpolations (the run folder) resolve as in the command
    if "paths" in cfg:  # the commands that write a run folder (train, infer, serve)
        cfg.paths.output_dir = str(run_dir if run_dir is not None else cfg.hydra.run.dir)
    with open_dict(cfg):
        del cfg["hydra"]  # as a command's task receives it: Hydra's own node is HydraConfig's
    return cfg


def _iterable(value) -> list:
    try:
        return list(value)
    except TypeError:
        raise ConfigError(f"overrides must be a list of strings such as ['model=wan_tiny', 'trainer.max_steps=10'], "
                          f"got {value!r}") from None


def check_command(command) -> None:
    """``command`` names a conf/<command>.yaml that configures a command (``ringdit.reference.commands``)."""
    import difflib

    known = list(commands())
    if not isinstance(command, str) or command not in known:
        close = difflib.get_close_matches(command, known, n=1) if isinstance(command, str) else []
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"no command named {command!r}; {hint}(commands: {', '.join(known)})")


def hydra_main(config_name: str):
    """``hydra.main`` over ``conf/<config_name>.yaml`` (``CONF_DIR``: any working directory, scripts and ``python -m``
    modules alike) whose own mistakes -- a misspelt key, an unknown group option, a missing ``???`` value, an override
    that does not parse, a run folder that cannot be created -- end like every other settings error: one line, exit
    code 2 (``HYDRA_FULL_ERROR=1``: the full traceback). ``main(argv)`` runs it on ``argv`` instead of
    ``sys.argv[1:]``.

    Hydra reports its errors itself (several lines, exit 1) unless ``HYDRA_FULL_ERROR=1``, when it re-raises them:
    that switch is on while Hydra runs, so the error reaches ``entry`` below, which shortens it; the user's own value
    is back in place while the task runs (for ``user_errors`` and for the processes the task starts)."""
    import functools

    import hydra

    def decorator(task):
        run = {}  # this call's state: whether the task started, the user's HYDRA_FULL_ERROR

        @functools.wraps(task)
        def run_task(cfg):
            run["started"] = True
            _set_env(FULL_ERROR, run["user_value"])
            try:
                return task(cfg)
            except Exception as error:  # here, or Hydra writes "Error executing job" before re-raising it
                message = hydra_error_message(error, config_name, in_task=True)
                if message is None or run["user_value"] == "1":
                    raise
                _exit_with(message)
            finally:
                os.environ[FULL_ERROR] = "1"  # an error leaving the task: Hydra re-raises it to entry

        main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(run_task)
        # for --help: the command module's docstring (a task wrapped by ringdit.commands.task: its own module's)
        doc = inspect.cleandoc(inspect.unwrap(task).__globals__.get("__doc__") or "").replace("$", "$$")

        @functools.wraps(task)
        def entry(argv: list[str] | None = None) -> None:
            register_resolvers()
            # for the help templates (hydra/default.yaml, hydra/command.yaml); the settings are read from conf/ only
            # when --help renders them, not on every launch
            OmegaConf.register_new_resolver("command_help", lambda: doc, replace=True)
            OmegaConf.register_new_resolver(  # the options the command line composes (experiment=X --help: X's)
                "command_settings", lambda _root_: _settings_text(config_name, _root_.hydra.runtime.choices),
                replace=True)
            run.update(started=False, user_value=os.environ.get(FULL_ERROR))
            saved_argv = sys.argv
            if argv is not None:
                sys.argv = [sys.argv[0], *argv]
            os.environ[FULL_ERROR] = "1"
            try:
                main()
            except BrokenPipeError:  # `--help | head`: the reader left; nothing went wrong, nothing to report
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit fails alike
                sys.exit(1)  # as Python's own docs advise (a shell reports the pipeline's last command anyway)
            except Exception as error:  # noqa: BLE001 - what is not a settings mistake is raised again, in full
                message = hydra_error_message(error, config_name, in_task=run["started"])
                if message is None or run["user_value"] == "1":
                    raise
                _exit_with(message)
            finally:
                sys.argv = saved_argv
                _set_env(FULL_ERROR, run["user_value"])

        return entry

    return decorator


def _settings_text(config_name: str, choices) -> str:
    """For ``--help``: the groups ``conf/<config_name>.yaml`` selects from with their options, its own settings and
    those of each group's option the command line picks (``choices``: Hydra's ``runtime.choices``; else the
    default), every one with its default and its comment (``ringdit.reference``; ``$`` doubled: Hydra's help template
    is a ``string.Template``)."""
    return help_settings(config_name, dict(choices))


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _exit_with(message: str) -> None:
    print(f"Error: {message}\n(set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr, flush=True)
    sys.exit(2)


def command_of(config_name: str) -> str:
    """How a user runs the command that ``conf/<config_name>.yaml`` configures (for the hints in errors)."""
    return commands().get(config_name, f"python {config_name}.py")


def hydra_error_message(error: Exception, config_name: str, *, in_task: bool) -> str | None:
    """One line for a mistake Hydra / OmegaConf found in the command line or config; None for anything else."""
    import difflib
    import re

    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, MissingMandatoryValue):
        key = getattr(error, "full_key", None) or first
        return f"{key} is required (it is ??? in conf/{config_name}.yaml): pass {key}=..."
    if in_task:  # past composition only settings errors are ours to shorten; a fault keeps its traceback
        if isinstance(error, OmegaConfBaseException):
            key = getattr(error, "full_key", None)
            return f"{key}: {first}" if key else first
        return None
    if isinstance(error, MissingConfigException):
        missing = error.missing_cfg_file or first
        if error.options:
            group, _, name = str(missing).rpartition("/")
            close = difflib.get_close_matches(name, error.options, n=1)
            hint = f"; did you mean {group}={close[0]}?" if close else ""
            return f"{group}={name}: no such option{hint} (options: {', '.join(error.options)})"
        return first
    if isinstance(error, OverrideParseException):
        return f"could not parse an override: {first} (see https://hydra.cc/docs/advanced/override_grammar/basic)"
    if isinstance(error, ConfigCompositionException):
        unknown = re.match(r"Could not override '([^']+)'", first)
        if unknown and "not in struct" in f"{error} {error.__cause__}":
            key, known = unknown.group(1), known_keys(config_name)
            if key in known:
                group = key.split(".")[0]
                return f"{key} is not a setting of the configs selected here: its config option is not used " \
                       f"(e.g. {group}=none); select it ({group}=...) or drop the override"
            nested = sorted((name for name in known if name.endswith(f".{key}")), key=len)  # steps= for the
            close = nested[:1] or difflib.get_close_matches(key, known, n=1, cutoff=0.6)  # diffusion.sampling.steps=
            close = [FORMER_NAMES[config_name][key]] if key in FORMER_NAMES.get(config_name, {}) else close
            if close and (CONF_DIR / close[0].replace(".", "/")).is_dir():  # a config group: chosen with a slash
                close = [close[0].replace(".", "/") + "=..."]
            hint = f"did you mean {close[0]}? " if close else ""
            return f"no setting named '{key}'; {hint}({command_of(config_name)} --cfg job lists them; a new key " \
                   f"is added with +{key}=...)"
        cause = error.__cause__
        return f"{first} {str(cause).strip().splitlines()[0]}" if cause is not None and str(cause).strip() else first
    if isinstance(error, OmegaConfBaseException):
        key = getattr(error, "full_key", None)
        return f"{key}: {first}" if key else first
    if isinstance(error, OSError):  # before the task runs, Hydra only touches the file system for the run folder
        where = error.filename or "the run folder"
        return f"cannot create the run folder ({where}: {error.strerror or first}); set hydra.run.dir (or " \
               f"paths.log_dir) to a writable folder"
    return None


def known_keys(config_name: str) -> list[str]:
    """Every dotted setting name the configs in conf/ define: suggestions for a misspelt key."""
    keys: set[str] = set()

    def add(prefix: str, node: dict) -> None:
        for key, value in node.items():
            if key in ("defaults", "hydra"):
                continue
            name = f"{prefix}{key}"
            keys.add(name)
            if isinstance(value, dict):
                add(f"{name}.", value)

    def load(path: Path) -> dict:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}

    try:
        primary = load(CONF_DIR / f"{config_name}.yaml")
        add("", primary)
        groups = {_group_of(item) for item in primary.get("defaults") or []}  # only the groups this config uses
        for path in CONF_DIR.glob("*/**/*.yaml"):  # a nested group (trainer/strategy) is a nested setting
            group = path.parent.relative_to(CONF_DIR).parts
            if group[0] not in groups or group[0] in ("experiment", "hydra"):  # experiments patch other groups'
                continue                                                      # settings; hydra is Hydra's
            is_global = path.read_text().startswith("# @package _global_")  # e.g. parallel/: top-level settings
            add("" if is_global else ".".join(group) + ".", load(path))
    except Exception:  # noqa: BLE001 - suggestions are a courtesy; never hide the real error behind another
        pass
    return sorted(keys)


def _group_of(item) -> str | None:
    """The group a defaults-list entry selects from (``{"override /trainer/strategy": ...}`` -> ``trainer``)."""
    if not isinstance(item, dict) or not item:
        return None
    key = next(iter(item)).split()[-1].lstrip("/")  # drop "override" / "optional"
    return key.split("/")[0].split("@")[0]
