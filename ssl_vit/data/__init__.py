"""Datamodules and per-method view transforms.

Choose both in a recipe by ``class_path``::

    data:
      class_path: ssl_vit.data.FashionMNISTDataModule
      init_args:
        batch_size: 256
        views:
          class_path: ssl_vit.data.MultiCrop
          init_args: {n_local: 8}
"""

from ssl_vit.data.base import ImageDataModule, default_root
from ssl_vit.data.bench import lightly_dino_transform, views_per_second
from ssl_vit.data.cifar import CIFAR10DataModule, CIFAR100DataModule
from ssl_vit.data.datasets import ImageFiles, InMemoryImages, TransformedDataset
from ssl_vit.data.fashion_mnist import FashionMNISTDataModule
from ssl_vit.data.idx import read_idx, read_idx_images_labels
from ssl_vit.data.image_folder import ImageFolderDataModule, scan_image_dir
from ssl_vit.data.single_image import EvalTransform, OneView
from ssl_vit.data.stl10 import STL10DataModule
from ssl_vit.data.synthetic import SyntheticDataModule, make_synthetic_images
from ssl_vit.data.views import (
    MultiCrop,
    SingleView,
    TwoViews,
    ViewRecipe,
    ViewTransform,
)

__all__ = [
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "EvalTransform",
    "FashionMNISTDataModule",
    "ImageDataModule",
    "ImageFiles",
    "ImageFolderDataModule",
    "InMemoryImages",
    "MultiCrop",
    "OneView",
    "STL10DataModule",
    "SingleView",
    "SyntheticDataModule",
    "TransformedDataset",
    "TwoViews",
    "ViewRecipe",
    "ViewTransform",
    "default_root",
    "lightly_dino_transform",
    "make_synthetic_images",
    "read_idx",
    "read_idx_images_labels",
    "scan_image_dir",
    "views_per_second",
]
