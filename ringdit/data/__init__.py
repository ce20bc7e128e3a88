"""Data modules (``data=`` in the configs). Each yields ``(x, label)``: pixels in [-1, 1], or scaled latents."""

from ringdit.data.base import ImageDataModule
from ringdit.data.digits import DigitsDataModule, load_digits_tensors
from ringdit.data.image_folder import ImageFolderDataModule
from ringdit.data.latents import LatentsDataModule
from ringdit.data.moving_digits import MovingDigits, MovingDigitsDataModule
from ringdit.data.steps import StepBatches

__all__ = [
    "DigitsDataModule", "ImageDataModule", "ImageFolderDataModule", "LatentsDataModule", "MovingDigits",
    "MovingDigitsDataModule", "StepBatches", "load_digits_tensors",
]
