"""Heads on a backbone's representation: MoCo v3's MLP, the DINO head, the masked patch prediction
head and the linear-probe head. Pure torch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.masking import TargetKind, target_shape


class MoCoV3MLP(nn.Sequential):
    """MoCo v3's MLP (Chen, Xie, He 2021, §4; reference ``moco/builder.py: _build_mlp``):
    ``num_layers`` Linear layers without bias (the BN after each cancels it), BatchNorm1d + ReLU
    after each hidden one, and a BatchNorm1d without affine after the last when ``last_bn``.
    An ``nn.Sequential`` in the reference's order, so parameter names match its checkpoints. The
    reference's ``MoCo_ViT`` builds the projector with 3 layers, the predictor with 2 (hidden 4096,
    output 256, last BN in both). (lightly's ``MoCoProjectionHead`` is MoCo v2's: 2 layers with
    biases, no BN.)"""

    def __init__(self, input_dim: int, hidden_dim: int = 4096, output_dim: int = 256, num_layers: int = 3, last_bn: bool = True) -> None:
        layers: list[nn.Module] = []
        for i in range(num_layers):
            d_in, d_out = input_dim if i == 0 else hidden_dim, output_dim if i == num_layers - 1 else hidden_dim
            layers.append(nn.Linear(d_in, d_out, bias=False))
            if i < num_layers - 1:
                layers += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
            elif last_bn:
                layers.append(nn.BatchNorm1d(d_out, affine=False))
        super().__init__(*layers)  # [B, input_dim] -> [B, output_dim]


class WeightNormLinear(nn.Module):
    """Bias-free linear layer with weight normalisation, ``W = g * v / ||v||`` row by row, its
    parameters named ``weight_g [out, 1]`` and ``weight_v [out, in]`` as the official DINO
    checkpoints. Not ``nn.utils.weight_norm``: its hook keeps ``weight`` as a non-leaf tensor and
    ``copy.deepcopy`` (the teacher is a copy of the student) then raises, as lightly's
    ``DINOProjectionHead`` does; ``parametrizations.weight_norm`` renames the parameters."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        v = torch.empty(out_features, in_features)
        nn.init.kaiming_uniform_(v, a=math.sqrt(5))  # nn.Linear's init, as the reference's layer
        self.weight_v = nn.Parameter(v)  # [K, bottleneck]
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))  # [K, 1]; the reference fills g with 1

    @property
    def weight(self) -> Tensor:
        return self.weight_v * (self.weight_g / self.weight_v.norm(dim=1, keepdim=True))  # [out, in]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)  # [..., out]


class DINOHead(nn.Module):
    """DINO's head (Caron et al. 2021, §3.1; reference ``vision_transformer.py: DINOHead``):
    ``[B, in_dim]`` -> MLP of ``nlayers`` Linear layers (GELU, optional BN) to ``bottleneck_dim``
    -> L2 normalisation -> weight-normalised Linear to K = ``out_dim`` -> ``[B, K]``. With
    ``norm_last_layer`` g stays 1 (the rows are unit vectors), which the paper found stabilising.
    Attribute names follow the reference, so official checkpoints load."""

    def __init__(self, in_dim: int, out_dim: int = 65536, use_bn: bool = False, norm_last_layer: bool = True, nlayers: int = 3,
                 hidden_dim: int = 2048, bottleneck_dim: int = 256) -> None:
        super().__init__()
        self.mlp: nn.Module = nn.Linear(in_dim, bottleneck_dim)
        if nlayers > 1:
            layers: list[nn.Module] = []
            for i in range(nlayers - 1):
                layers += [nn.Linear(in_dim if i == 0 else hidden_dim, hidden_dim), *([nn.BatchNorm1d(hidden_dim)] if use_bn else []), nn.GELU()]
            self.mlp = nn.Sequential(*layers, nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp.apply(_trunc_normal)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
        self.last_layer.weight_g.requires_grad_(not norm_last_layer)

    def forward(self, x: Tensor) -> Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))  # [B, K]

    def cancel_last_layer_gradients(self) -> None:
        """No update of the last layer (DINO freezes it in the first epoch; reference
        ``utils.cancel_gradients_last_layer``): ``grad = None``, so the optimiser skips it, weight
        decay and moments included. Call between backward and the optimiser step."""
        for p in self.last_layer.parameters():
            p.grad = None


def _trunc_normal(module: nn.Module) -> None:
    # DINO's DINOHead._init_weights (timm's too): truncated normal, std 0.02; zero bias.
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class MPPHead(nn.Module):
    """Masked patch prediction's "linear head on the patch's output token" (ViT paper B.1.2):
    ``[..., D]`` -> ``[..., *target_shape]`` (``ssl_vit.masking.target_shape``)."""

    def __init__(self, embed_dim: int, in_chans: int, patch_size: int, target: TargetKind = "mean_color") -> None:
        super().__init__()
        self.out_shape = target_shape(target, in_chans, patch_size)
        self.linear = nn.Linear(embed_dim, math.prod(self.out_shape))
        _trunc_normal(self.linear)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.linear(tokens).reshape(*tokens.shape[:-1], *self.out_shape)


class LinearProbeHead(nn.Module):
    """BatchNorm without affine, then a Linear layer (MAE ``main_linprobe.py``): the parameter-free
    BN standardises the frozen features, so one learning rate suits backbones of any feature
    scale. ``[B, in_dim] -> [B, num_classes]``."""

    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(in_dim, affine=False, eps=1e-6)
        self.linear = nn.Linear(in_dim, num_classes)
        nn.init.trunc_normal_(self.linear.weight, std=0.01)  # MAE's head init
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(self.norm(features))
