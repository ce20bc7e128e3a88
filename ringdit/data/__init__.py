"""Data modules (``data=`` in the configs). Each yields ``(x, condition)``: pixels in [-1, 1] or latents, and a class label or a dict of text tensors."""

from ringdit.data.base import ImageDataModule
from ringdit.data.captioned_moving_digits import CaptionedMovingDigitsDataModule
from ringdit.data.digits import DigitsDataModule, load_digits_tensors
from ringdit.data.image_folder import ImageFolderDataModule
from ringdit.data.latents import LatentsDataModule
from ringdit.data.moving_digits import MovingDigits, MovingDigitsDataModule
from ringdit.data.steps import StepBatches
from ringdit.data.synthetic_text_latents import SyntheticTextLatentsDataModule
from ringdit.data.text_latents import TextLatentsDataModule, write_text_latents

__all__ = [
    "CaptionedMovingDigitsDataModule", "DigitsDataModule", "ImageDataModule", "ImageFolderDataModule", "LatentsDataModule", "MovingDigits",
    "MovingDigitsDataModule", "StepBatches", "SyntheticTextLatentsDataModule", "TextLatentsDataModule",
    "load_digits_tensors", "write_text_latents",
]
