"""The command-line entry of every ringdit command (``train.py``, ``infer.py``, ``python -m ringdit.*``): Hydra's
composition with one-line errors (exit code 2) for mistakes in the settings, did-you-mean hints for misspelt keys,
and the resolvers the configs use.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sys
from pathlib import Path

from hydra.errors import InstantiationException
from omegaconf import OmegaConf


def register_resolvers() -> None:
    """``${mul:a,b,c}``: the product (the default device count dp x ring x ulysses); ``${min:a,b}``;
    ``${run_id:}``: a short random suffix that keeps two runs started in the same second apart (cached per config,
    like Hydra's ``${now:}``, so that a run and the jobs of one sweep see one value)."""
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs), replace=True)
    OmegaConf.register_new_resolver("min", lambda *xs: min(int(x) for x in xs), replace=True)
    OmegaConf.register_new_resolver("run_id", lambda: secrets.token_hex(3), use_cache=True, replace=True)


SETTINGS_ERRORS = (ValueError, TypeError, FileNotFoundError, InstantiationException)


@contextlib.contextmanager
def user_errors(*kinds: type[BaseException]):
    """Show an error of ``kinds`` (default: what checking settings raises) as its one-line cause and exit with code
    2; ``HYDRA_FULL_ERROR=1`` shows the traceback. Wrap only the phase where such errors mean a user mistake."""
    try:
        yield
    except kinds or SETTINGS_ERRORS as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        message = str(error).strip()
        if isinstance(error, InstantiationException) and error.__cause__ is not None:
            message = f"{message.splitlines()[0]} {error.__cause__}"
        print(f"Error: {message}\n(set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr, flush=True)
        sys.exit(2)


# ---- Hydra's own errors (composition, overrides, ???, the run folder) as one line and exit code 2 -----------------

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def model_preset(name: str) -> dict:
    """The model config that ``model=<name>`` selects (``conf/model/<name>.yaml`` with what it inherits), for code
    that builds a preset without a run: ``hydra.utils.instantiate(model_preset("dit_xl"), input_size=32, ...)``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=[f"model={name}"]).model)


def hydra_main(config_name: str):
    """``hydra.main(config_path="conf", config_name=...)`` whose own mistakes -- a misspelt key, an unknown group
    option, a missing ``???`` value, an override that does not parse, a run folder that cannot be created -- end
    like every other settings error: one line, exit code 2 (``HYDRA_FULL_ERROR=1``: Hydra's usual report).

    Hydra reports those inside ``hydra._internal.utils.run_and_report`` (multi-line, exit 1); it is replaced for the
    duration of the call by one that first tries ``hydra_error_message`` and otherwise defers to Hydra's."""
    import functools

    import hydra
    from hydra._internal import utils as hydra_utils

    def decorator(task):
        started = []

        @functools.wraps(task)
        def run_task(cfg):
            started.append(True)
            try:
                return task(cfg)
            except Exception as error:  # here, or Hydra logs "Error executing job" before its report
                message = hydra_error_message(error, config_name, in_task=True)
                if message is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                _exit_with(message)

        main = hydra.main(version_base="1.3", config_path="conf", config_name=config_name)(run_task)

        @functools.wraps(task)
        def entry():
            original = hydra_utils.run_and_report

            def run_and_report(func):
                try:
                    return func()
                except Exception as error:  # noqa: BLE001 - unknown errors go to Hydra's own report below
                    message = hydra_error_message(error, config_name, in_task=bool(started))
                    if message is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                        def again():
                            raise error
                        return original(again)
                    _exit_with(message)

            hydra_utils.run_and_report = run_and_report
            try:
                main()
            finally:
                hydra_utils.run_and_report = original

        return entry

    return decorator


def _exit_with(message: str) -> None:
    print(f"Error: {message}\n(set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr, flush=True)
    sys.exit(2)


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
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            return f"no setting named '{key}'; {hint}(python {config_name}.py --cfg job lists them; a new key " \
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
        add("", load(CONF_DIR / f"{config_name}.yaml"))
        for path in CONF_DIR.glob("*/**/*.yaml"):  # a nested group (trainer/strategy) is a nested setting
            group = path.parent.relative_to(CONF_DIR).parts
            if group[0] in ("experiment", "hydra"):  # experiments patch other groups' settings; hydra is Hydra's
                continue
            is_global = path.read_text().startswith("# @package _global_")  # e.g. parallel/: top-level settings
            add("" if is_global else ".".join(group) + ".", load(path))
    except Exception:  # noqa: BLE001 - suggestions are a courtesy; never hide the real error behind another
        pass
    return sorted(keys)
