"""``DistillationModule``: DMD2 (Yin et al., "Improved Distribution Matching Distillation for Fast Image Synthesis",
2024) -- a few-step student distilled from a flow-matching teacher, on every layout ``DiffusionModule`` trains on --
and the continuous-time consistency methods: ``scm`` (Lu and Song, 2024: ``ringdit.training.consistency``'s loss on
the batch's images, no critic) and ``rcm`` (Zheng et al., 2025: sCM's loss plus DMD2's matching term below, weighted
by ``dmd_weight``, with its critic; both start once the tangent warm-up is over).

Three models (sCM: no critic), all built by ``ringdit.models.build.build_model`` over the same mesh (ring, Ulysses, DDP
or FSDP, LoRA):

- the **student** (generator, ``self.model``, with its EMA): starts from ``init_from`` (the teacher, or a distilled
  student fine-tuned on new data under a teacher fine-tuned on it); the one infer.py samples;
- the **critic** (fake score, ``self.critic``): starts from the teacher; learns the student's distribution with the
  ordinary denoising loss on the student's (detached) samples;
- the **teacher** (real score): frozen, no gradient, no optimizer state, not in the checkpoints (it is
  ``distill.teacher``, default ``init_from``, read again on resume), guided with its classifier-free guidance scale.

One training step is ``critic_steps`` critic updates (the two time-scale rule), then one student update; Lightning's
step count (``trainer.max_steps``, checkpoints, previews) counts the student's updates. The student's loss is the
distribution-matching gradient at a random noise level t of its samples x: ``grad = (p_fake - p_real) /
mean|x - p_real|`` per sample (p: the clean sample each score predicts), ``loss = 0.5 mse(x, (x - grad).detach())``.

The student steps through ``times`` (1 first): at each it predicts the clean sample ``x - t v``, which is noised again
with fresh noise to the next time (``ringdit.diffusion.sample_fewstep``, what infer.py runs). Backward simulation:
each update draws which step trains (each alike, or the first with probability ``first_step_share``: the 1-step
samples are its outputs), and that step's input comes from the student's own earlier steps (no gradient).

Every draw comes from the ``DISTILL`` stream keyed by (student step, phase, role[, position in the global batch]),
so every rank of a sequence-parallel group draws the same values and the gradient equals one device's (see
``DiffusionModule.diffusion_loss``).

``gan_loss``: DMD2's GAN head (``ringdit.training.gan_head``) on the critic's features. Each critic update adds
``gan_critic_weight`` x the head's non-saturating loss on the batch's real images and the student's samples, both
noised to one drawn t (two more critic forwards); the student's update adds ``gan_generator_weight`` x its side of
it, read from the critic forward the matching loss runs anyway (then with a gradient to the student's samples).

``regression_loss``: the original DMD's regression onto teacher pairs, with a plain distance (``regression_distance``:
mse or pseudo-Huber) for LPIPS: ``regression_pairs`` noises and conditions (labels cycling through the classes, or
the training data's first prompts), sampled by the teacher once when training starts (again, the same, on resume),
and each student update adds ``regression_weight`` x the distance of the student's 1-step
outputs from the same noises to the teacher's samples: of all of them, or of ``regression_batch`` drawn afresh each
update (as DMD's regression takes a minibatch of its pairs; the same draw on every rank).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ringdit.diffusion import classifier_free_guidance, draw_noise, noise_generators
from ringdit.diffusion.distillation import CONSISTENCY_METHODS, CRITIC_METHODS
from ringdit.diffusion.samplers import fewstep_start, fewstep_step
from ringdit.diffusion.pipeline import condition_to
from ringdit.sampling.sampler import Sampler
from ringdit.common.seeding import Stream, generator, seed_of
from ringdit.training import consistency
from ringdit.training.gan_head import FeatureTap, GANHead, critic_gan_loss, generator_gan_loss
from ringdit.training.module import DiffusionModule, total_grad_norm

Tensor = torch.Tensor

# Checkpoints hold the weights after the step's updates, as DiffusionModule's do: what Lightning warns about is wanted
warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps")

# the DISTILL stream's roles: which draw of a phase a generator is for
(STUDENT_NOISE, CRITIC_LOSS, MATCHING, TRAINED_STEP, GAN, GAN_HEAD_INIT, REGRESSION, CONSISTENCY,
 REGRESSION_BATCH) = range(9)


class DistillationModule(DiffusionModule):
    """``DiffusionModule``'s arguments, and ``distill``: ``ringdit.spec.DistillSpec.settings`` (``method``,
    ``steps``, ``times``, ``critic_steps``, ``cfg_scale``, ``t_min``, ``t_max``, ``teacher``, ``teacher_weights``,
    ``gradient_clip_val``, ``critic_lr``, ``gan_loss``, ``gan_block``, ``gan_generator_weight``, ``gan_critic_weight``,
    ``regression_loss``, ``regression_weight``, ``regression_pairs``, ``regression_distance``, ``teacher_sampling``)."""

    @classmethod
    def from_spec(cls, spec, **keywords) -> DistillationModule:
        return super().from_spec(spec, distill=spec.distill.settings, **keywords)

    def __init__(self, *args, distill: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False  # two optimizers, several critic updates per student update
        self.distill = dict(distill)
        self.critic: nn.Module | None = None
        self.gan_head: GANHead | None = None  # gan_loss: trained with the critic, in its optimizer and the checkpoints
        self.critic_features: FeatureTap | None = None
        self.teacher_pairs: tuple | None = None  # regression_loss: (noise, condition, the teacher's samples)
        self._teacher: list[nn.Module] = []  # in a list: not a submodule (no state dict, DDP, optimizer or .to())
        self.teacher_sampler: Sampler | None = None  # the teacher's own, made when training starts (on its device)

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    # ---- models -----------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()  # the student and its EMA
        # the student's build plan and rank keywords, from the teacher's weights, with nothing of its training
        plan, common = self.build_plan, self.rank_build()
        teacher_weights = self.distill["teacher"], self.distill["teacher_weights"]
        if self.distill["method"] in CRITIC_METHODS:  # sCM trains none
            # the critic starts from the teacher too (a resumed run then loads its own weights from the checkpoint):
            # a score model, also when the student is a distilled one fine-tuned (init_from, distill.teacher)
            self.critic, _ = plan.frozen_from(*teacher_weights, lora=True).build(**common)
        teacher, _ = plan.frozen_from(*teacher_weights).build(**common)
        teacher.requires_grad_(False)
        self._teacher = [teacher.eval()]
        if self.distill.get("gan_loss"):
            self.critic_features = FeatureTap(self.critic, self.distill.get("gan_block"))
            head = GANHead(self.critic_features.width)
            head.reset_parameters(generator(Stream.DISTILL, self.hparams.seed, 0, 0, GAN_HEAD_INIT))
            self.gan_head = head.to(torch.empty(0).device)  # Lightning's device for the models (the rank's GPU)
            if common["shard"] is not None:  # FSDP: sharded like the critic, so its gradients are reduced too
                common["shard"](self.gan_head)

    def on_fit_start(self) -> None:
        # what Lightning's precision did to this module (trainer.precision=64-true: float64), it does not do to the
        # teacher, which is no submodule
        self.trainer.precision_plugin.convert_module(self.teacher)
        # the run's sampling settings with teacher_sampling laid over them, its weights as they are (no step cache,
        # the empty prompt as the negative)
        settings = {**(self.hparams.get("sampling") or {}), **(self.distill.get("teacher_sampling") or {})}
        self.teacher_sampler = Sampler.for_run(self.teacher, self.objective, settings, self.hparams.data,
                                               dims=self.parallel_dims, device=self.device)
        if self.distill.get("regression_loss"):
            self.teacher_pairs = self.make_teacher_pairs()

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("DistillationModule needs an optimizer (a partial, e.g. torch.optim.AdamW) to train")
        trained = [[self.model]]
        if self.critic is not None:
            trained.append([self.critic] + ([self.gan_head] if self.gan_head is not None else []))
        # the critic's learning rate: critic_lr when set (rCM: a fifth of the student's), else the optimizer's
        rates = [{}, {} if self.distill.get("critic_lr") is None else {"lr": self.distill["critic_lr"]}]
        optimizers = [self.optimizer_factory(params=[p for model in models for p in model.parameters()
                                                     if p.requires_grad], **rate)
                      for models, rate in zip(trained, rates)]
        if self.scheduler_factory is None:
            return optimizers
        return optimizers, [{"scheduler": self.scheduler_factory(optimizer=o), "interval": "step"} for o in optimizers]

    # ---- draws ------------------------------------------------------------------------------------------------------
    def draws(self, step: int, phase: int, role: int, batch_size: int) -> list[torch.Generator]:
        """One generator per local sample for (``step``, ``phase``, ``role``), keyed by its global batch position."""
        first = self.parallel_dims.dp_rank * batch_size
        return [generator(Stream.DISTILL, self.hparams.seed, step, phase, role, first + i) for i in range(batch_size)]

    # ---- the student --------------------------------------------------------------------------------------------------
    def student_outputs(self, shape: tuple[int, ...], condition, step: int, phase: int, grad: bool,
                        dtype: torch.dtype = torch.float32) -> Tensor:
        """The student's clean samples ``shape`` after a step drawn for (``step``, ``phase``), whose input comes
        from its own earlier steps (backward simulation); only that last step carries a gradient, with ``grad``."""
        times = self.distill["times"]
        trained = trained_step(len(times), self.distill.get("first_step_share"),
                               generator(Stream.DISTILL, self.hparams.seed, step, phase, TRAINED_STEP))
        generators = self.draws(step, phase, STUDENT_NOISE, shape[0])
        x = fewstep_start(draw_noise(shape[1:], generators, self.device, dtype), times[0])
        for i in range(trained + 1):
            t = torch.full((shape[0],), times[i], device=self.device)
            with torch.set_grad_enabled(grad and i == trained):
                velocity = self.model(x, self.objective.model_time(t), condition)[:, :shape[1]]
                x0 = fewstep_step(x, t, velocity.to(x.dtype))
            if i < trained:
                x = (1 - times[i + 1]) * x0 + times[i + 1] * draw_noise(shape[1:], generators, self.device, dtype)
        return x0

    def matching_loss(self, fake: Tensor, condition, step: int, phase: int) -> tuple[Tensor, Tensor | None]:
        """DMD2's distribution-matching loss of the student's samples ``fake`` (B, C, [T,] H, W), and with
        ``gan_loss`` the student's GAN loss, read from the same critic forward (None without)."""
        batch, channels = fake.shape[:2]
        generators = self.draws(step, phase, MATCHING, batch)
        t = self.noise_levels(generators).to(fake.device)
        noise = draw_noise(fake.shape[1:], generators, fake.device, fake.dtype)
        model_time = self.objective.model_time(t)
        gan_loss = None
        if self.gan_head is None:
            with torch.no_grad():
                fake_velocity = self.critic(self.objective.add_noise(fake.detach(), noise, t), model_time, condition)
        else:  # the critic's forward carries the GAN loss's gradient to the samples (not to the critic: frozen here)
            with frozen(self.critic, self.gan_head), self.critic_features.capture() as features:
                fake_velocity = self.critic(self.objective.add_noise(fake, noise, t), model_time, condition)
                gan_loss = generator_gan_loss(self.gan_head(*features.features()))
        with torch.no_grad():
            x_t = self.objective.add_noise(fake.detach(), noise, t)
            fake_velocity = fake_velocity[:, :channels].detach()
            real_velocity = self.guided_teacher(condition, batch)(x_t, model_time)[:, :channels]
            # in float32 at least (bf16 models), float64 in a float64 run
            dtype = torch.promote_types(fake.dtype, torch.float32)
            x_t, fake_velocity, real_velocity = x_t.to(dtype), fake_velocity.to(dtype), real_velocity.to(dtype)
            p_fake, p_real = fewstep_step(x_t, t, fake_velocity), fewstep_step(x_t, t, real_velocity)
            scale = (fake.detach().to(dtype) - p_real).abs().mean(dim=tuple(range(1, fake.dim())), keepdim=True)
            grad = torch.nan_to_num((p_fake - p_real) / scale)
        return 0.5 * F.mse_loss(fake.to(dtype), (fake.to(dtype) - grad).detach()), gan_loss

    def noise_levels(self, generators: list[torch.Generator]) -> Tensor:
        """One noise level per sample, uniform in [t_min, t_max] (the matching loss's and the GAN head's)."""
        low, high = self.distill["t_min"], self.distill["t_max"]
        return torch.cat([low + (high - low) * torch.rand(1, generator=g, dtype=torch.float32) for g in generators])

    def head_logits(self, samples: Tensor, noise: Tensor, t: Tensor, condition) -> Tensor:
        """The GAN head's realism logits (B,) of ``samples`` noised to ``t`` with ``noise``, read from the critic."""
        with self.critic_features.capture() as features:
            self.critic(self.objective.add_noise(samples, noise, t), self.objective.model_time(t), condition)
            return self.gan_head(*features.features())

    def critic_gan_loss(self, real: Tensor, fake: Tensor, condition, step: int, phase: int) -> Tensor:
        """The head's (and the critic's) GAN loss: the batch's real images against the student's samples, both noised
        to one drawn t per sample, with the same noise."""
        generators = self.draws(step, phase, GAN, real.shape[0])
        t = self.noise_levels(generators).to(real.device)
        noise = draw_noise(real.shape[1:], generators, real.device, real.dtype)
        return critic_gan_loss(self.head_logits(real, noise, t, condition), self.head_logits(fake, noise, t, condition))

    @torch.no_grad()
    def make_teacher_pairs(self) -> tuple:
        """(noise, condition, the teacher's samples from that noise) for the regression loss: ``regression_pairs`` of
        them, for labels cycling through the classes or for the training data's prompts (``pair_prompts``), sampled
        as the run's sampling settings say (its sampler, steps, guidance at ``cfg_scale``); deterministic, so a
        resumed run samples the same pairs."""
        count = self.distill["regression_pairs"]
        if self.text_conditioned:
            # the precision's dtype, as Lightning converts the batches (64-true: float64 embeddings)
            condition = self.trainer.precision_plugin.convert_input(condition_to(self.pair_prompts(count),
                                                                                 self.device))  # dict of (K, ...)
        else:
            condition = torch.arange(count, device=self.device) % self.hparams.data["num_classes"]  # (K,)
        seeds = [seed_of(Stream.DISTILL, self.hparams.seed, 0, 0, REGRESSION, i) for i in range(count)]
        samples = self.teacher_sampler.generate(condition, seeds)
        noise = draw_noise((self.teacher.in_channels, *self.hparams.data["image_size"]), noise_generators(seeds),
                           self.device, samples.dtype)  # what the teacher's sampling started from
        return noise, condition, samples

    def pair_prompts(self, count: int) -> dict[str, Tensor]:
        """The conditions (text embeddings, ...) of the first ``count`` training samples of the sampled shape (the
        data's image_size: a bucket's image keys have its shape), cycling when there are fewer: in the training set's
        own order, so every rank picks the same, whatever its batches."""
        rows = self.trainer.datamodule.train_set
        shape = tuple(self.hparams.data["image_size"])
        picked = []
        for index in range(len(rows)):
            x0, condition = rows[index]  # (C, [T,] H, W), dict
            if tuple(x0.shape[1:]) == shape:
                picked.append(condition)
                if len(picked) == count:
                    break
        if not picked:
            raise ValueError(f"the regression loss's teacher pairs are sampled at the data's image_size {list(shape)}, "
                             f"and no training sample has that shape")
        picked = [picked[i % len(picked)] for i in range(count)]
        return {key: torch.stack([condition[key] for condition in picked]) for key in picked[0]}

    def regression_loss(self, step: int) -> Tensor:
        """The distance of the student's 1-step outputs from the pairs' noises to the teacher's samples (mse, or
        pseudo-Huber on each sample's L2 distance, c = 0.00054 sqrt(numel) as improved consistency training's); on
        ``regression_batch`` of the pairs drawn for student update ``step``, or on all."""
        noise, condition, samples = self.teacher_pairs
        batch = self.distill.get("regression_batch")  # absent from checkpoints written before the setting: all
        if batch is not None and batch < noise.shape[0]:
            picked = torch.randperm(noise.shape[0], generator=generator(Stream.DISTILL, self.hparams.seed, step, 0,
                                                                        REGRESSION_BATCH))[:batch].to(noise.device)
            noise, samples = noise[picked], samples[picked]
            condition = ({key: value[picked] for key, value in condition.items()} if isinstance(condition, dict)
                         else condition[picked])  # labels (K,) or a dict of (K, ...): the pairs' own conditions
        t = torch.full((noise.shape[0],), self.distill["times"][0], device=self.device)
        x = fewstep_start(noise, self.distill["times"][0])  # as the student's first step samples
        velocity = self.model(x, self.objective.model_time(t), condition)[:, :noise.shape[1]]
        output = fewstep_step(x, t, velocity.to(noise.dtype))  # (K, C, [T,] H, W)
        # a given first frame in place: the teacher's samples hold it too (a model without one: unchanged)
        output = self.model.with_condition_frames(output, condition)
        dtype = torch.promote_types(samples.dtype, torch.float32)
        error = (output.to(dtype) - samples.to(dtype)).flatten(1)
        if self.distill["regression_distance"] == "mse":
            return error.square().mean()
        c = 0.00054 * math.sqrt(error.shape[1])
        return (torch.sqrt(error.square().sum(dim=1) + c * c) - c).mean()

    def guided_teacher(self, condition, batch: int):
        """``(x, model_time) -> velocity`` of the teacher guided with ``distill.cfg_scale``."""
        scale = self.distill["cfg_scale"]
        null = None if scale == 1.0 else condition_to(self.teacher.model_condition(self.teacher.null_condition(batch)),
                                                    self.device)
        return classifier_free_guidance(self.teacher, condition, null, scale)

    # ---- training -----------------------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int) -> None:
        x0, condition = batch  # the conditions and the shape; the images for the GAN head and the consistency loss
        optimizers = self.optimizers()
        student_optimizer, critic_optimizer = optimizers if isinstance(optimizers, list) else (optimizers, None)
        schedulers = self.lr_schedulers()
        step, shape = self.trainer.global_step, tuple(x0.shape)
        method = self.distill["method"]
        # rCM's DMD term and its critic start once the tangent warm-up is over (rCM's schedule); DMD2's always run
        matching = method == "dmd2" or (method == "rcm" and consistency.tangent_weight(
            step, self.distill["warmup_steps"]) == 1.0)
        critic_steps = self.distill["critic_steps"] if matching else 0
        critic_value = None
        for phase in range(critic_steps):
            with torch.no_grad():
                fake = self.student_outputs(shape, condition, step, phase, grad=False, dtype=x0.dtype)
            critic_loss = self.diffusion_loss(self.critic, fake, condition,
                                              self.draws(step, phase, CRITIC_LOSS, shape[0]))
            if self.gan_head is not None:
                gan_loss = self.critic_gan_loss(x0, fake, condition, step, phase)
                self.log("train/critic_gan_loss", self.trainer.strategy.reduce(gan_loss.detach(), reduce_op="mean"))
                critic_loss = critic_loss + self.distill["gan_critic_weight"] * gan_loss
            critic_value = self._checked("critic_loss", critic_loss)
            if critic_value is None:
                continue
            # the raw optimizer: Lightning counts only the student's steps (trainer.max_steps, checkpoints, previews)
            self._update(critic_optimizer.optimizer, critic_loss, self.critic, "train/critic_grad_norm")
        if critic_value is not None:
            self.log("train/critic_loss", critic_value, prog_bar=True)
        loss = 0.0
        if method in CONSISTENCY_METHODS:
            scm = self.consistency_loss(x0, condition, step, critic_steps)
            self.log("train/scm_loss", self.trainer.strategy.reduce(scm.detach(), reduce_op="mean"))
            loss = scm
        if matching:
            fake = self.student_outputs(shape, condition, step, critic_steps, grad=True, dtype=x0.dtype)
            dmd, gan_loss = self.matching_loss(fake, condition, step, critic_steps)
            if gan_loss is not None:
                self.log("train/gan_loss", self.trainer.strategy.reduce(gan_loss.detach(), reduce_op="mean"))
                dmd = dmd + self.distill["gan_generator_weight"] * gan_loss
            if method == "rcm":
                # rCM sums its DMD term over each sample's elements (it is 0.5 mse here: x 2 numel) beside the sCM
                # loss, weighted by dmd_weight (rCM: loss scales 100 and 1, i.e. 0.01)
                dmd = 2 * consistency.per_sample_size(fake) * dmd
                self.log("train/dmd_loss", self.trainer.strategy.reduce(dmd.detach(), reduce_op="mean"))
                dmd = self.distill["dmd_weight"] * dmd
            loss = loss + dmd
        if self.teacher_pairs is not None:
            regression = self.regression_loss(step)
            self.log("train/regression_loss", self.trainer.strategy.reduce(regression.detach(), reduce_op="mean"))
            loss = loss + self.distill["regression_weight"] * regression
        value = self._checked("loss", loss)
        self.log("train/loss", value, prog_bar=True)  # the student's (generator's) loss
        if value is not None:
            self._update(student_optimizer, loss, self.model, "train/grad_norm")
            if self.ema is not None:
                self.ema.update_parameters(self.model)
        for scheduler in (schedulers if isinstance(schedulers, list) else [schedulers] if schedulers else []):
            scheduler.step()  # once per student step, all: their schedules follow trainer.max_steps
        return None

    def consistency_loss(self, x0: Tensor, condition, step: int, phase: int) -> Tensor:
        """sCM's consistency loss (``ringdit.training.consistency``) on the batch's images ``x0`` noised to one
        TrigFlow time per sample: the teacher's (guided) F gives the ODE's direction, forward mode the student's
        tangent along it, and the student trains towards its normalised consistency direction."""
        d = self.distill
        sigma_d, channels = d["sigma_data"], x0.shape[1]
        dtype = torch.promote_types(x0.dtype, torch.float32)  # float32 at least (bf16 models), float64 in fp64 runs
        generators = self.draws(step, phase, CONSISTENCY, x0.shape[0])
        s = consistency.training_times(generators, d["p_mean"], d["p_std"], sigma_d).to(self.device, dtype)
        noise = draw_noise(x0.shape[1:], generators, self.device, dtype)
        x_s = consistency.column(torch.cos(s), noise) * x0.to(dtype) \
            + consistency.column(torch.sin(s), noise) * sigma_d * noise

        def student(x: Tensor, t: Tensor) -> Tensor:
            return self.model(x.to(x0.dtype), self.objective.model_time(t.to(x0.dtype)), condition)[:, :channels]

        with torch.no_grad():
            teacher = self.guided_teacher(condition, x0.shape[0])
            F_teacher = consistency.trigflow_F(
                lambda x, t: teacher(x.to(x0.dtype), self.objective.model_time(t.to(x0.dtype)))[:, :channels],
                x_s, s, sigma_d).to(dtype)
        F_minus, dF = consistency.trigflow_F_and_tangent(student, x_s, s, sigma_d * F_teacher, sigma_d)
        r = consistency.tangent_weight(step, d["warmup_steps"])
        g = consistency.consistency_direction(F_minus.to(dtype), dF.to(dtype), F_teacher, x_s, s, r, sigma_d,
                                              d["tangent_c"])
        F_theta = consistency.trigflow_F(student, x_s, s, sigma_d).to(dtype)
        return consistency.consistency_loss(F_theta, F_minus.to(dtype), g)

    def _checked(self, name: str, loss: Tensor) -> Tensor | None:
        """The batch's mean ``loss`` over all ranks (the same on every rank); None when it is not finite and
        ``nonfinite_loss=skip`` (``stop`` raises)."""
        value = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        if torch.isfinite(value):
            return value
        self._on_nonfinite_loss(f"{value.item()} ({name})")
        return None

    def _update(self, optimizer, loss: Tensor, model: nn.Module, norm_name: str) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        norm = total_grad_norm(model)  # before clipping, as DiffusionModule logs it
        if norm is not None:
            self.log(norm_name, norm)
        clip = self.distill.get("gradient_clip_val")
        if clip:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        optimizer.step()

    def on_before_optimizer_step(self, optimizer) -> None:
        pass  # the norms are logged before clipping (_update)


def trained_step(steps: int, first_share: float | None, draw: torch.Generator) -> int:
    """Which of the student's ``steps`` a backward simulation trains: each alike (DMD2's draw), or the first with
    probability ``first_share`` and the others alike in the rest (a 2-step student that also samples in 1 step:
    its 1-step outputs are those of its first step)."""
    if first_share is None:
        return int(torch.randint(steps, (1,), generator=draw))
    u = float(torch.rand(1, generator=draw))
    if steps == 1 or u < first_share:
        return 0
    return min(steps - 1, 1 + int((u - first_share) / (1 - first_share) * (steps - 1)))


@contextlib.contextmanager
def frozen(*models: nn.Module):
    """The models' parameters without gradients inside the block (a forward whose gradient is only for its
    input), as they were after it."""
    params = [p for model in models for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
