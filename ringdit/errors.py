"""Errors a user can act on; train.py and infer.py show them as one line (``ringdit.config.user_errors``)."""


class ConfigError(ValueError):
    """A setting that cannot work."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite (``nonfinite_loss=stop``)."""


class CheckpointError(ValueError):
    """A weights file that is missing, unreadable, unsafe or does not fit the model."""
