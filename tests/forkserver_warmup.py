"""Imported by the tests' fork server only (the last of ``tests.distributed.PRELOAD``): what every rank forked from
it would otherwise do again at its start, done once per pytest worker. Found by sampling forked ranks with py-spy
and measured by the CPU seconds of a rank of a tiny 2-rank train.py run (0.85 -> 0.61 s):

- the imports a run makes late (the digits data module imports scikit-learn when it sets up, PIL its PNG plugin on
  the first grid, Lightning's DDP its comm hooks), and the YAML of conf/ parsed (tests.helpers keeps each parsed
  file, per process);
- ``gc.freeze()`` last: the collector of a forked rank then skips everything the server holds, instead of walking
  it (and touching, so copying, its pages). Without it the warm-up above made a rank slower, not faster."""

import gc
import importlib

from tests.helpers import parse_every_config

for module in ("sklearn.datasets", "PIL.PngImagePlugin", "torch.distributed.algorithms.ddp_comm_hooks",
               "torch.utils.serialization"):
    importlib.import_module(module)
parse_every_config()
gc.freeze()
