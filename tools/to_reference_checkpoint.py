"""Rewrite an ``ssl-vit fit`` checkpoint in the layout of the method's reference repository, so that
its own evaluation scripts read it (DINO's ``eval_linear.py`` / ``eval_knn.py`` with
``--pretrained_weights``, MoCo v3's ``main_lincls.py`` with ``--pretrained``):

* DINO: ``{"student": ..., "teacher": ..., "epoch": ...}``, each ``backbone.*`` (timm's ViT names,
  as the reference's ``vision_transformer.py``) and ``head.*`` (``mlp.*``, ``last_layer.weight_g/v``);
* MoCo v3: ``{"state_dict": {"module.base_encoder.*", "module.momentum_encoder.*"}, "epoch": ...}``
  (the encoders without their heads, which ``main_lincls.py`` drops anyway);
* any other method: the backbone's state dict (timm's names), what ``timm`` loads.

    python tools/to_reference_checkpoint.py runs/dino/checkpoints/last.ckpt dino_ref.pth

``ssl-vit export`` and ``ssl_vit.load_backbone`` read such files back (``--arch`` names the
architecture).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ssl_vit.training.checkpoint import load_record


def convert(checkpoint: dict) -> dict:
    """The reference layout of a Lightning checkpoint of ours (module docstring)."""
    state, info = checkpoint["state_dict"], checkpoint.get("ssl_vit") or {}

    def part(prefix: str, to: str = "") -> dict[str, torch.Tensor]:
        return {to + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

    method, epoch = str(info.get("method", "")).lower(), checkpoint.get("epoch", 0)
    if method == "dino":
        return {"student": {**part("backbone.", "backbone."), **part("head.", "head.")},
                "teacher": {**part("teacher_backbone.", "backbone."), **part("teacher_head.", "head.")}, "epoch": epoch}
    if method == "mocov3":
        return {"state_dict": {**part("backbone.", "module.base_encoder."), **part("momentum_backbone.", "module.momentum_encoder.")},
                "epoch": epoch}
    return part("backbone.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/to_reference_checkpoint.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint written by ssl-vit fit")
    parser.add_argument("out", type=Path, help="the file to write (.pth)")
    args = parser.parse_args(argv)
    checkpoint = load_record(args.checkpoint)
    if "state_dict" not in checkpoint or "ssl_vit" not in checkpoint:
        parser.error(f"{args.checkpoint}: not a checkpoint written by ssl-vit fit")
    torch.save(convert(checkpoint), args.out)
    print(f"{args.out}: {checkpoint['ssl_vit'].get('method')} checkpoint in its reference repository's layout")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
