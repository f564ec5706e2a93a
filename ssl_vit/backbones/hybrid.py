"""The hybrid of the ViT paper (§3.1 "Hybrid Architecture"): the input sequence is taken from a
ResNet feature map, with patch size 1 on that map; the Transformer is unchanged."""

from __future__ import annotations

from typing import Literal

from einops import rearrange
from torch import Tensor, nn

from ssl_vit.backbones.resnet import ResNetBackbone
from ssl_vit.backbones.vit import VisionTransformer, patch_grid


class HybridEmbed(nn.Module):
    """ResNet trunk -> 1×1 projection to D -> token sequence; the ViT's ``patch_embed``.

    The ViT paper's R50 hybrid (Appendix B / §4.1 footnote) removes stage 4 and moves its blocks
    into stage 3, giving a stride-16 map: ``num_stages=3`` with ``layers=(3, 4, 9)``.
    """

    def __init__(self, resnet: Literal["resnet18", "resnet50"], in_chans: int, embed_dim: int, num_stages: Literal[1, 2, 3, 4], small_input: bool) -> None:
        super().__init__()
        layers = (3, 4, 9) if resnet == "resnet50" and num_stages == 3 else None
        self.backbone = ResNetBackbone(resnet, in_chans=in_chans, small_input=small_input, num_stages=num_stages, layers=layers)
        self.proj = nn.Conv2d(self.backbone.embed_dim, embed_dim, kernel_size=1)
        self.in_chans, self.patch_size = in_chans, self.backbone.stride  # pixels per token

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """``[B, C, H, W]`` -> tokens ``[B, N, D]`` read row-major from the map, and its grid."""
        patch_grid(x.shape[-2], x.shape[-1], self.patch_size)  # a size the stride does not divide is refused, as for patches
        x = self.proj(self.backbone.forward_features(x))  # [B, D, h, w]
        return rearrange(x, "b d h w -> b (h w) d"), (x.shape[-2], x.shape[-1])


def hybrid_vit(resnet: Literal["resnet18", "resnet50"], embed_dim: int, depth: int, num_heads: int, img_size: int = 224, in_chans: int = 3,
               num_stages: Literal[1, 2, 3, 4] = 3, small_input: bool = False, drop_path_rate: float = 0.0, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
               pos_embed: Literal["learn", "sincos"] = "learn", global_pool: Literal["token", "avg"] = "token",
               lean_backward: bool = True) -> VisionTransformer:
    """A ``VisionTransformer`` whose patch embedding is a ``HybridEmbed``."""
    return VisionTransformer(img_size, embed_dim=embed_dim, depth=depth, num_heads=num_heads, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                             drop_path_rate=drop_path_rate, pos_embed=pos_embed, global_pool=global_pool, lean_backward=lean_backward,
                             patch_embed=HybridEmbed(resnet, in_chans, embed_dim, num_stages, small_input))
