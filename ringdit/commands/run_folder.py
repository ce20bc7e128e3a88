"""One run per run folder: a launch never writes over the records of another run.

Lightning's CSVLogger deletes an existing ``metrics.csv`` when it starts, checkpoints and sample grids of the same
names are replaced, and ``infer.py`` rewrites ``samples.npz``: two launches with the same ``hydra.run.dir`` would
silently lose the first one's records. So before any rank is spawned, the launching process claims the folder with
a small record (``.<task>-run.json``: who started it, when, with which command) and refuses a folder that already
holds a run of the same task, finished or still running, unless ``ckpt_path`` resumes a checkpoint of that folder
(then the loggers append: ``ringdit.training.loggers.AppendingCSVLogger``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from ringdit.common.errors import ConfigError
from ringdit.commands.launcher import first_process

# What each entry point writes into its run folder (the marker aside): a folder holding any of them holds a run.
RECORDS = {
    "train": ("checkpoints", "csv/metrics.csv", "tensorboard", "wandb", "samples"),
    "infer": ("samples.npz", "samples.png", "samples.gif"),
}


def marker(folder: Path, task: str) -> Path:
    return folder / f".{task}-run.json"


def claim_run_folder(output_dir: str | Path, task: str, *, resumes: str | None = None) -> None:
    """Refuse ``output_dir`` if it holds a ``task`` run (unless ``resumes``, a checkpoint path, lies inside it),
    then mark it as this run's. Call in the launching process once every other check has passed, so that a refused
    launch leaves nothing that would refuse the corrected one. Only the job's first process claims it."""
    if not first_process():  # the other ranks share its folder, or make their own
        return
    folder = Path(output_dir).expanduser().resolve()
    record = marker(folder, task)
    resuming = resumes is not None and folder in Path(resumes).expanduser().resolve().parents
    if not resuming:
        held = [name for name in (record.name, *RECORDS.get(task, ())) if (folder / name).exists()]
        if held:
            raise ConfigError(_refusal(folder, task, held, record))
    folder.mkdir(parents=True, exist_ok=True)
    content = json.dumps({"task": task, "pid": os.getpid(), "host": socket.gethostname(),
                          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}, indent=1)
    try:  # exclusive: of two launches into one folder at the same moment, one gets it
        with open(record, "w" if resuming else "x") as file:
            file.write(content + "\n")
    except FileExistsError:
        raise ConfigError(_refusal(folder, task, [record.name], record)) from None


def _refusal(folder: Path, task: str, held: list[str], record: Path) -> str:
    started = ""
    try:
        previous = json.loads(record.read_text())
        started = f", started {previous['started']} by pid {previous['pid']} on {previous['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    resume = f" or resume it with ckpt_path={folder / 'checkpoints' / 'last.ckpt'}," if task == "train" else ""
    return (f"hydra.run.dir={folder} already holds a run of {task}.py ({', '.join(held)}{started}); a new run there "
            f"would overwrite its records: choose another hydra.run.dir,{resume} or leave hydra.run.dir unset (each "
            f"run gets a folder of its own)")
