"""The registered architectures: ViT Ti/S/B/L/H (ViT paper Table 1; Ti from DeiT), the hybrids
and the ResNet baselines."""

from __future__ import annotations

from ssl_vit.backbones.hybrid import hybrid_vit
from ssl_vit.backbones.registry import BackboneSpec, register_backbone
from ssl_vit.backbones.resnet import ResNetBackbone
from ssl_vit.backbones.vit import VisionTransformer

# name: (width D, depth, heads); the MLP is 4·D for all (specs §1).
VIT_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}

for _size, (_dim, _depth, _heads) in VIT_SIZES.items():
    register_backbone(
        BackboneSpec(
            f"vit_{_size}",
            VisionTransformer,
            fixed={"embed_dim": _dim, "depth": _depth, "num_heads": _heads, "mlp_ratio": 4.0},
            description=f"ViT-{_size[0].upper()}: D={_dim}, {_depth} layers, {_heads} heads",
        )
    )

# MoCo v3's ViT-S: DeiT's width and depth with 12 heads (reference vits.py vit_small; its README:
# "Our ViT-Small is with heads=12"), so its recipe and its official weights compute what the paper's do.
register_backbone(
    BackboneSpec(
        "vit_small_mocov3",
        VisionTransformer,
        fixed={"embed_dim": 384, "depth": 12, "num_heads": 12, "mlp_ratio": 4.0},
        description="MoCo v3's ViT-S: D=384, 12 layers, 12 heads",
    )
)

# Any other shape (small ViTs for 2-core CPU runs and tests): every argument free, timm layout kept.
register_backbone(
    BackboneSpec("vit", VisionTransformer, description="ViT of any width/depth/heads (set embed_dim, depth, num_heads)",
                 required=("embed_dim", "depth", "num_heads"))
)

# Hybrids: the ViT paper's R50+ViT-B/16 (stride-16 map from the extended stage 3), and a small
# ResNet-18 hybrid for 28–32 px images (use small_input=True, num_stages=2 or 3).
for _resnet, _size in (("resnet50", "small"), ("resnet50", "base"), ("resnet50", "large"), ("resnet18", "tiny"), ("resnet18", "small")):
    _dim, _depth, _heads = VIT_SIZES[_size]
    _short = "r50" if _resnet == "resnet50" else "r18"
    register_backbone(
        BackboneSpec(
            f"hybrid_{_short}_vit_{_size}",
            hybrid_vit,
            fixed={"resnet": _resnet, "embed_dim": _dim, "depth": _depth, "num_heads": _heads},
            description=f"{_resnet} stages feeding ViT-{_size[0].upper()}",
        )
    )

# Any other hybrid (small ones to set beside small ViTs and ResNets at equal compute): the ResNet
# and the Transformer's width, depth and heads free.
register_backbone(
    BackboneSpec("hybrid", hybrid_vit, description="resnet18/resnet50 stages feeding a ViT of any width/depth/heads (set resnet, embed_dim, depth, num_heads)",
                 required=("resnet", "embed_dim", "depth", "num_heads"))
)

for _arch in ("resnet18", "resnet34", "resnet50", "resnet101"):
    register_backbone(BackboneSpec(_arch, ResNetBackbone, fixed={"arch": _arch}, description=f"torchvision {_arch}, no classifier"))
