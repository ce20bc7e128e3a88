"""What to sample: class ids from ``labels``, prompts from a ``prompt_file`` (``read_prompt_file``), and the
requests by position (``SampleRequests``), batched one shape at a time (``ShapeBatches``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, Dataset

from ringdit.common.errors import ConfigError
from ringdit.common.safe_json import parse_json
from ringdit.sampling.sizes import Shape
from ringdit.common.seeding import Stream, seed_of


def resolve_labels(labels, num_samples: int, data_info: dict) -> list[int]:
    """Class ids for ``num_samples`` samples: the given ids or class names, cycled; all classes when None.

    A number is a class id (``labels=[3]`` is class 3, also when a folder is named "7"); other strings are names.
    """
    names = [str(n) for n in data_info.get("class_names") or []]
    num_classes = data_info["num_classes"]
    if labels is None:
        labels = list(range(num_classes))
    elif isinstance(labels, (int, str)):
        labels = [labels]
    ids = []
    for label in labels:
        if isinstance(label, str) and label in names and not label.isdigit():
            ids.append(names.index(label))
            continue
        if isinstance(label, float) and not label.is_integer() or isinstance(label, bool) \
                or isinstance(label, str) and not label.isascii():  # int() would read "３" (full-width) as 3
            raise ValueError(f"labels: {label!r} is not a class id (a whole number) nor one of the class names {names}")
        try:
            value = int(label)
        except (TypeError, ValueError):
            raise ValueError(f"labels: {label!r} is neither a class id nor one of the class names {names}") from None
        if not 0 <= value < num_classes:
            raise ValueError(f"labels: class id {value} is out of range; this model has classes 0..{num_classes - 1}")
        ids.append(value)
    if not ids:
        raise ValueError("labels is empty; give class ids, class names, or null for all classes")
    return [ids[i % len(ids)] for i in range(num_samples)]


PROMPT_KEYS = ("prompt", "size", "frames", "negative_prompt")
PROMPT_LINE = '{"prompt": "a red fox running", "size": [480, 832], "frames": 81}'


@dataclass(frozen=True)
class PromptLine:
    """One prompt of a ``prompt_file``: its text and, optionally, its own size / frames / negative prompt (checked by
    ``SampleSizes.shape`` with ``where``, which names the file and line)."""

    prompt: str
    where: str                      # "prompt_file=<path> line <n>: "
    size: object = None             # as written: [H, W] (checked later, in the data's units)
    frames: object = None
    negative_prompt: str | None = None
    options: dict = field(default_factory=dict)  # the caller's own keys (read_prompt_file's ``options``), as written


def read_prompt_file(path, setting: str = "prompt_file", options: tuple[str, ...] = ()) -> list[PromptLine]:
    """The prompts of a ``.jsonl`` file (one JSON object per line: ``prompt`` and optionally ``size`` [H, W],
    ``frames``, ``negative_prompt``, and the caller's ``options`` keys, kept as written for it to check) or a ``.txt``
    file (one prompt per line); blank lines are skipped. Data, never code: each line is parsed as JSON and checked, a
    mistake is one ``ConfigError`` naming the file and line."""
    file = Path(str(path)).expanduser()
    kind = file.suffix.lower()
    if kind not in (".jsonl", ".txt"):
        raise ConfigError(f"{setting}={path} is not a .jsonl or .txt file; give one JSON object per line ({PROMPT_LINE}"
                          f") in a .jsonl file, or one prompt per line in a .txt file")
    if not file.is_file():
        raise ConfigError(f"{setting}={path} does not exist" + (" (it is a folder)" if file.is_dir() else "") +
                          f"; give a .jsonl file of lines such as {PROMPT_LINE}, or a .txt file of prompts")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{setting}={path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{setting}={path} line {number}: "
        lines.append(PromptLine(raw.strip(), where) if kind == ".txt" else _prompt_line(raw, where, options))
    if not lines:
        raise ConfigError(f"{setting}={path} holds no prompts; write one per line")
    return lines


def _prompt_line(raw: str, where: str, options: tuple[str, ...] = ()) -> PromptLine:
    entry = parse_json(raw, f"{where}the line", fix=f"each line is one object such as {PROMPT_LINE}")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}a JSON {type(entry).__name__}, not an object such as {PROMPT_LINE}")
    unknown = [key for key in entry if key not in PROMPT_KEYS + options]
    if unknown:
        raise ConfigError(f"{where}unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; a "
                          f"line holds {', '.join(PROMPT_KEYS + options)} (all but prompt optional)")
    prompt, negative = entry.get("prompt"), entry.get("negative_prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}\"prompt\" must be a non-empty string, got {prompt!r}")
    if negative is not None and not isinstance(negative, str):
        raise ConfigError(f"{where}\"negative_prompt\" must be a string, got {negative!r}")
    return PromptLine(prompt, where, entry.get("size"), entry.get("frames"), negative,
                      {key: entry[key] for key in options if key in entry})


class SampleRequests(Dataset):
    """Position p = (i, condition_i, the noise seed of sample i[, extra_i]): what sample i is, independent of how many
    samples there are, their shapes and how they are split over ranks.

    ``conditions``: class ids, or a dict of text tensors ``(N, ...)`` (one prompt embedding per sample).
    ``shapes``: each sample's shape ``([T,] H, W)`` (None: every sample at the data's; the items are then 3-tuples).
    The positions hold the samples by shape -- the shapes in order of first appearance, each shape's samples in
    index order -- so that ``ShapeBatches`` batches them without mixing shapes; every item carries its index i,
    which names its files. ``extra_i``: ``shape`` (its shape as a tensor) and, with ``negatives`` (a dict of
    ``(N, ...)`` tensors, the negative prompt of each sample) and ``negative_given`` ``(N,)`` bool (False: the
    run's negative prompt, or the empty one), ``negative`` and ``negative_given``.
    """

    def __init__(self, conditions: list[int] | dict[str, torch.Tensor], seed: int, shapes: list[Shape] | None = None,
                 negatives: dict[str, torch.Tensor] | None = None, negative_given: torch.Tensor | None = None):
        self.conditions, self.seed = conditions, seed
        self.shapes = [tuple(int(s) for s in shape) for shape in shapes] if shapes is not None else None
        self.negatives, self.negative_given = negatives, negative_given
        if self.shapes is not None and len(self.shapes) != len(self):
            raise ValueError(f"{len(self.shapes)} shapes for {len(self)} samples")
        first = {shape: k for k, shape in enumerate(self.distinct_shapes())}
        self.order = sorted(range(len(self)), key=lambda i: first[self.shapes[i]]) if self.shapes else \
            list(range(len(self)))

    def __len__(self) -> int:
        if isinstance(self.conditions, dict):
            return len(next(iter(self.conditions.values())))
        return len(self.conditions)

    def __getitem__(self, position: int):
        i = self.order[position]
        if isinstance(self.conditions, dict):
            item = i, {key: value[i] for key, value in self.conditions.items()}, self.noise_seed(i)
        else:
            item = i, self.conditions[i], self.noise_seed(i)
        if self.shapes is None:
            return item
        extra = {"shape": torch.tensor(self.shapes[i])}
        if self.negatives is not None:
            extra["negative"] = {key: value[i] for key, value in self.negatives.items()}
            extra["negative_given"] = self.negative_given[i]
        return *item, extra

    def noise_seed(self, i: int) -> int:
        return seed_of(Stream.INFERENCE, self.seed, i)

    def distinct_shapes(self) -> list[Shape]:
        """The samples' shapes, each once, in order of first appearance (none without ``shapes``)."""
        return list(dict.fromkeys(self.shapes or ()))

    def batches(self, batch_size: int) -> ShapeBatches:
        """The batch sampler of a prediction ``DataLoader`` over these requests (see ``ShapeBatches``)."""
        from torch.utils.data import SequentialSampler

        shapes = tuple(self.shapes[i] for i in self.order) if self.shapes else (None,) * len(self)
        batches = type("ShapeBatches", (ShapeBatches,), {"shapes": shapes})  # the shape of each position
        return batches(SequentialSampler(self), batch_size, drop_last=False)


class ShapeBatches(BatchSampler):
    """``BatchSampler``'s batches of up to ``batch_size`` positions, also cut where the shape changes: one batch is
    one forward, of one shape. Lightning rebuilds a prediction batch sampler around this rank's slice of the positions
    (``cls(sampler, batch_size=..., drop_last=False)``), so the shapes are the class's (``SampleRequests.batches``
    makes the subclass); every rank of a sequence-parallel group slices the same positions, so gets the same
    batches."""

    shapes: tuple = ()  # the shape of each dataset position

    def __iter__(self):
        batch, shape = [], None
        for position in self.sampler:
            here = self.shapes[position]
            if batch and (here != shape or len(batch) == self.batch_size):
                yield batch
                batch = []
            batch.append(position)
            shape = here
        if batch:
            yield batch

    def __len__(self) -> int:
        return sum(1 for _ in self)
