"""Methods as Lightning modules around the shared backbone. A new method is one file here (a
``BaseMethod`` subclass), one recipe and one test entry."""

from ssl_vit.methods.base import BaseMethod, NonFiniteLossError
from ssl_vit.methods.dino import DINO
from ssl_vit.methods.mocov3 import MoCoV3
from ssl_vit.methods.mpp import MPP
from ssl_vit.methods.supervised import Supervised

METHODS: dict[str, type[BaseMethod]] = {"mpp": MPP, "mocov3": MoCoV3, "dino": DINO, "supervised": Supervised}

__all__ = ["DINO", "METHODS", "MPP", "BaseMethod", "MoCoV3", "NonFiniteLossError", "Supervised"]
