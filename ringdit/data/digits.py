"""The built-in dataset: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), shipped inside the
package, so training works offline with nothing to download."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ringdit.data.base import ImageDataModule
from ringdit.common.errors import ConfigError


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 1, 8, 8) scaled to [-1, 1] and labels (N,) int64."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)  # pixel values 0..16
    return images, torch.from_numpy(digits.target.astype(np.int64))


class DigitsDataModule(ImageDataModule):
    """``classes``: train on the images of these digits only (null: all ten), e.g. new data to fine-tune on; the
    model keeps its 10 classes."""

    channels, image_size, num_classes = 1, (8, 8), 10
    class_names = [str(i) for i in range(10)]

    def __init__(self, *args, classes: list[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if classes is not None:
            classes = list(classes)
            if not classes or len(set(classes)) != len(classes) or not all(
                    isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 9 for c in classes):
                raise ConfigError(f"data.classes={classes!r} must be distinct digits from 0 to 9 (the images to "
                                  f"train on), e.g. data.classes=[0,1,2,3,4], or null for all ten")
        self.classes = classes

    def build_dataset(self) -> TensorDataset:
        images, labels = load_digits_tensors()  # (N, 1, 8, 8), (N,)
        if self.classes is not None:
            kept = torch.isin(labels, torch.tensor(self.classes))
            images, labels = images[kept], labels[kept]
        return TensorDataset(images, labels)
