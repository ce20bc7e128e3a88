"""``Layout``: the processes a run starts and how they split the work -- dp x ring x ulysses ranks on devices x nodes
processes of one device type, the attention backend they run, and how the strategy holds the model (DDP replicates
it; FSDP shards it over world / ``replicate_degree`` ranks, its state on the device or in host memory) -- checked
once, from the config and the world size, before any process is spawned.

It is the one model of the layout: the strategy set-up (``ringdit.training.run``), the mesh and the models, the
memory estimate (``ringdit.costs``) and the planner (``ringdit.plan``: one ``Layout`` per candidate) read it; none
of them reads ``trainer.strategy`` or the degrees again. It lives outside ``ringdit.spec`` so that the memory estimate,
which the spec calls, can take it without importing the spec. Also here: launches whose other ranks would never come
(a node count with no cluster launcher, a stray ``LOCAL_RANK``), refused before Lightning waits for them.
"""

from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from ringdit.attention import validate_attention_config
from ringdit.common.errors import ConfigError, require_count
from ringdit.parallel.mesh import ParallelDims, build_shard_mesh, check_degrees, init_sequence_parallel


FORWARD_AD_METHODS = ("scm", "rcm")  # distill= methods whose loss takes a JVP through the model
STRATEGIES = ("ddp", "fsdp")  # what a strategy class declares as its ``layout_strategy``


