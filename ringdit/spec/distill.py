"""``DistillSpec``: a distillation run's settings (``distill=dmd2``, ``scm``, ``rcm``), checked before any process
is spawned: the method, the student's steps and time grid, the critic's updates per student update, sCM's tangent
settings, the teacher (``init_from`` or ``model.pretrained``, checked against the model like any weights file) and
the objective it was trained with."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from torch import nn

from ringdit.diffusion.distillation import CONSISTENCY_METHODS, CRITIC_METHODS
from ringdit.diffusion.samplers import consistency_times
from ringdit.common.errors import ConfigError, require_count, require_number
from ringdit.spec.checkpoint import check_weights_file
from ringdit.spec.diffusion import check_sampling
from ringdit.training.gan_head import feature_block, feature_width

METHODS = ("none", "dmd2", "scm", "rcm")
# A distilled student samples in a few steps (DMD2: 1 to 4; the teachers' own samplers take 25 to 50). Every update
# simulates up to distill.steps student steps to reach the one it trains, so a long grid costs that many forwards per
# update (distill.steps=100000 never finished its first).
MAX_STUDENT_STEPS = 100


@dataclass(frozen=True)
class DistillSpec:
    method: str              # dmd2 | scm | rcm
    steps: int               # the student's sampling steps
    times: tuple[float, ...]  # its input times, 1 first, decreasing in (0, 1]
    critic_steps: int        # critic updates per student update (the two time-scale rule)
    cfg_scale: float         # the teacher's classifier-free guidance
    t_min: float             # the distribution-matching loss's noise levels: uniform in [t_min, t_max]
    t_max: float
    teacher: str | None      # the teacher's weights (init_from); None: the model's pretrained folder
    teacher_weights: str     # which weights of a ringdit .ckpt teacher: ema | model
    gradient_clip_val: float | None  # each update's gradient norm clip (trainer.gradient_clip_val)
    gan_loss: bool = False   # DMD2's GAN head on the critic's features (ringdit.training.gan_head)
    gan_block: int | None = None  # the repeated block whose output it reads; None: the middle one
    gan_generator_weight: float = 3e-3  # the student's GAN loss weight (DMD2's ImageNet-64 runs)
    gan_critic_weight: float = 1e-2  # the head's (and the critic's) GAN loss weight (DMD2's)
    regression_loss: bool = False  # DMD's regression onto teacher pairs, with a plain distance
    regression_weight: float = 0.25  # its weight (DMD's lambda_reg)
    regression_pairs: int = 64  # the pairs, sampled by the teacher once
    regression_batch: int | None = None  # pairs per student update (a fresh draw each update); None: all of them
    regression_distance: str = "mse"  # mse | pseudo_huber
    teacher_sampling: dict | None = None  # how the teacher samples the pairs: the run's sampler, steps, cfg_scale
    # scm / rcm (ringdit.training.consistency): TrigFlow's data scale, the logit-normal training times, the tangent
    # warm-up and normalisation; rcm: the weight of its DMD term
    sigma_data: float = 1.0
    p_mean: float = -0.8
    p_std: float = 1.6
    warmup_steps: int = 1000
    tangent_c: float = 0.1
    dmd_weight: float = 0.01
    critic_lr: float | None = None  # the critic's learning rate; None: the optimizer's (rCM: a fifth of the student's)
    first_step_share: float | None = None  # the share of updates that train the first step; None: 1 / steps

    @property
    def settings(self) -> dict:
        """What ``DistillationModule(distill=...)`` takes (and its checkpoints record)."""
        return {"method": self.method, "steps": self.steps, "times": list(self.times),
                "critic_steps": self.critic_steps, "cfg_scale": self.cfg_scale, "t_min": self.t_min,
                "t_max": self.t_max, "teacher": self.teacher, "teacher_weights": self.teacher_weights,
                "gradient_clip_val": self.gradient_clip_val, "gan_loss": self.gan_loss, "gan_block": self.gan_block,
                "gan_generator_weight": self.gan_generator_weight, "gan_critic_weight": self.gan_critic_weight,
                "regression_loss": self.regression_loss, "regression_weight": self.regression_weight,
                "regression_pairs": self.regression_pairs, "regression_batch": self.regression_batch,
                "regression_distance": self.regression_distance,
                "teacher_sampling": self.teacher_sampling, "sigma_data": self.sigma_data, "p_mean": self.p_mean,
                "p_std": self.p_std, "warmup_steps": self.warmup_steps, "tangent_c": self.tangent_c,
                "dmd_weight": self.dmd_weight, "critic_lr": self.critic_lr,
                "first_step_share": self.first_step_share}

    def student_sampling(self, sampling: dict) -> dict:
        """The run's sampling settings for the student: its own few-step sampler and grid, no guidance (previews
        and infer.py read them from the checkpoint)."""
        return {**sampling, "sampler": "fewstep", "steps": self.steps, "times": list(self.times), "cfg_scale": 1.0,
                "cfg_scale_2": None}

    @staticmethod
    def check_settings(cfg: DictConfig) -> None:
        """The settings alone (cheap: before the data is opened)."""
        distill = cfg.get("distill") or {}
        method = distill.get("method", "none")
        if method not in METHODS:
            raise ConfigError(f"distill.method must be one of {' | '.join(METHODS)}, got {method!r}")
        if method == "none":
            return
        require_count("distill.steps", distill.get("steps"), hint="the student's sampling steps, e.g. distill.steps=4")
        if distill.steps > MAX_STUDENT_STEPS:
            raise ConfigError(f"distill.steps={distill.steps} is not a few-step student: each student and critic update "
                              f"runs up to that many student forwards (backward simulation); distil at most "
                              f"{MAX_STUDENT_STEPS} steps (DMD2: 1 to 4), e.g. distill.steps=4")
        if method in CRITIC_METHODS:
            require_count("distill.critic_steps", distill.get("critic_steps"),
                          hint="critic updates per student update (DMD2's two time-scale rule: 5)")
        if method in CONSISTENCY_METHODS:
            check_consistency_settings(distill, method)
        student_times(distill.get("steps"), distill.get("times"), method)
        critic_lr = distill.get("critic_lr")
        if method in CRITIC_METHODS and critic_lr is not None and not (_finite(critic_lr) and critic_lr > 0):
            raise ConfigError(f"distill.critic_lr={critic_lr!r} must be a finite number > 0 (the critic's learning "
                              f"rate; rCM: a fifth of the student's, e.g. distill.critic_lr=4e-5 beside "
                              f"optimizer.lr=2e-4), or null for the optimizer's")
        share = distill.get("first_step_share")
        if method in CRITIC_METHODS and share is not None and not (_finite(share) and 0 <= share <= 1):
            raise ConfigError(f"distill.first_step_share={share!r} must be a number in [0, 1] (the share of updates "
                              f"whose backward simulation trains the student's first step, e.g. 0.75 for a "
                              f"2-step student that must also sample in 1), or null for an even share (1 / steps)")
        for key in ("t_min", "t_max") if method in CRITIC_METHODS else ():
            require_number(f"distill.{key}", distill.get(key), low=0, high=1, low_open=True)
        if method in CRITIC_METHODS and not distill.t_min < distill.t_max < 1:
            raise ConfigError(f"distill.t_min={distill.t_min} and distill.t_max={distill.t_max} bound the noise "
                              f"levels of the distribution-matching loss: 0 < t_min < t_max < 1 (DMD2: 0.02, 0.98)")
        if distill.get("cfg_scale") is not None:
            check_teacher_guidance(distill.get("cfg_scale"))
        for key in ("gan_loss", "regression_loss"):
            if not isinstance(distill.get(key, False), bool):
                raise ConfigError(f"distill.{key} must be true or false, got {distill.get(key)!r}")
        if distill.get("gan_loss") and method not in CRITIC_METHODS:
            raise ConfigError(f"distill.gan_loss=true with distill={method}: the GAN head reads the critic, and "
                              f"distill={method} trains none; use distill=rcm (sCM with a critic) or "
                              f"distill.gan_loss=false")
        if distill.get("gan_loss"):
            check_gan_settings(distill)
        if distill.get("regression_loss"):
            check_regression_settings(distill)
        precision = str(cfg.trainer.get("precision"))
        if precision.startswith("16"):
            why = ("the critic's updates do not go through the fp16 gradient scaler" if method == "dmd2" else
                   "the JVP's tangent dF/dt leaves fp16's range (sCM trains in fp32 / bf16) and the updates do not go "
                   "through the fp16 gradient scaler")
            raise ConfigError(f"trainer.precision={precision} with distill={method}: {why}; use 32-true, or "
                              f"bf16-mixed on GPUs")
        if cfg.trainer.get("accumulate_grad_batches", 1) != 1:
            raise ConfigError(f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches} with "
                              f"distill={method}: each student and critic update takes one batch; raise "
                              f"data.batch_size instead")

    @classmethod
    def from_config(cls, cfg: DictConfig, objective: dict, sampling: dict, model_config: dict, meta_model: nn.Module,
                    expert: str | None) -> DistillSpec | None:
        """The distillation ``cfg`` describes (None for ``distill=none``), against the objective, the model and the
        teacher's file."""
        distill = cfg.get("distill") or {}
        method = distill.get("method", "none")
        if method == "none":
            return None
        name = str(objective["_target_"]).rsplit(".", 1)[-1]
        if name != "FlowMatching":
            how = "" if method == "dmd2" else " (converted to TrigFlow through the flow's straight path)"
            raise ConfigError(f"distill={method} distils flow-matching models{how}, but diffusion.objective is "
                              f"{name}; distil a teacher trained with diffusion=flow")
        if expert is not None or model_config.get("boundary_ratio") is not None:
            # Why not one student per expert (docs/distillation.md, "Two-expert teachers"): the matching loss scores
            # each student step's clean sample at noise levels on both sides of the boundary, and the low expert's
            # steps start from the high expert's student (backward simulation), so neither expert distils alone.
            raise ConfigError(
                f"distill={method} of a two-expert model (model.boundary_ratio={model_config.get('boundary_ratio')}, "
                f"diffusion.expert={expert}) is refused: its experts cannot be distilled one per run -- DMD2 scores "
                f"each student step's sample at noise levels on both sides of the boundary (distill.t_min..t_max: "
                f"both teacher experts and a critic for both ranges), and the low expert's steps start from the high "
                f"expert's student (backward simulation) -- and a run distilling both is not built; distil a "
                f"one-transformer model instead (Wan 2.2 TI2V-5B: model=wan22_ti2v, or Wan 2.1); docs/distillation.md, "
                f"two-expert teachers")
        teacher = distill.get("teacher")
        if teacher is not None:  # a distilled student fine-tuned: init_from is the student, this its teacher
            if not isinstance(teacher, str) or not teacher:
                raise ConfigError(f"distill.teacher={teacher!r} must be the teacher's weights file (or null: "
                                  f"init_from's), e.g. distill.teacher=outputs/train/runs/<run>/checkpoints/last.ckpt")
            if not cfg.get("init_from"):
                raise ConfigError(f"distill.teacher={teacher} is the teacher, and the student starts from init_from, "
                                  f"which is not given: init_from=<the student to fine-tune> (a distilled checkpoint), "
                                  f"or distill.teacher=null init_from={teacher} to distil the teacher itself")
            check_weights_file("distill.teacher", teacher, meta_model, prefer=cfg.init_weights)
        if cfg.get("init_from"):  # checked here too: a resumed run reads its student from ckpt_path, not init_from
            check_weights_file("init_from", cfg.init_from, meta_model, prefer=cfg.init_weights)
        teacher = teacher or cfg.get("init_from")
        if not teacher and not model_config.get("pretrained"):
            raise ConfigError(f"distill={method} needs a teacher: init_from=<the teacher's checkpoint> (or, for a "
                              f"diffusers model, model.pretrained=<its folder>); the student and the critic start "
                              f"from it")
        cfg_scale = distill.get("cfg_scale")
        if cfg_scale is None:  # the run's own guidance, checked as the teacher's
            cfg_scale = sampling.get("cfg_scale", 1.0)
            check_teacher_guidance(cfg_scale, inherited=True)
        cfg_scale = float(cfg_scale)
        check_sampling(model_config, objective, {**sampling, "cfg_scale": cfg_scale}, prefix="distill.")
        clip = cfg.trainer.get("gradient_clip_val")
        options = {}  # the GAN head and the regression loss, when on
        if distill.get("gan_loss"):
            feature_width(feature_block(meta_model, distill.get("gan_block"))[0])  # a ConfigError saying why not
            options = {"gan_loss": True, "gan_block": distill.get("gan_block"),
                       "gan_generator_weight": float(distill.gan_generator_weight),
                       "gan_critic_weight": float(distill.gan_critic_weight)}
        if distill.get("regression_loss"):
            options.update(regression_loss=True, regression_weight=float(distill.regression_weight),
                           regression_pairs=distill.regression_pairs,
                           regression_batch=distill.get("regression_batch"),
                           regression_distance=distill.regression_distance,
                           teacher_sampling={"sampler": sampling.get("sampler"), "steps": sampling.get("steps"),
                                             "cfg_scale": cfg_scale, "cfg_scale_2": None, "times": None})
        if method in CONSISTENCY_METHODS:
            options.update(sigma_data=float(distill.sigma_data), p_mean=float(distill.p_mean),
                           p_std=float(distill.p_std), warmup_steps=int(distill.warmup_steps),
                           tangent_c=float(distill.tangent_c))
            if method == "rcm":
                options.update(dmd_weight=float(distill.dmd_weight))
        if method in CRITIC_METHODS and distill.get("critic_lr") is not None:
            options.update(critic_lr=float(distill.critic_lr))
        if method in CRITIC_METHODS and distill.get("first_step_share") is not None:
            options.update(first_step_share=float(distill.first_step_share))
        times = tuple(student_times(distill.steps, distill.get("times"), method))
        return cls(method=method, steps=distill.steps, times=times,
                   critic_steps=distill.critic_steps if method in CRITIC_METHODS else 0, cfg_scale=cfg_scale,
                   t_min=float(distill.get("t_min", 0.02)),
                   t_max=float(distill.get("t_max", 0.98)), teacher=teacher or None, teacher_weights=cfg.init_weights,
                   gradient_clip_val=float(clip) if clip else None, **options)


