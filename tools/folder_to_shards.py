"""Write an image folder (``<class>/<image>``, or a flat folder of unlabelled images) into litdata
shards that ``ImageShardsDataModule`` streams: the image files' bytes as they are (decoded when
read, as the folder's are), their labels and relative paths, in chunks of about ``--chunk-bytes``.

    python tools/folder_to_shards.py /data/imagenet/train /data/shards/imagenet/train --num-workers 32
    python tools/folder_to_shards.py /data/imagenet/val /data/shards/imagenet/val \\
        --classes-from /data/shards/imagenet/train

Then ``recipes/imagenet/dino_vit_small16_shards.yaml`` trains from them (README, "Feeding many GPUs").
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ssl_vit.data.shards import write_shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/folder_to_shards.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the image folder: class subfolders, or images directly in it (unlabelled)")
    parser.add_argument("out", help="the shards' folder (must not exist yet; an s3:// ... URL writes to object storage)")
    parser.add_argument("--chunk-bytes", default="64MB", help="chunk size in bytes (litdata's recommended 64MB: large enough to stream, "
                        "small enough for every worker of every process to get chunks of its own)")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunks of this many images instead of --chunk-bytes")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="processes reading the files (default: every CPU)")
    parser.add_argument("--seed", type=int, default=0, help="of the order the images are written in (shuffled, so that a chunk mixes classes)")
    parser.add_argument("--classes-from", default=None, help="training shards whose class indices this (validation) folder takes")
    args = parser.parse_args(argv)
    if "://" not in args.out and Path(args.out).exists():
        parser.error(f"{args.out} exists; name a new folder")
    meta = write_shards(args.folder, args.out, chunk_bytes=args.chunk_bytes, chunk_size=args.chunk_size, num_workers=args.num_workers,
                        classes_from=args.classes_from, seed=args.seed)
    labels = f"{len(meta['classes'])} classes" if meta["classes"] else "unlabelled"
    print(f"{args.out}: {meta['images']} images ({labels})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
