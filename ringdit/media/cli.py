"""``key=value`` command lines for the media tools (Hydra's override syntax, without Hydra's run directories)."""

from __future__ import annotations

from omegaconf import OmegaConf

from ringdit.errors import ConfigError


def parse_settings(argv: list[str], defaults: dict, required: tuple[str, ...], usage: str) -> dict:
    """``argv`` (``key=value`` items; values parsed as YAML, so ``resolution=[480,832]`` is a list) over
    ``defaults``; an unknown or missing key is a ``ConfigError`` that shows ``usage``."""
    pairs = [arg for arg in argv if "=" in arg]
    stray = [arg for arg in argv if "=" not in arg]
    if stray:
        raise ConfigError(f"{stray[0]!r} is not a key=value setting; usage: {usage}")
    given = {}
    for pair in pairs:  # one at a time, so that a value that does not parse is named
        try:
            given.update(OmegaConf.to_container(OmegaConf.from_dotlist([pair])))
        except Exception as error:  # noqa: BLE001 - YAML / OmegaConf grammar errors have no common base class
            detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"{pair!r} is not a valid key=value setting ({detail}); values are YAML: quote one "
                              f"that holds [ {{ or : (key=\"'[odd]'\"); usage: {usage}") from None
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]}=...; the settings are {', '.join(defaults)}")
    settings = {**defaults, **given}
    missing = [key for key in required if settings.get(key) in (None, "")]
    if missing:
        raise ConfigError(f"{missing[0]}= is required; usage: {usage}")
    return settings
