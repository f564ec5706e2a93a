"""ResNet baselines (torchvision's ResNet without its classifier) and the ResNet trunk of the hybrid.

Attribute names are torchvision's (``conv1``, ``bn1``, ``layer1`` ...), so a state dict of
``resnet50`` here loads into ``torchvision.models.resnet50()`` with only ``fc.*`` missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from ssl_vit.backbones.vit import check_image

_ARCHS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet34": (BasicBlock, (3, 4, 6, 3)),
          "resnet50": (Bottleneck, (3, 4, 6, 3)), "resnet101": (Bottleneck, (3, 4, 23, 3))}


class ResNetBackbone(nn.Module):
    """A torchvision ResNet with the classifier removed.

    Args:
        arch: which ResNet.
        in_chans: input channels; the stem convolution is rebuilt for values other than 3.
        img_size: nominal input resolution (recorded for export; any size works).
        small_input: the CIFAR stem of solo-learn and lightly (3×3 stride-1 convolution, no
            max-pool) for 28–32 px images; otherwise the ImageNet stem (stride 4).
        num_stages: how many of the four residual stages to keep (the hybrid keeps fewer).
        layers: blocks per kept stage, overriding the architecture's (the ViT paper's R50 hybrid
            uses (3, 4, 9): stage 4 removed and its blocks moved into stage 3).
        zero_init_residual: zero the last BN of each residual branch (Goyal et al. 2017).
    """

    def __init__(self, arch: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet50", in_chans: int = 3, img_size: int = 224,
                 small_input: bool = False, num_stages: Literal[1, 2, 3, 4] = 4, layers: Sequence[int] | None = None, zero_init_residual: bool = False) -> None:
        super().__init__()
        block, depths = _ARCHS[arch]
        net = ResNet(block, [*(layers or depths[:num_stages]), *[1] * (4 - num_stages)], zero_init_residual=zero_init_residual)
        if small_input or in_chans != 3:
            k, stride = (3, 1) if small_input else (7, 2)
            net.conv1 = nn.Conv2d(in_chans, 64, kernel_size=k, stride=stride, padding=k // 2, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init
        self.conv1, self.bn1, self.relu = net.conv1, net.bn1, net.relu
        self.maxpool = nn.Identity() if small_input else net.maxpool
        for i in range(1, num_stages + 1):
            setattr(self, f"layer{i}", getattr(net, f"layer{i}"))
        self.arch, self.in_chans, self.img_size = arch, in_chans, (img_size, img_size)
        self.small_input, self.num_stages = small_input, num_stages
        self.stride = (1 if small_input else 4) * 2 ** (num_stages - 1)  # input pixels per feature-map cell
        self.embed_dim = 64 * 2 ** (num_stages - 1) * (4 if block is Bottleneck else 1)

    def stages(self) -> list[nn.Module]:
        return [getattr(self, f"layer{i}") for i in range(1, self.num_stages + 1)]

    def _stem(self, x: Tensor) -> Tensor:
        check_image(x, self.in_chans, self.arch)
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def forward_features(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> last stage's feature map ``[B, D, H/s, W/s]`` (as timm's ResNets)."""
        x = self._stem(x)
        for stage in self.stages():
            x = stage(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> globally average-pooled representation ``[B, D]``."""
        return self.forward_features(x).mean(dim=(2, 3))

    def get_intermediate_layers(self, x: Tensor, n: int = 1, norm: bool = True) -> list[Tensor]:
        """Feature maps ``[B, C_i, h_i, w_i]`` of the last ``n`` stages (``norm``, for parity with
        the ViT, is ignored: ResNet stages end in BatchNorm)."""
        if not 1 <= n <= self.num_stages:
            raise ValueError(f"n must be a number of last stages in 1..{self.num_stages}, got {n!r}")
        outs, x = [], self._stem(x)
        for stage in self.stages():
            x = stage(x)
            outs.append(x)
        return outs[-n:]

    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        raise NotImplementedError(f"{self.arch} has no attention; attention maps need a ViT or hybrid backbone")

    def no_weight_decay(self) -> set[str]:
        return set()
