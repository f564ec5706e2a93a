"""ResNet baselines (torchvision's ResNet without its classifier) and the ResNet trunk of the hybrid.

Attribute names are torchvision's (``conv1``, ``bn1``, ``layer1`` ...), so a state dict of
``resnet50`` here loads into ``torchvision.models.resnet50()`` with only ``fc.*`` missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from ssl_vit.backbones.vit import check_image

ResNetArch = Literal["resnet18", "resnet34", "resnet50", "resnet101"]
_ARCHS: dict[str, tuple[type[nn.Module], tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
}


class ResNetBackbone(nn.Module):
    """A torchvision ResNet with the classifier removed.

    Args:
        arch: which ResNet.
        in_chans: input channels; the stem convolution is rebuilt for values other than 3.
        img_size: nominal input resolution (recorded for export; any size works).
        small_input: CIFAR-style stem (3×3 stride-1 convolution, no max-pool) for 28–32 px images,
            as solo-learn and lightly use for CIFAR; otherwise the ImageNet stem (stride 4).
        num_stages: how many of the four residual stages to keep (the hybrid keeps fewer).
        layers: blocks per stage, overriding the architecture's (the ViT paper's R50 hybrid uses
            (3, 4, 9): stage 4 removed and its blocks moved into stage 3).
        zero_init_residual: zero the last BN of each residual branch (Goyal et al. 2017).
    """

    def __init__(
        self,
        arch: ResNetArch = "resnet50",
        in_chans: int = 3,
        img_size: int = 224,
        small_input: bool = False,
        num_stages: int = 4,
        layers: Sequence[int] | None = None,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if arch not in _ARCHS:
            raise ValueError(f"unknown ResNet arch {arch!r}; known: {', '.join(_ARCHS)}")
        if not 1 <= num_stages <= 4:
            raise ValueError(f"num_stages must be in 1..4, got {num_stages}")
        block, default_layers = _ARCHS[arch]
        stage_blocks = list(layers) if layers is not None else list(default_layers[:num_stages])
        if len(stage_blocks) != num_stages:
            raise ValueError(f"layers {stage_blocks} must give one block count per stage ({num_stages})")
        net = ResNet(block, stage_blocks + [1] * (4 - num_stages), zero_init_residual=zero_init_residual)
        if small_input:
            net.conv1 = nn.Conv2d(in_chans, 64, kernel_size=3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        elif in_chans != 3:
            net.conv1 = nn.Conv2d(in_chans, 64, kernel_size=7, stride=2, padding=3, bias=False)
        if small_input or in_chans != 3:
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        for i in range(1, num_stages + 1):
            setattr(self, f"layer{i}", getattr(net, f"layer{i}"))
        self.num_stages = num_stages
        self.arch = arch
        self.in_chans = in_chans
        self.img_size = (img_size, img_size)
        self.small_input = small_input
        self.stride = (1 if small_input else 4) * 2 ** (num_stages - 1)
        self.embed_dim = 64 * 2 ** (num_stages - 1) * (4 if block is Bottleneck else 1)
        self.num_features = self.embed_dim

    def _stages(self) -> list[nn.Module]:
        return [getattr(self, f"layer{i}") for i in range(1, self.num_stages + 1)]

    def _stem(self, x: Tensor) -> Tensor:
        check_image(x, self.in_chans, 1, self.arch)
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> last stage's feature map ``[B, D, H/s, W/s]`` (as timm's ResNets)."""
        x = self._stem(x)
        for stage in self._stages():
            x = stage(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> globally average-pooled representation ``[B, D]``."""
        return self.forward_features(x).mean(dim=(2, 3))

    def get_intermediate_layers(self, x: Tensor, n: int = 1, norm: bool = True) -> list[Tensor]:
        """Feature maps of the last ``n`` stages, each ``[B, C_i, h_i, w_i]`` (``norm`` is accepted
        for interface parity with the ViT and ignored: ResNet stages end in BatchNorm)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_stages:
            raise ValueError(f"n must be a number of last stages in 1..{self.num_stages} (stage indices are not taken), got {n!r}")
        outs = []
        x = self._stem(x)
        for stage in self._stages():
            x = stage(x)
            outs.append(x)
        return outs[-n:]

    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        raise NotImplementedError(f"{self.arch} has no attention; attention maps need a ViT or hybrid backbone")

    def no_weight_decay(self) -> set[str]:
        return set()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            raise NotImplementedError(f"gradient checkpointing is not implemented for {self.arch}")


@torch.no_grad()
def output_grid(img_size: tuple[int, int], trunk: ResNetBackbone) -> tuple[int, int]:
    """Spatial size of the trunk's output for an input size (every stride-2 layer rounds up)."""
    h, w = img_size
    halvings = (0 if trunk.small_input else 2) + (trunk.num_stages - 1)
    for _ in range(halvings):
        h, w = (h + 1) // 2, (w + 1) // 2
    return h, w
