"""Images in shards: an image folder written once into chunk files (``write_shards``) and streamed by
many nodes with litdata, each process and worker reading its own chunks of a shuffled order. As in
the image folders, an image's augmentations are drawn from its own seed, so a resumed run continues
with the uninterrupted run's batches; a corrupt image is logged, counted and replaced by another of
its chunk, which keeps every process's batch count."""

from __future__ import annotations

import functools
import io
import json
import multiprocessing
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Literal
from unittest import mock

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # older litdata asks PyPI from every process otherwise

import fsspec  # (Lightning's dependency: reads classes.json on local disk or object storage)
import torch
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.streaming.sampler import ChunkedIndex
from litdata.utilities.env import _DistributedEnv
from PIL import Image
from torch.utils.data import Dataset, Subset

from ssl_vit.data.datasets import MAX_CONSECUTIVE_FAILURES, TransformedDataset, open_image
from ssl_vit.data.image_folder import FolderLike, scan_image_dir
from ssl_vit.data.sampler import SeededIndex, sample_seeds
from ssl_vit.runtime import global_seed

META = "classes.json"  # beside litdata's index.json: {"classes": [names] | null, "images": N}


def _record(item: tuple[str, int, str]) -> dict[str, Any]:
    path, label, name = item
    # The name as bytes: litdata would read a str that names an existing image file as that image.
    return {"image": Path(path).read_bytes(), "label": label, "name": name.encode()}


def write_shards(image_dir: str | Path, out_dir: str | Path, chunk_bytes: str | int = "64MB", chunk_size: int | None = None,
                 num_workers: int = 1, classes_from: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Write the images of ``image_dir`` (``<class>/<image>`` or a flat, unlabelled folder) into shards in
    ``out_dir``: their files' bytes, label (-1: none) and relative path, in a seeded random order.
    ``classes_from``: the training shards whose class indices a validation split takes. Returns the
    metadata written to ``out_dir/classes.json``."""
    known = read_meta(classes_from)["classes"] if classes_from is not None else None
    class_to_idx = {name: i for i, name in enumerate(known)} if known else None
    paths, labels, classes = scan_image_dir(image_dir, class_to_idx)
    root = Path(image_dir).expanduser()
    inputs = [(p, -1 if labels is None else labels[i], os.path.relpath(p, root)) for i, p in enumerate(paths)]
    # Shuffled once here: litdata shuffles within a few chunks, and chunks of one class make batches of few classes.
    random.Random(seed).shuffle(inputs)
    start_method = multiprocessing.get_start_method(allow_none=True)
    # optimize stages its index in one folder per machine, emptied when it starts: a folder per conversion.
    with tempfile.TemporaryDirectory(prefix="ssl_vit_shards_") as scratch, mock.patch.dict(os.environ, {
            "DATA_OPTIMIZER_CACHE_FOLDER": os.path.join(scratch, "chunks"), "DATA_OPTIMIZER_DATA_CACHE_FOLDER": os.path.join(scratch, "data")}):
        try:  # (in the platform's start method, not litdata's spawn, which re-imports torch in every worker)
            optimize(fn=_record, inputs=inputs, output_dir=str(out_dir), chunk_size=chunk_size, chunk_bytes=None if chunk_size else chunk_bytes,
                     num_workers=num_workers, reorder_files=False, start_method=multiprocessing.get_start_method())
        finally:  # optimize sets it for the whole process, where DataLoaders would inherit it
            multiprocessing.set_start_method(start_method, force=True)
    meta = {"classes": None if classes is None else list(classes), "images": len(paths)}  # (classes in index order)
    with fsspec.open(f"{out_dir}/{META}", "w") as f:
        json.dump(meta, f)
    return meta


def read_meta(shard_dir: str) -> dict[str, Any]:
    with fsspec.open(f"{shard_dir}/{META}") as f:
        return json.load(f)


def _decode(item: dict[str, Any]) -> Image.Image | None:
    return open_image(io.BytesIO(item["image"]), bytes(item["name"]).decode())


class ShardImages(Dataset):
    """Shards read by index, items ``(PIL image, label)``, for setup, statistics and evaluation. An
    unreadable image is a 1x1 black image labelled -1 (dropped); its mark is shared with the stream."""

    def __init__(self, shard_dir: str, cache_dir: str | None = None) -> None:
        self.shard_dir, self.cache_dir = shard_dir, cache_dir
        self.reader = StreamingDataset(shard_dir, cache_dir=cache_dir)
        self.size = sum(end - start for start, end in self.reader.region_of_interest)
        self.bad = torch.zeros(self.size, dtype=torch.uint8).share_memory_()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        item = self.reader[int(index)]
        image = None if self.bad[index] else _decode(item)
        if image is None:
            self.bad[index] = 1
            return Image.new("RGB", (1, 1)), -1
        return image, int(item["label"])

    @property
    def skipped_paths(self) -> list[str]:
        """The images found unreadable so far (here, in the workers and in the training stream)."""
        return [bytes(self.reader[i]["name"]).decode() for i in self.bad.nonzero().flatten().tolist()]


class ShardStream(StreamingDataset):
    """The training stream of ``images``' shards, items ``(views, label)``, each image augmented from its own seed."""

    def __init__(self, images: ShardImages, views: Any, mean: Any, std: Any, in_chans: int, seed: int, drop_last: bool,
                 world_size: int, rank: int, num_nodes: int) -> None:
        super().__init__(images.shard_dir, cache_dir=images.cache_dir, shuffle=True, seed=seed, drop_last=drop_last)
        # The Trainer's layout, not litdata's guess (it counts nodes by GPUs and cannot on CPUs).
        self.distributed_env = _DistributedEnv(world_size, rank, num_nodes)
        self.bad = images.bad
        self.transformed = TransformedDataset(_Decoded(self), views, mean, std, in_chans, multi_view=True)

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, ChunkedIndex):
            return super().__getitem__(index)
        # litdata's epochs count from 1, Lightning's from 0: the seed of epoch e is the folders' of e.
        return self.transformed[SeededIndex(index, sample_seeds(self.seed, self.current_epoch - 1, [index.index])[0])]


