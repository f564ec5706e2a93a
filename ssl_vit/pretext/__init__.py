"""Pretext tasks as Lightning modules around the shared backbone. A new method is one file here
(a ``PretextModule`` subclass), one recipe and one test entry."""

from ssl_vit.pretext.base import PretextModule
from ssl_vit.pretext.dino import DINO
from ssl_vit.pretext.mocov3 import MoCoV3
from ssl_vit.pretext.mpp import MPP
from ssl_vit.pretext.nonfinite import NonFiniteLossError
from ssl_vit.pretext.supervised import Supervised

METHODS: dict[str, type[PretextModule]] = {"mpp": MPP, "mocov3": MoCoV3, "dino": DINO, "supervised": Supervised}

__all__ = ["DINO", "METHODS", "MPP", "MoCoV3", "NonFiniteLossError", "PretextModule", "Supervised"]
