"""Datamodules and the view transforms of each method, chosen in a recipe by ``class_path``
(``data: {class_path: FashionMNISTDataModule, init_args: {views: {class_path: MultiCrop}}}``)."""

from ssl_vit.data.base import ImageDataModule, data_root
from ssl_vit.data.datasets import ImageFiles, InMemoryImages, TransformedDataset
from ssl_vit.data.fashion_mnist import FashionMNISTDataModule, read_idx, read_idx_images_labels
from ssl_vit.data.image_folder import ImageFolderDataModule, scan_image_dir
from ssl_vit.data.sampler import ResumableLoader, ResumableSampler
from ssl_vit.data.shards import ImageShardsDataModule, ShardImages, write_shards
from ssl_vit.data.synthetic import SyntheticDataModule, make_synthetic_images
from ssl_vit.data.torchvision_sets import CIFAR10DataModule, CIFAR100DataModule, STL10DataModule
from ssl_vit.data.views import EvalTransform, MultiCrop, SingleView, TwoViews, ViewTransform

__all__ = [
    "CIFAR10DataModule", "CIFAR100DataModule", "EvalTransform", "FashionMNISTDataModule", "ImageDataModule",
    "ImageFiles", "ImageFolderDataModule", "ImageShardsDataModule", "InMemoryImages", "MultiCrop", "ResumableLoader", "ResumableSampler",
    "STL10DataModule", "ShardImages", "SingleView", "SyntheticDataModule", "TransformedDataset", "TwoViews", "ViewTransform",
    "data_root", "make_synthetic_images", "read_idx", "read_idx_images_labels", "scan_image_dir", "write_shards",
]
