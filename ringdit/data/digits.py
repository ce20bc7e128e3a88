"""The built-in dataset: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), shipped inside the
package, so training works offline with nothing to download."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ringdit.data.base import ImageDataModule


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 1, 8, 8) scaled to [-1, 1] and labels (N,) int64."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)  # pixel values 0..16
    return images, torch.from_numpy(digits.target.astype(np.int64))


class DigitsDataModule(ImageDataModule):
    channels, image_size, num_classes = 1, (8, 8), 10
    class_names = [str(i) for i in range(10)]

    def build_dataset(self) -> TensorDataset:
        return TensorDataset(*load_digits_tensors())
