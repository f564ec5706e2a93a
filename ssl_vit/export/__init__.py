"""Backbone export (``ssl-vit export``, :func:`export_backbone`, :func:`save_backbone`: weights under
timm's and torchvision's names, a ``config.json`` timm reads, traced copies checked against the eager
model) and loading (:func:`load_backbone`, :func:`load_any_backbone`: exports, checkpoints, bare and
foreign state dicts through :func:`filter_foreign_state_dict`, random initialisations)."""

from ssl_vit.export.foreign import filter_foreign_state_dict, load_weights
from ssl_vit.export.load import BackboneSource, chosen_encoder, load_any_backbone, load_backbone
from ssl_vit.export.save import FORMATS, ExportResult, export_backbone, save_backbone
from ssl_vit.export.traced import ExportParityError

__all__ = [
    "FORMATS", "BackboneSource", "ExportParityError", "ExportResult", "chosen_encoder", "export_backbone",
    "filter_foreign_state_dict", "load_any_backbone", "load_backbone", "load_weights", "save_backbone",
]
