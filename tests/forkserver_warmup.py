"""Imported by the tests' fork server only (the last of ``tests.distributed.PRELOAD``): what every rank forked from
it would otherwise do again at its start, done once per pytest worker. Found by sampling forked ranks with py-spy
and measured by the CPU seconds of a rank of a tiny 2-rank train.py run (0.85 -> 0.61 s):

- the imports a run makes late (the digits data module imports scikit-learn when it sets up, PIL its PNG plugin on
  the first grid, Lightning's DDP its comm hooks), and the YAML of conf/ parsed into the cache tests.helpers keeps
  per process (``_compose_once_per_command``);
- ``gc.freeze()`` last: the collector of a forked rank then skips everything the server holds, instead of walking
  it (and touching, so copying, its pages). Without it the warm-up above made a rank slower, not faster."""

import gc
import importlib

from hydra import compose, initialize_config_dir
from hydra._internal.sources_registry import SourcesRegistry
from hydra.core.global_hydra import GlobalHydra

from tests.helpers import CONF  # importing it sets up the cache of parsed files

for module in ("sklearn.datasets", "PIL.PngImagePlugin", "torch.distributed.algorithms.ddp_comm_hooks",
               "torch.utils.serialization"):
    importlib.import_module(module)

source = SourcesRegistry.instance().resolve("file")(provider="main", path=f"file://{CONF}")
for path in sorted(CONF.rglob("*.yaml")):  # every file of conf/
    source.load_config(path.relative_to(CONF).as_posix())
with initialize_config_dir(str(CONF), version_base="1.3"):  # and Hydra's own: one composition
    compose("train", return_hydra_config=True)
GlobalHydra.instance().clear()

gc.freeze()
