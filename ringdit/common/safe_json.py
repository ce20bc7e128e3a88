"""JSON that a user hands ringdit (TeaCache coefficients, prompt-file lines, metadata inside data files) read with
bounds: a file larger than its kind ever needs is refused before it is read, text nested too deeply for Python's
parser (a ``RecursionError``) is refused like any other malformed JSON, and every failure is one ``ConfigError``
naming the file or setting and saying what to give instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringdit.common.errors import ConfigError

MAX_JSON_BYTES = 16 * 2**20  # no JSON file ringdit reads from a user (coefficients, plans, names) comes near this


def parse_json(text: str, where: str, *, fix: str, excerpt: bool = False) -> Any:
    """``text`` parsed, or a ``ConfigError`` "<where> is not valid JSON (<why>[: <the text's start>]); <fix>"
    (``excerpt``: quote the start of a short text, e.g. a metadata entry, where no line number helps)."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # "\ud800": an escape JSON allows, no character
        return value
    except json.JSONDecodeError as error:
        why = str(error)
    except RecursionError:  # "[[[[..." deeper than the interpreter's stack: the parser gives up, not an answer
        why = "nested too deeply"
    except UnicodeEncodeError as error:  # a tokenizer or file writer would fail on it later, far from here
        why = f"a lone UTF-16 surrogate escape {error.object[error.start:error.end]!r} is no character"
    shown = f": {text[:60]!r}" if excerpt else ""
    raise ConfigError(f"{where} is not valid JSON ({why}{shown}); {fix}")


def read_json(path: str | Path, where: str, *, fix: str, max_bytes: int = MAX_JSON_BYTES,
              kind: type | None = None) -> Any:
    """The JSON file ``path``: at most ``max_bytes`` (its size is checked before reading), UTF-8, parsed, and of type
    ``kind`` (dict or list) when given; anything else is a ``ConfigError`` that starts with ``where`` and ends with
    ``fix``."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ConfigError(f"{where} is not a file; {fix}")
        if size > max_bytes:
            raise ConfigError(f"{where} is {size:,} bytes, more than the {max_bytes:,} such a file can need; {fix}")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; {fix}") from None
    except OSError as error:
        raise ConfigError(f"{where} cannot be read ({error.strerror or error}); {fix}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where} is not UTF-8 text ({error.reason} at byte {error.start}); {fix}") from None
    value = parse_json(text, where, fix=fix)
    if kind is not None and not isinstance(value, kind):
        raise ConfigError(f"{where} holds a JSON {_json_type(value)}, not {'an object' if kind is dict else 'a list'}; "
                          f"{fix}")
    return value


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value),
                                                                                                 "number")
