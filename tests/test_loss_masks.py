"""Masked loss (diffusion-pipe's mask_path): prepare's masks on the latent grid, the data's loss_mask, the loss it
weights, and the refusals of masks and shards that cannot work."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from ringdit.data.text_latents import MASK_KEY, TextLatentsDataModule, write_text_latents  # noqa: E402
from ringdit.common.errors import ConfigError  # noqa: E402
from ringdit.media.encode_folder import encode_folder  # noqa: E402
from ringdit.media.masks import latent_mask  # noqa: E402
from ringdit.models.protocol import KindDefaults  # noqa: E402
from tests.helpers import TEXT_LEN  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"


def grey(array: np.ndarray) -> Image.Image:
    """An RGB image of the 0..255 grey levels ``array`` (H, W)."""
    return Image.fromarray(np.repeat(array.astype(np.uint8)[..., None], 3, axis=2))


def left_white(height: int, width: int, columns: int) -> np.ndarray:
    mask = np.zeros((height, width))
    mask[:, :columns] = 255
    return mask


def shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    from tests.helpers import read_prepared

    return read_prepared(path)[0]


def test_latent_mask_averages_each_latent_cell():
    """Each latent cell the mean luminance of its pixels (black 0, white 1); a video's first latent frame its first
    frame alone, each next one the mean of the following 4; an image mask on every frame; latent frames a VAE pads
    at the front copy the first. Exact: the means of 0 / 1 pixels are short binary fractions."""
    pixels = torch.full((3, 4, 8), -1.0)  # black
    pixels[:, :2, :4] = 1.0  # the top-left 2x4 block white
    pixels[:, 2:, 0] = 1.0  # one column of 4 in the bottom-left block: 2 of its 8 pixels
    expected = torch.tensor([[[1.0, 0.0], [0.25, 0.0]]])
    assert torch.equal(latent_mask(pixels, (2, 2), 1), expected)
    assert torch.equal(latent_mask(pixels, (3, 2, 2), 4), expected.expand(3, 2, 2)[None])  # an image mask, 3 frames
    video = torch.full((3, 9, 4, 8), -1.0)
    video[:, 0] = 1.0  # frame 0 white: latent frame 0
    video[:, 1:4] = 1.0  # 3 of frames 1..4 white: latent frame 1 is 0.75; frames 5..8 black: latent frame 2 is 0
    got = latent_mask(video, (3, 2, 2), 4)
    assert got.shape == (1, 3, 2, 2) and got[0, :, 0, 0].tolist() == [1.0, 0.75, 0.0]
    padded = latent_mask(video, (4, 2, 2), 4)  # CogVideoX's frame pad: one copy of the first in front
    assert torch.equal(padded[:, 1:], got) and torch.equal(padded[:, 0], got[:, 0])


@pytest.fixture
def masked_images(tmp_path) -> tuple[Path, Path]:
    """Three captioned 48x16 PNGs, and masks for two of them: a.png's white on its first 24 columns, c.png's grey."""
    images, masks = tmp_path / "images", tmp_path / "masks"
    images.mkdir()
    masks.mkdir()
    rng = np.random.default_rng(0)
    for name in "abc":
        Image.fromarray(rng.integers(0, 256, (16, 48, 3), dtype=np.uint8)).save(images / f"{name}.png")
        (images / f"{name}.txt").write_text(f"picture {name}")
    grey(left_white(16, 48, 24)).save(masks / "a.png")
    grey(np.full((16, 48), 51)).save(masks / "c.png")  # 51 / 255 = 0.2 everywhere
    return images, masks


def test_prepare_puts_each_mask_on_its_clips_latent_grid(models, masked_images, tmp_path):
    """mask_path=: a.png (48x16) is centre-cropped to the 32x16 bucket -- columns 8..40 -- and so is its mask, whose
    white first 24 columns become the crop's first 16: the left 8 of the 16 latent columns (2 px each) are 1, the
    rest 0; b.png has no mask (all ones); c.png's grey 51 is 0.2. The data module hands loss_mask on with
    each sample; a resume without mask_path is refused, and its advice (resume as prepared) resumes."""
    images, masks = masked_images
    out = tmp_path / "out"
    settings = dict(size=[16, 32], max_text_len=TEXT_LEN, shard_size=3, progress=False)
    report = encode_folder(str(images), str(out), str(models["flux"]), str(models["flux"]), mask_path=str(masks),
                           **settings)
    assert report.samples == 3
    tensors = shard_tensors(out / "shard-00000.safetensors")
    assert tensors["latents"].shape == (3, 4, 8, 16) and tensors[MASK_KEY].shape == (3, 1, 8, 16)
    left = torch.zeros(1, 8, 16)
    left[..., :8] = 1.0
    assert torch.equal(tensors[MASK_KEY][0], left)
    assert torch.equal(tensors[MASK_KEY][1], torch.ones(1, 8, 16))
    # (the reader's pixels are float32, 51 / 127.5 - 1 rounded: 2 ulp of 0.2)
    torch.testing.assert_close(tensors[MASK_KEY][2], torch.full((1, 8, 16), 0.2), rtol=0, atol=3e-8)
    data = TextLatentsDataModule(str(out), batch_size=1, val_fraction=0.0)
    rows = data.build_dataset()
    assert torch.equal(rows[0][1][MASK_KEY], left) and torch.equal(rows[1][1][MASK_KEY], torch.ones(1, 8, 16))
    with pytest.raises(ConfigError, match=r"holds shards prepared with loss masks \(shard-00000.safetensors\), but "
                                          r"mask_path is null; resume them as they were prepared"):
        encode_folder(str(images), str(out), str(models["flux"]), str(models["flux"]), **settings)
    again = encode_folder(str(images), str(out), str(models["flux"]), str(models["flux"]), mask_path=str(masks),
                          **settings)
    assert again.shards_skipped == 1 and again.shards_written == 0


def test_prepare_reads_a_video_mask_frame_by_frame(models, tmp_path):
    """A clip's mask video (a GIF: its grey levels exact) is read at the clip's frames: latent frame 0 is frame 0
    alone, latent frame 1 the mean of frames 1..4 (Wan's VAE, temporal 4); frame 5 is past the clip's 5 frames."""
    from tests.helpers import write_video

    clips, masks = tmp_path / "clips", tmp_path / "masks"
    clips.mkdir()
    masks.mkdir()
    write_video(clips / "a.mp4", 6, seed=1, size=(24, 16))
    (clips / "a.txt").write_text("a clip")
    # 1, then 0.6, 0, 0.2, 0.4 (mean 0.3), then 0.8; consecutive frames differ (a GIF merges equal ones)
    frames = [grey(np.full((16, 24), level)) for level in (255, 153, 0, 51, 102, 204)]
    frames[0].save(masks / "a.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    out = tmp_path / "out"
    encode_folder(str(clips), str(out), str(models["wan"]), str(models["wan"]), size=[16, 24], frames=5,
                  max_text_len=TEXT_LEN, progress=False, mask_path=str(masks))
    tensors = shard_tensors(out / "shard-00000.safetensors")
    assert tensors["latents"].shape == (1, 16, 2, 2, 3)
    expected = torch.stack([torch.ones(2, 3), torch.full((2, 3), 0.3)])[None, None]
    # (the reader's pixels are float32, each grey level rounded: a few ulp)
    torch.testing.assert_close(tensors[MASK_KEY], expected, rtol=0, atol=1e-7)


def test_bad_masks_are_refused_in_one_line(models, masked_images, tmp_path):
    """A mask of another size than its clip, a mask folder that is not there, two masks of one name, a video mask
    for an image: one line each, before any model loads (the fix for the size: the clip's size, which then works)."""
    images, masks = masked_images
    settings = dict(size=[16, 32], max_text_len=TEXT_LEN, progress=False)

    def prepare(mask_path, out="out"):
        return encode_folder(str(images), str(tmp_path / out), str(models["flux"]), str(models["flux"]),
                             mask_path=str(mask_path), **settings)

    grey(left_white(8, 24, 12)).save(masks / "a.png")  # half the size
    with pytest.raises(ConfigError, match=r"^mask_path: a.png is 24x8 but its a.png is 48x16 \(width x height\); give "
                                          r"each mask its clip's size"):
        prepare(masks)
    grey(left_white(16, 48, 24)).save(masks / "a.png")  # the advice: the clip's size
    assert prepare(masks).samples == 3
    with pytest.raises(ConfigError, match=r"^mask_path=.*missing is not a folder"):
        prepare(tmp_path / "missing", "out2")
    grey(left_white(16, 48, 24)).save(masks / "a.jpg")
    with pytest.raises(ConfigError, match=r"^mask_path=.* holds two masks for 'a' \(a.jpg, a.png\); keep one"):
        prepare(masks, "out3")
    (masks / "a.jpg").unlink()
    (masks / "c.png").rename(masks / "c.gif")
    with pytest.raises(ConfigError, match=r"^mask_path: c.gif is a video but its c.png is an image"):
        prepare(masks, "out4")


def test_shards_with_bad_loss_masks_are_refused(tmp_path):
    """data=text_latents: a loss_mask of another grid than its latents, weights outside [0, 1] (a 0-255 mask), and
    shards with and without masks in one set: one line each naming the shard and the fix."""
    latents, text = torch.randn(2, 4, 8, 8), torch.randn(2, 3, 16)
    folder = tmp_path / "bad_shape"
    write_text_latents(folder / "shard-0.safetensors", latents, text, loss_mask=torch.ones(2, 1, 4, 4))
    with pytest.raises(ConfigError, match=r"loss_mask is F32 \(2, 1, 4, 4\); expected float \(2, 1, 8, 8\)"):
        TextLatentsDataModule(str(folder))
    folder = tmp_path / "bytes"
    write_text_latents(folder / "shard-0.safetensors", latents, text, loss_mask=torch.full((2, 1, 8, 8), 255.0))
    with pytest.raises(ConfigError, match=r"loss_mask holds weights from 255.0 to 255.0; a loss mask's are in \[0, 1\]"
                                          r".*divide 0-255 masks by 255"):
        TextLatentsDataModule(str(folder))
    folder = tmp_path / "mixed"
    write_text_latents(folder / "shard-0.safetensors", latents, text, loss_mask=torch.ones(2, 1, 8, 8))
    write_text_latents(folder / "shard-1.safetensors", latents, text)
    with pytest.raises(ConfigError, match=r"shard-1.safetensors has a loss mask False but shard-0.safetensors has True"
                                          r".*prepare every folder with mask_path="):
        TextLatentsDataModule(str(folder))


class PerCell(KindDefaults, torch.nn.Module):  # the model contract's defaults, as every kind
    """A model whose prediction at each latent cell depends on that cell alone (x_t times a weight): the loss's
    dependence on a cell is then only through its own error."""

    condition_dropout_prob = 0.0
    patch_shape = (1, 1)

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, x, t, condition):
        return x * self.weight


def test_the_masked_loss_is_the_masked_mean_and_ignores_masked_cells():
    """diffusion_loss with the batch's loss_mask: the mean over all cells of mask x squared error (diffusion-pipe's);
    changing the data where the mask is 0 changes neither the loss nor its gradient (exactly: a per-cell model);
    the training step reads the mask from the condition."""
    from ringdit.diffusion import draw_noise
    from ringdit.training.module import DiffusionModule, loss_mask

    module = DiffusionModule(model={}, objective={"_target_": "ringdit.diffusion.FlowMatching"}, data={})
    model = PerCell()
    x0 = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.float64)
    mask[0, :, :3] = 1.0
    mask[1] = 0.5

    def loss_of(data):
        model.zero_grad()
        generators = [torch.Generator().manual_seed(seed) for seed in (3, 4)]
        loss = module.diffusion_loss(model, data, {"text": torch.zeros(2, 1)}, generators, mask=mask)
        loss.backward()
        return loss.detach(), model.weight.grad.clone()

    loss, gradient = loss_of(x0)
    generators = [torch.Generator().manual_seed(seed) for seed in (3, 4)]
    t = torch.cat([module.objective.sample_time(1, g, 36) for g in generators]).double()
    noise = draw_noise(x0.shape[1:], generators, x0.device, x0.dtype)
    x_t = module.objective.add_noise(x0, noise, t)
    expected = ((x_t * 0.7 - (noise - x0)).square() * mask).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # (diffusion_loss squares in float32)
    changed = x0.clone()
    changed[0, :, 3:] += 5.0  # where sample 0's mask is 0
    assert torch.equal(loss_of(changed)[0], loss) and torch.equal(loss_of(changed)[1], gradient)
    assert loss_mask({"text": torch.zeros(1), MASK_KEY: mask}) is mask and loss_mask(torch.tensor([1])) is None