class _Decoded:
    """The stream's decoded images by ``ChunkedIndex``; an unreadable one is replaced by another of its
    chunk (a draw of the sample's seeded ``random``)."""

    def __init__(self, stream: ShardStream) -> None:
        self.stream = stream

    def __getitem__(self, index: ChunkedIndex) -> tuple[Image.Image, int]:
        stream = self.stream
        for _ in range(MAX_CONSECUTIVE_FAILURES):
            if not stream.bad[index.index]:
                item = StreamingDataset.__getitem__(stream, index)
                if (image := _decode(item)) is not None:
                    return image, int(item["label"])
                stream.bad[index.index] = 1
            first, *_, end = stream.cache.get_chunk_intervals()[index.chunk_index]
            index = ChunkedIndex(index=random.randrange(first, end), chunk_index=index.chunk_index)
        raise RuntimeError(f"{MAX_CONSECUTIVE_FAILURES} unreadable images in a row in {stream.input_dir.path or stream.input_dir.url}")


class ShardLoader(StreamingDataLoader):
    """litdata's loader, whose ``state_dict`` (the images of the epoch handed out on this process)
    Lightning checkpoints; a resume continues the checkpoint's order under its seed."""

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        self.dataset.seed = obj["dataset"]["seed"]  # (a run seeded at random continues its own order)
        super().load_state_dict(obj)

    def epochs_done(self) -> float:
        """Passes over the training set so far, with the part of the current one."""
        per_epoch = len(self) * (self.batch_size or 1)
        return max(self.current_epoch - 1, 0) + min(self._num_samples_yielded_streaming / max(per_epoch, 1), 1.0)


class ImageShardsDataModule(FolderLike):
    """Images from shards written by ``tools/folder_to_shards.py``, on local disk or object storage
    (``s3://...``), each read once an epoch over nodes, processes and workers (litdata drops the few
    that do not divide).

    Args:
        train_dir: the training shards (labelled or not: labels -1, ``num_classes`` None).
        val_dir: the evaluation shards (written with ``--classes-from`` the training shards); None: none.
        cache_dir: where litdata keeps chunks of remote shards (None: its default).
        img_size, in_chans, **kwargs: ``ImageDataModule``'s (mean / std: measured on the training
            images unless given; ``subset`` is not supported: write the subset's shards).
    """

    def __init__(self, train_dir: str, val_dir: str | None = None, cache_dir: str | None = None, img_size: int = 224,
                 in_chans: Literal[1, 3] = 3, **kwargs: Any) -> None:
        super().__init__(img_size=img_size, in_chans=in_chans, **kwargs)
        if self.subset is not None:
            raise ValueError("subset: shards are streamed whole; write the subset's images into shards of their own")
        self.train_dir, self.val_dir, self.cache_dir = train_dir, val_dir, cache_dir

    @functools.cached_property
    def class_names(self) -> list[str] | None:  # type: ignore[override]
        return read_meta(self.train_dir)["classes"]

    @property
    def unlabelled_train_images(self) -> int:
        return 0 if self.class_names is not None else read_meta(self.train_dir)["images"]

    def measure_statistics(self, train: ShardImages) -> None:
        # The first images: written in a random order, they are a random sample in a few chunks.
        super().measure_statistics(Subset(train, range(min(self.stats_images, len(train)))))

    def _load_split(self, train: bool) -> ShardImages | None:
        if not train and self.val_dir is not None and read_meta(self.val_dir)["classes"] != self.class_names:
            raise ValueError(f"{self.val_dir} has other classes than {self.train_dir}; write it with "
                             f"tools/folder_to_shards.py --classes-from {self.train_dir}")
        shard_dir = self.train_dir if train else self.val_dir
        return None if shard_dir is None else ShardImages(shard_dir, self.cache_dir)

    def train_dataloader(self) -> ShardLoader:
        self._ensure_setup()
        trainer = self.trainer
        world, rank, nodes = (trainer.world_size, trainer.global_rank, trainer.num_nodes) if trainer is not None else (1, 0, 1)
        stream = ShardStream(self._train_source, self.views, self.mean, self.std, self.in_chans, global_seed(self.seed),
                             drop_last=self.drop_last or world > 1, world_size=world, rank=rank, num_nodes=nodes)
        # Workers not persistent: each epoch's take the stream's epoch (and a resume's position) from this process.
        return ShardLoader(stream, batch_size=self.batch_size, **self._loader_args(persistent=False))
