"""Backbone export and loading.

``ssl-vit export CKPT --out DIR`` (:func:`export_backbone`) takes the backbone out of a pretraining
checkpoint (DINO's teacher by default, MoCo v3's base encoder, otherwise the backbone) and writes
``model.safetensors`` (timm's names for ViTs, torchvision's for ResNets, our own for hybrids),
``config.json`` (:mod:`ssl_vit.export.config`) and, on request, TorchScript, ``torch.export`` and
ONNX copies, each checked against the eager backbone. :func:`load_backbone` rebuilds a backbone from
an export folder, a checkpoint or a bare state dict; :func:`load_any_backbone` also takes
``random:<name>`` and returns an info dict; :func:`filter_foreign_state_dict` maps timm, official
DINO and official MoCo v3 weights onto ours.
"""

from ssl_vit.export.foreign import filter_foreign_state_dict, load_weights
from ssl_vit.export.load import load_any_backbone, load_backbone
from ssl_vit.export.save import FORMATS, ExportResult, export_backbone, save_backbone
from ssl_vit.export.sources import BackboneSource, chosen_encoder, read_source
from ssl_vit.export.traced import ExportParityError

__all__ = [
    "FORMATS", "BackboneSource", "ExportParityError", "ExportResult", "chosen_encoder", "export_backbone",
    "filter_foreign_state_dict", "load_any_backbone", "load_backbone", "load_weights", "read_source", "save_backbone",
]