@dataclass(frozen=True)
class Layout:
    """world = dp x ring x ulysses ranks = devices per node x nodes processes (ranked as ``ringdit.parallel.mesh``
    says), and how the strategy holds the model on them.

    ``Layout.from_config`` reads a run's; a layout that is only planned (``ringdit.plan``'s candidates, a benchmark's
    estimate) is built from its degrees: ``Layout(dp_degree=4, strategy="fsdp")`` (devices: the ranks, one node)."""

    dp_degree: int = 1
    ring_degree: int = 1
    ulysses_degree: int = 1
    devices: int | None = None  # processes per node; None: every rank on one node
    num_nodes: int = 1
    device_type: str = "cuda"   # cpu | cuda
    attention_backend: str = "torch_flash"  # resolved: null picks the best available (ring-capable with ring > 1)
    strategy: str = "ddp"       # ddp (replicated) | fsdp (sharded): what trainer.strategy's class declares
    replicate_degree: int = 1   # FSDP's HSDP: shard within world / replicate_degree ranks, replicate across them
    cpu_offload: bool = False   # FSDP: the sharded weights, gradients and optimizer state in host memory
    cfg_parallel: bool = False  # sampling: the two halves of guidance on two data-parallel replicas

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {' | '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.devices is None:
            object.__setattr__(self, "devices", -(-self.ranks // self.num_nodes))

    @property
    def sp_degree(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def ranks(self) -> int:
        """dp x ring x ulysses (``from_config`` checks it is the world size)."""
        return self.dp_degree * self.sp_degree

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def fsdp(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def shard_degree(self) -> int:
        """The ranks one parameter is split over: FSDP's shard group (world / replicate_degree), DDP's 1."""
        return self.ranks // self.replicate_degree if self.fsdp else 1

    # ---- the mesh it lays out (torchtitan's ParallelDims.build_mesh: from the validated degrees) ------------------
    def build_mesh(self, device_type: str, *, timeout: datetime.timedelta | None = None) -> ParallelDims:
        """The ``(dp, ring, ulysses)`` mesh of these degrees over the default process group, as this rank's
        ``ParallelDims`` (with the CFG-parallel groups where ``cfg_parallel``); one process without torch.distributed.
        Collective: every rank calls it."""
        return init_sequence_parallel(self.ring_degree, self.ulysses_degree, timeout=timeout,
                                      cfg_parallel=self.cfg_parallel, device_type=device_type)

    def build_shard_mesh(self, device_type: str, *, timeout: datetime.timedelta | None = None):
        """FSDP's mesh over the ``ranks``: ``("world",)``, or HSDP's ``("replicate", "shard")`` with
        ``replicate_degree`` groups. Collective."""
        return build_shard_mesh(self.ranks, self.replicate_degree, device_type, timeout)

    @classmethod
    def from_config(cls, cfg: DictConfig, *, training: bool) -> Layout:
        """Check the launch, the degrees, that they match the device count, the strategy and the attention backend.

        The layout is the settings' dp x ring x ulysses; the processes Lightning starts (trainer.devices per node x
        trainer.num_nodes) must be exactly that many, so that dp_degree is what runs, not a default that the device
        count can silently overrule. Checked in this order: the degrees first, as a wrong one makes the default
        device count (their product) wrong too.
        """
        check_launch_environment(cfg.trainer)
        check_strategy_degrees(cfg)
        dp, ring, ulysses = cfg.get("dp_degree", 1), cfg.ring_degree, cfg.ulysses_degree
        require_count("dp_degree", dp)
        check_degrees(ring, ulysses)
        world, layout = world_size(cfg.trainer), dp * ring * ulysses
        if world != layout:
            devices, nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
            fix = (f"set dp_degree={world // (ring * ulysses)}" if world % (ring * ulysses) == 0
                   else f"choose degrees whose product is {world}")
            raise ConfigError(f"dp_degree x ring_degree x ulysses_degree = {dp} x {ring} x {ulysses} = {layout} "
                              f"ranks, but trainer.devices x trainer.num_nodes = {devices} x {nodes} = {world} "
                              f"processes; {fix}, or leave trainer.devices unset (it defaults to the product, on one "
                              f"node)")
        strategy = strategy_kind(cfg.trainer)
        for setting in ("cfg_parallel", "trainer.strategy.cfg_parallel"):  # the strategy's is what runs
            value = OmegaConf.select(cfg, setting, default=False)
            if not isinstance(value, bool):
                raise ConfigError(f"{setting} must be true or false, got {value!r}")
        cfg_parallel = OmegaConf.select(cfg, "trainer.strategy.cfg_parallel", default=bool(cfg.get("cfg_parallel")))
        if cfg_parallel and dp % 2:
            raise ConfigError(f"cfg_parallel=true runs the two halves of guidance on two data-parallel replicas, so "
                              f"it needs an even number of them, got {dp}; set dp_degree to an even number (2)")
        replicate = OmegaConf.select(cfg, "trainer.strategy.replicate_degree", default=1)
        require_count("trainer.strategy.replicate_degree", replicate, hint="use 1 to shard over every rank")
        if replicate > 1 and world % replicate:
            raise ConfigError(f"trainer.strategy.replicate_degree={replicate} does not divide the world size {world} "
                              f"(HSDP shards within world / replicate_degree ranks); use a divisor of {world}, e.g. "
                              f"the dp_degree to shard within each sequence-parallel group and replicate across them")
        cpu_offload = OmegaConf.select(cfg, "trainer.strategy.cpu_offload", default=False)
        if not isinstance(cpu_offload, bool):
            raise ConfigError(f"trainer.strategy.cpu_offload must be true or false, got {cpu_offload!r}")
        kind = device_type(cfg.trainer)
        # consistency distillation (distill=scm / rcm) takes a JVP through the student: its attention needs a
        # forward-mode rule, checked here, before any rank starts
        forward_ad = training and OmegaConf.select(cfg, "distill.method", default="none") in FORWARD_AD_METHODS
        backend = validate_attention_config(cfg.attention_backend, ring_degree=ring, training=training,
                                            forward_ad=forward_ad, device_type=kind)
        nodes = cfg.trainer.get("num_nodes", 1)
        return cls(dp_degree=dp, ring_degree=ring, ulysses_degree=ulysses, devices=world // nodes, num_nodes=nodes,
                   device_type=kind, attention_backend=backend, strategy=strategy,
                   replicate_degree=replicate, cpu_offload=cpu_offload, cfg_parallel=cfg_parallel)


def check_strategy_degrees(cfg: DictConfig) -> None:
    """``trainer.strategy.ring_degree`` / ``ulysses_degree`` are the top-level settings' (conf/trainer/strategy/*.yaml
    interpolate them, and the strategy is built from the ``Layout``): one set there directly would be overruled, so
    it is refused, pointing to the name that works."""
    strategy = OmegaConf.select(cfg, "trainer.strategy")
    if not OmegaConf.is_dict(strategy):
        return
    for name in ("ring_degree", "ulysses_degree"):
        if name in strategy and not OmegaConf.is_interpolation(strategy, name) and strategy[name] != cfg.get(name):
            raise ConfigError(f"trainer.strategy.{name}={strategy[name]!r} is set from {name} (the strategy takes "
                              f"the layout's degrees); use {name}={strategy[name]}")


def strategy_kind(trainer_cfg: DictConfig) -> str:
    """How ``trainer.strategy`` holds the model, ddp or fsdp: what its class declares (``layout_strategy``, set by
    ``RingDDPStrategy`` and ``RingFSDPStrategy`` and inherited by their subclasses), never its name."""
    strategy = trainer_cfg.get("strategy")
    target = strategy.get("_target_") if OmegaConf.is_dict(strategy) else None
    fix = ("use trainer/strategy=ddp (ringdit.training.RingDDPStrategy) or trainer/strategy=fsdp "
           "(ringdit.training.RingFSDPStrategy), or a subclass of one of them")
    if target is None:
        raise ConfigError(f"trainer.strategy._target_ is not set (trainer.strategy={strategy!r}): the ranks need a "
                          f"ringdit strategy, which builds the sequence-parallel mesh; {fix}")
    module, _, name = str(target).rpartition(".")
    try:
        kind = getattr(getattr(importlib.import_module(module), name), "layout_strategy", None)
    except Exception as error:  # noqa: BLE001 -- an import of the user's class fails in any way
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"trainer.strategy._target_={target!r} cannot be imported ({reason}); {fix}") from None
    if kind not in STRATEGIES:
        raise ConfigError(f"trainer.strategy._target_={target!r} is not a ringdit strategy (it declares no "
                          f"layout_strategy of {' | '.join(STRATEGIES)}): {fix}")
    return kind


def device_type(trainer_cfg: DictConfig) -> str:
    """``trainer.accelerator`` as the device the ranks run on: cuda or cpu."""
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA device is visible; use trainer=cpu")
        return "cuda"
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator != "cpu":
        raise ConfigError(f"trainer.accelerator must be auto, cpu or gpu, got {accelerator!r}")
    return "cpu"


def world_size(trainer_cfg: DictConfig) -> int:
    """Processes the trainer will run: devices per node x nodes."""
    devices, nodes = trainer_cfg.get("devices", 1), trainer_cfg.get("num_nodes", 1)
    if devices in ("auto", -1, "-1"):
        devices = torch.cuda.device_count() if device_type(trainer_cfg) == "cuda" else 1
    elif isinstance(devices, str) and "," in devices:
        devices = len([d for d in devices.split(",") if d.strip()])
    elif OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        devices = len(devices)
    try:
        devices = int(devices)
    except (TypeError, ValueError):
        raise ConfigError(f"trainer.devices must be a count, a list of ids or 'auto', got {devices!r}") from None
    require_count("trainer.devices", devices)
    require_count("trainer.num_nodes", nodes)
    return devices * nodes


# ---- launches whose other ranks would never come ---------------------------------------------------------------


def cluster_launcher() -> str | None:
    """The launcher that started this process and will start the other ranks, as Lightning detects them."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")):
        return "torchrun"
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "SLURM"
    if "LSB_JOBID" in env and "JSM_NAMESPACE_RANK" in env:
        return "LSF"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "MPI"
    if "KUBERNETES_PORT" in env and all(k in env for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE")):
        return "Kubeflow"
    return None


def check_launch_environment(trainer_cfg: DictConfig) -> None:
    """Refuse launches that would wait for ranks nobody starts (the rest is bounded by
    ``trainer.strategy.rendezvous_timeout_s``)."""
    if cluster_launcher() is not None:
        return
    nodes, env = trainer_cfg.get("num_nodes", 1), os.environ
    if nodes > 1 and not ("NODE_RANK" in env and "MASTER_ADDR" in env):
        raise ConfigError(
            f"trainer.num_nodes={nodes} but no cluster launcher started this process (no torchrun, SLURM, MPI "
            f"environment) and NODE_RANK / MASTER_ADDR are not set, so the other nodes' ranks would never join: "
            f"launch with srun or `torchrun --nnodes={nodes} ...` on every node, or set NODE_RANK, MASTER_ADDR and "
            f"MASTER_PORT on each; on one machine use trainer.num_nodes=1 and trainer.devices")
    if "LOCAL_RANK" in env and "WORLD_SIZE" not in env and world_size(trainer_cfg) > 1:
        raise ConfigError(
            f"LOCAL_RANK={env['LOCAL_RANK']} is set in the environment but no launcher started this process (no "
            f"WORLD_SIZE, torchrun or SLURM): Lightning would take it for one rank of an external launch and wait "
            f"for {world_size(trainer_cfg)} ranks that never come; unset LOCAL_RANK (Lightning then starts the ranks "
            f"itself) or launch with torchrun")
