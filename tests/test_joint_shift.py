"""``diffusion.sampling.joint_shift``: a shift of its own for the latents a model denoises with its video (MiniMax-H3's
audio, at 3.0 in its pipeline beside the video's 12), refused before any rank starts where it cannot work -- a key
the model does not denoise, a value that is no shift, a sampler that steps every stream at one time --, each
refusal's advice followed."""

from __future__ import annotations

import pytest

from ringdit.common.errors import ConfigError
from ringdit.spec.diffusion import check_sampling

FLOW = {"_target_": "ringdit.diffusion.FlowMatching"}
MINIMAX = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "minimax_h3"}
WAN = {"_target_": "ringdit.models.diffusers.DiffusersTransformer", "family": "wan"}
PREFIX = "diffusion.sampling."


def check(model: dict, **sampling) -> None:
    check_sampling(model, FLOW, sampling, prefix=PREFIX)


def test_the_audio_shift_of_minimax_h3_with_its_scheduler_is_taken():
    check(MINIMAX, sampler="minimax_h3", shift=12.0, joint_shift={"audio": 3.0})
    check(MINIMAX, sampler="flow_euler", shift=12.0, joint_shift={"audio": 3})
    check(MINIMAX, sampler="heun", joint_shift=None)


def test_a_joint_shift_with_ringdits_own_sampler_is_refused_and_its_advice_works():
    with pytest.raises(ConfigError, match=r"^diffusion.sampling.joint_shift steps audio on a schedule of its own, "
                                          r".* but diffusion.sampling.sampler=heun; use diffusion.sampling.sampler="
                                          r"minimax_h3 .* or leave diffusion.sampling.joint_shift null$"):
        check(MINIMAX, sampler="heun", joint_shift={"audio": 3.0})
    check(MINIMAX, sampler="minimax_h3", joint_shift={"audio": 3.0})


def test_a_joint_shift_of_latents_the_model_does_not_denoise_is_refused():
    with pytest.raises(ConfigError, match=r"joint_shift names 'sound', but this model denoises its video and audio; "
                                          r"give e.g. diffusion.sampling.joint_shift=\{audio: 3.0\}$"):
        check(MINIMAX, sampler="minimax_h3", joint_shift={"sound": 3.0})
    with pytest.raises(ConfigError, match=r"joint_shift names 'audio', but this model denoises its video alone; "
                                          r"leave diffusion.sampling.joint_shift null$"):
        check(WAN, sampler="unipc", joint_shift={"audio": 3.0})
    check(WAN, sampler="unipc", joint_shift=None)


@pytest.mark.parametrize("value, message", [
    ({"audio": 0}, r"joint_shift.audio=0 is not a shift: give a number > 0"),
    ({"audio": "resolution"}, r"joint_shift.audio='resolution' is not a shift"),
    (3.0, r"joint_shift=3.0 is not a shift per joint latent: give e.g. diffusion.sampling.joint_shift=\{audio: 3.0\}"),
])
def test_a_joint_shift_that_is_no_shift_is_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        check(MINIMAX, sampler="minimax_h3", joint_shift=value)
