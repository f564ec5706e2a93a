"""ssl_vit: self-supervised pretraining of Vision Transformers.

The backbone registry is importable without Lightning::

    from ssl_vit import create_backbone
    vit = create_backbone("vit_tiny", img_size=28, patch_size=4, in_chans=1)
"""

__version__ = "0.1.0"

from ssl_vit.backbones import create_backbone, list_backbones  # noqa: E402

__all__ = ["__version__", "create_backbone", "list_backbones", "load_backbone"]


def __getattr__(name: str):
    # `load_backbone` lives with the export code; import it lazily so `import ssl_vit` stays light.
    if name == "load_backbone":
        from ssl_vit.export import load_backbone

        return load_backbone
    raise AttributeError(f"module 'ssl_vit' has no attribute {name!r}")
