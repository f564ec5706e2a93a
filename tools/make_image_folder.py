"""Write a dataset ssl_vit knows (Fashion-MNIST, CIFAR-10 ...) as a folder of PNG images, the layout
of a dataset of one's own: ``OUT/train/<class>/``, ``OUT/val/<class>/`` and, with
``--unlabelled-fraction``, part of the training images without labels in ``OUT/unlabelled/``.

    python tools/make_image_folder.py fashion_mnist data/fmnist_folder --limit 6000
    python tools/make_image_folder.py fashion_mnist data/fmnist_low --unlabelled-fraction 0.9

Then ``ImageFolderDataModule(train_dir=OUT/unlabelled, ...)`` pretrains without labels and a recipe's
``evaluate.data`` evaluates on ``OUT/train`` and ``OUT/val`` (README, "Your own images").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ssl_vit.cli.options import DATASETS, datamodule_class
from ssl_vit.data.augment import to_pil


def write(items, names: list[str], folders: dict[str, Path]) -> int:
    """Save the ``(image, label)`` items (raw, as the datamodule reads them) under ``folders[class]``
    (``folders[""]``: the unlabelled ones)."""
    for i, (image, label) in enumerate(items):
        folder = folders[names[label]] if label >= 0 else folders[""]
        folder.mkdir(parents=True, exist_ok=True)
        to_pil(image).save(folder / f"{i:06d}.png")
    return len(items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/make_image_folder.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", choices=sorted(DATASETS), help="a dataset ssl_vit can read")
    parser.add_argument("out", type=Path, help="the folder to write (must not exist yet)")
    parser.add_argument("--root", default=None, help="where the dataset is (its datamodule's root; default: the usual place)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many training images (a random draw); the test split whole")
    parser.add_argument("--unlabelled-fraction", type=float, default=0.0, help="this share of the training images goes to unlabelled/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists; name a new folder")
    dm = datamodule_class(args.data)(**({"root": args.root} if args.root else {}))
    dm.setup()
    names = [str(n).replace("/", "-") for n in (dm.class_names or range(dm.num_classes))]  # (folder names)
    train, test = dm._labelled_train_source(), dm._test_source
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed)).tolist()[: args.limit]
    by_class: dict[int, list[int]] = {}
    for i in order:
        by_class.setdefault(train[i][1], []).append(i)
    # The same share of every class unlabelled, so that the labelled images keep every class.
    cut = {c: round(len(idx) * args.unlabelled_fraction) for c, idx in by_class.items()}
    unlabelled = [(train[i][0], -1) for c, idx in by_class.items() for i in idx[: cut[c]]]
    labelled = [train[i] for c, idx in by_class.items() for i in idx[cut[c]:]]
    written = write(labelled, names, {c: args.out / "train" / c for c in names})
    written_u = write(unlabelled, names, {"": args.out / "unlabelled"})
    written_t = write([test[i] for i in range(len(test))], names, {c: args.out / "val" / c for c in names}) if test is not None else 0
    print(f"{args.out}: {written} labelled training images in train/, {written_u} in unlabelled/, {written_t} test images in val/ "
          f"({len(names)} classes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