# The teacher's classifier-free guidance: 1 is its conditional prediction unguided, above 1 guided (DMD2: 1.75 on
# ImageNet, 8 on SDXL; DreamFusion's score distillation 100). Below 1 mixes in the unconditional prediction, which a
# student that always gets its condition is not meant to match; a negative scale guides away from the condition. Far
# above 100 a larger scale changes nothing but the rounding: the matching gradient is normalised by the guided
# prediction's size, so it tends to the direction of the condition's difference alone (and float32 overflows).
TEACHER_GUIDANCE = (1.0, 100.0)


def check_teacher_guidance(value, *, inherited: bool = False) -> None:
    """``distill.cfg_scale``, or with ``inherited`` the run's ``diffusion.sampling.cfg_scale`` that its null takes: a
    finite number in ``TEACHER_GUIDANCE``."""
    low, high = TEACHER_GUIDANCE
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if number and low <= value <= high:
        return
    given = (f"distill.cfg_scale=null takes the run's diffusion.sampling.cfg_scale={value!r}, which"
             if inherited else f"distill.cfg_scale={value!r}")
    raise ConfigError(f"{given} is not a teacher's guidance scale: give a number in [{low:g}, {high:g}] (1: the "
                      f"teacher unguided; DMD2 guides with 1.75 to 8), e.g. distill.cfg_scale=1.5")


