"""ssl_vit: self-supervised pretraining of Vision Transformers.

The backbone registry is importable without Lightning::

    from ssl_vit import create_backbone
    vit = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1)
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "create_backbone", "list_backbones", "load_backbone"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `import ssl_vit` (and the CLI's start-up) stays light and
    # the CLI can configure the threading runtime before torch loads.
    if name in ("create_backbone", "list_backbones"):
        from ssl_vit import backbones

        return getattr(backbones, name)
    if name == "load_backbone":
        from ssl_vit.export import load_backbone

        return load_backbone
    raise AttributeError(f"module 'ssl_vit' has no attribute {name!r}")
