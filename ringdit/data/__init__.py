"""Data modules (``data=`` in the configs). Each yields ``(x, label)`` with x in [-1, 1]."""

from ringdit.data.base import ImageDataModule
from ringdit.data.digits import DigitsDataModule, load_digits_tensors
from ringdit.data.steps import StepBatches

__all__ = ["DigitsDataModule", "ImageDataModule", "StepBatches", "load_digits_tensors"]
