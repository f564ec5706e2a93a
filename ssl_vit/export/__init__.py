"""Backbone export and loading.

``ssl-vit export CKPT --out DIR`` (or :func:`export_backbone`) takes the backbone out of a
pretraining checkpoint (DINO: the teacher by default; MoCo v3: the base encoder; otherwise the
backbone) and writes:

* ``model.safetensors``: the backbone's weights under timm's names for ViTs (load into
  ``timm.create_model("vit_small_patch16_224", num_classes=0, img_size=..., patch_size=...,
  in_chans=...)`` with ``strict=True``), torchvision's for the ResNets (load into
  ``torchvision.models.resnet50()`` with only ``fc.*`` missing), our own for hybrids (a torchvision
  ResNet trunk under ``patch_embed.backbone.*`` and a 1x1 ``patch_embed.proj``);
* ``config.json``: timm's Hugging Face fields (``timm.create_model("local-dir:DIR",
  pretrained=True)`` works for ViTs and standard ResNets) and an ``ssl_vit`` section: registry name
  and kwargs, normalisation (recorded data statistics, else ImageNet's for RGB and 0.5 / 0.5
  otherwise), method, encoder, recipe, training record, evaluation results, file hashes;
* optionally ``model.torchscript.pt``, ``model.pt2`` (``torch.export``) and ``model.onnx``, each
  checked against the eager backbone.

:func:`load_backbone` rebuilds a backbone from an export folder, a checkpoint or a bare state
dict; :func:`load_any_backbone` also takes ``random:<name>`` and returns an info dict;
:func:`filter_foreign_state_dict` maps timm / official DINO / official MoCo v3 weights onto ours.
"""

from ssl_vit.export.foreign import filter_foreign_state_dict, load_weights
from ssl_vit.export.load import load_any_backbone, load_backbone
from ssl_vit.export.save import FORMATS, ExportResult, export_backbone, save_backbone
from ssl_vit.export.sources import BackboneSource, read_source
from ssl_vit.export.traced import ExportParityError

__all__ = [
    "FORMATS",
    "BackboneSource",
    "ExportParityError",
    "ExportResult",
    "export_backbone",
    "filter_foreign_state_dict",
    "load_any_backbone",
    "load_backbone",
    "load_weights",
    "read_source",
    "save_backbone",
]