def check_gan_settings(distill) -> None:
    """The GAN head's weights and block, alone (the block against the model: ``from_config``)."""
    for key, low, example in (("gan_generator_weight", ">= 0", "3e-3"), ("gan_critic_weight", "> 0", "1e-2")):
        value = distill.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (value == 0 and low == "> 0"):
            raise ConfigError(f"distill.{key}={value!r} must be a finite number {low} (DMD2: {example}); or "
                              f"distill.gan_loss=false for no GAN head")
    block = distill.get("gan_block")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)):
        raise ConfigError(f"distill.gan_block must be a block index (negative from the end) or null for the middle "
                          f"block, got {block!r}")


def student_times(steps: int, times, method: str = "dmd2") -> list[float]:
    """``distill.times``, checked: ``steps`` times, decreasing, in (0, 1]; null: ``steps`` even ones from 1, or for
    sCM / rCM rCM's grid (``consistency_times``: from t = 0.9877, TrigFlow's arctan(80))."""
    if times is None:
        return consistency_times(steps) if method in CONSISTENCY_METHODS else [1.0 - i / steps for i in range(steps)]
    times = OmegaConf.to_container(times) if OmegaConf.is_config(times) else times
    if not isinstance(times, (list, tuple)) or len(times) != steps \
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times):
        raise ConfigError(f"distill.times={times!r} is not a list of distill.steps={steps} times; give one time in "
                          f"(0, 1] per student step, 1 first, e.g. [1.0, 0.75, 0.5, 0.25], or null for even ones")
    if not all(0 < t <= 1 for t in times) or any(a <= b for a, b in zip(times, times[1:])):
        raise ConfigError(f"distill.times={list(times)} must decrease strictly and lie in (0, 1] (1 is pure noise, "
                          f"where the student starts); e.g. [1.0, 0.75, 0.5, 0.25]")
    return [float(t) for t in times]


def check_regression_settings(distill) -> None:
    """The regression loss's weight, pairs and distance."""
    weight = distill.get("regression_weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"distill.regression_weight={weight!r} must be a finite number > 0 (DMD: 0.25); or "
                          f"distill.regression_loss=false for no regression loss")
    require_count("distill.regression_pairs", distill.get("regression_pairs"),
                  hint="the teacher pairs sampled once at the start, e.g. distill.regression_pairs=64")
    batch = distill.get("regression_batch")
    if batch is not None:
        require_count("distill.regression_batch", batch,
                      hint="the pairs each student update regresses onto, e.g. distill.regression_batch=256; or null for "
                           "all of them")
        if batch > distill.regression_pairs:
            raise ConfigError(f"distill.regression_batch={batch} is more than the {distill.regression_pairs} pairs "
                              f"(distill.regression_pairs); set distill.regression_batch at most "
                              f"{distill.regression_pairs}, or null for all of them")
    if distill.get("regression_distance") not in ("mse", "pseudo_huber"):
        raise ConfigError(f"distill.regression_distance={distill.get('regression_distance')!r} must be mse or "
                          f"pseudo_huber (LPIPS is not available offline)")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_consistency_settings(distill, method: str) -> None:
    """sCM's (and rCM's) settings: TrigFlow's data scale, the training times' logit-normal, the tangent warm-up and
    normalisation constant, rCM's DMD weight; each with the paper's value in its message."""
    checks = (
        ("sigma_data", lambda v: _finite(v) and v > 0, "a finite number > 0 (TrigFlow's data scale; rCM: 1.0)"),
        ("p_mean", _finite, "a finite number (the logit-normal's mean; sCM / rCM: -0.8)"),
        ("p_std", lambda v: _finite(v) and v > 0, "a finite number > 0 (the logit-normal's spread; sCM / rCM: 1.6)"),
        ("warmup_steps", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
         "an integer >= 0 (student updates over which the tangent's weight r rises from 0 to 1; 0: r = 1 from the "
         "start; rCM: 1000)"),
        ("tangent_c", lambda v: _finite(v) and v > 0,
         "a finite number > 0 (the tangent normalisation g / (||g|| + c); sCM: 0.1)"),
    ) + ((("dmd_weight", lambda v: _finite(v) and v > 0, "a finite number > 0 (the DMD term's weight; rCM: 0.01); "
           "for no DMD term use distill=scm"),) if method == "rcm" else ())
    for key, valid, what in checks:
        value = distill.get(key)
        if not valid(value):
            raise ConfigError(f"distill.{key}={value!r} must be {what}, with distill={method}")
