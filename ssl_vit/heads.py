"""Heads that sit on a backbone's representation: MoCo v3 MLPs, the DINO head, the masked patch
prediction head and the linear-probe head. Pure torch: usable without Lightning."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.masking import TargetKind, target_shape

# --------------------------------------------------------------------------------------------
# MoCo v3


class MoCoV3MLP(nn.Sequential):
    """MoCo v3's MLP (Chen, Xie, He 2021, §4; reference ``moco/builder.py: _build_mlp``).

    ``num_layers`` Linear layers without bias; BatchNorm1d + ReLU after every hidden layer; after
    the last layer a BatchNorm1d without affine when ``last_bn`` (SimCLR's design with gamma and
    beta removed). Built as an ``nn.Sequential`` in the reference's order, so the parameter names
    (``0.weight``, ``1.running_mean``, ...) match its checkpoints.

    lightly's ``MoCoProjectionHead`` is MoCo v2's (2 layers with biases, no BN), hence our own.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int = 4096,
        output_dim: int = 256,
        num_layers: int = 3,
        last_bn: bool = True,
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        layers: list[nn.Module] = []
        for i in range(num_layers):
            d_in = input_dim if i == 0 else hidden_dim
            d_out = output_dim if i == num_layers - 1 else hidden_dim
            # No bias, as in the reference: the BN that follows would cancel it.
            layers.append(nn.Linear(d_in, d_out, bias=False))
            if i < num_layers - 1:
                layers.append(nn.BatchNorm1d(d_out))
                layers.append(nn.ReLU(inplace=True))
            elif last_bn:
                layers.append(nn.BatchNorm1d(d_out, affine=False))
        super().__init__(*layers)
        self.input_dim = input_dim
        self.output_dim = output_dim


class MoCoV3ProjectionHead(MoCoV3MLP):
    """MoCo v3 projector (§4, reference ``MoCo_ViT``): 3 layers, hidden 4096, out 256, final BN.

    ``x [B, input_dim] -> [B, output_dim]``. The momentum encoder holds an EMA copy of it.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int = 4096,
        output_dim: int = 256,
        num_layers: int = 3,
        last_bn: bool = True,
    ) -> None:
        super().__init__(input_dim, hidden_dim, output_dim, num_layers, last_bn)


class MoCoV3PredictionHead(MoCoV3MLP):
    """MoCo v3 predictor (§4): 2 layers, hidden 4096, out 256 (query branch only).

    ``last_bn`` defaults to True, following the released reference code for ViT:
    ``MoCo_ViT`` builds ``self.predictor = self._build_mlp(2, dim, mlp_dim, dim)`` (last_bn=True),
    which also matches the spec's "same pattern". Only the reference's ``MoCo_ResNet`` passes
    ``last_bn=False`` for its predictor; set ``last_bn=False`` to reproduce that variant.
    """

    def __init__(
        self,
        input_dim: int = 256,
        hidden_dim: int = 4096,
        output_dim: int = 256,
        num_layers: int = 2,
        last_bn: bool = True,
    ) -> None:
        super().__init__(input_dim, hidden_dim, output_dim, num_layers, last_bn)


# --------------------------------------------------------------------------------------------
# DINO


class WeightNormLinear(nn.Module):
    """Bias-free linear layer with weight normalisation: ``W = g * v / ||v||`` row-wise.

    Parameters are named ``weight_g [out, 1]`` and ``weight_v [out, in]`` as in the official DINO
    checkpoints (made with ``nn.utils.weight_norm``). We do not use that helper because its
    forward-pre-hook stores ``weight`` as a non-leaf tensor and ``copy.deepcopy`` of such a module
    raises "Only Tensors created explicitly by the user (graph leaves) support the deepcopy
    protocol" on current torch; lightly's ``DINOProjectionHead`` uses it and fails that way, which
    breaks building the teacher as a deep copy of the student. The newer
    ``nn.utils.parametrizations.weight_norm`` survives deepcopy but renames the parameters
    (``parametrizations.weight.original0/1``), so checkpoints would no longer line up.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # v: nn.Linear's default init, as in the reference, where the weight-normed layer is
        # created after the trunc-normal init of the MLP (vision_transformer.py: DINOHead).
        v = torch.empty(out_features, in_features)
        nn.init.kaiming_uniform_(v, a=math.sqrt(5))
        self.weight_v = nn.Parameter(v)  # [K, bottleneck]
        # g = 1: the reference fills weight_g with 1 right after wrapping.
        self.weight_g = nn.Parameter(torch.ones(out_features, 1))  # [K, 1]

    @property
    def weight(self) -> Tensor:
        """The effective weight ``[out, in]``; each row has norm ``|g|``."""
        return self.weight_v * (self.weight_g / self.weight_v.norm(dim=1, keepdim=True))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)  # [..., out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


class DINOHead(nn.Module):
    """DINO projection head (Caron et al. 2021, §3.1; reference ``vision_transformer.py: DINOHead``).

    ``x [B, in_dim]`` -> MLP of ``nlayers`` Linear layers (hidden ``hidden_dim``, GELU, optional
    BN) to ``bottleneck_dim`` -> L2 normalise -> weight-normalised Linear without bias to
    ``out_dim`` = K -> ``[B, K]``. With ``norm_last_layer`` the weight norm g stays fixed at 1 (the
    rows of the last layer are unit vectors), which the paper found stabilising.

    Attribute names (``mlp``, ``last_layer.weight_g``, ``last_layer.weight_v``) follow the reference
    so official checkpoints load.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int = 65536,
        use_bn: bool = False,
        norm_last_layer: bool = True,
        nlayers: int = 3,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
    ) -> None:
        super().__init__()
        if nlayers < 1:
            raise ValueError(f"nlayers must be >= 1, got {nlayers}")
        self.mlp: nn.Module
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers: list[nn.Module] = []
            for i in range(nlayers - 1):
                layers.append(nn.Linear(in_dim if i == 0 else hidden_dim, hidden_dim))
                if use_bn:
                    layers.append(nn.BatchNorm1d(hidden_dim))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.mlp.apply(_init_trunc_normal)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim)
        self.norm_last_layer = norm_last_layer
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        x = self.mlp(x)  # [B, bottleneck]
        x = F.normalize(x, dim=-1, p=2)  # [B, bottleneck]
        return self.last_layer(x)  # [B, K]

    def cancel_last_layer_gradients(self) -> None:
        """Drop the last layer's gradients (DINO freezes it during the first epoch, §3.1 /
        reference ``utils.cancel_gradients_last_layer``). Call after ``backward`` and before the
        optimiser step; setting ``grad = None`` (not zero) makes the optimiser skip the
        parameters entirely, weight decay and moment updates included, as in the reference."""
        for p in self.last_layer.parameters():
            p.grad = None


def _init_trunc_normal(module: nn.Module) -> None:
    # DINO reference DINOHead._init_weights: trunc-normal std 0.02, zero bias.
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# --------------------------------------------------------------------------------------------
# Masked patch prediction


class MPPHead(nn.Module):
    """Linear head for masked patch prediction (ViT paper B.1.2: "a linear head on the patch's
    output token").

    ``tokens [..., D]`` -> ``[..., 8**C]`` logits for ``"mean_color"``, ``[..., 16, 8**C]`` for
    ``"downsized"``, ``[..., P*P*C]`` pixel values for ``"pixels"`` (see ``ssl_vit.masking``).
    """

    def __init__(
        self,
        embed_dim: int,
        in_chans: int,
        patch_size: int,
        target: TargetKind = "mean_color",
    ) -> None:
        super().__init__()
        self.target = target
        self.out_shape = target_shape(target, in_chans, patch_size)
        self.linear = nn.Linear(embed_dim, math.prod(self.out_shape))
        _init_trunc_normal(self.linear)

    def forward(self, tokens: Tensor) -> Tensor:
        out = self.linear(tokens)  # [..., prod(out_shape)]
        return out.reshape(*tokens.shape[:-1], *self.out_shape)


# --------------------------------------------------------------------------------------------
# Linear probe


class LinearProbeHead(nn.Module):
    """BatchNorm without affine, then one Linear layer (MAE's linear-probe protocol, specs §5).

    The parameter-free BN standardises the frozen features, so one learning rate suits
    backbones with very different feature scales; it can be folded into the Linear afterwards.
    ``features [B, in_dim] -> logits [B, num_classes]``.
    """

    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__()
        # MAE main_linprobe.py: BatchNorm1d(affine=False, eps=1e-6), head trunc-normal std 0.01.
        self.norm = nn.BatchNorm1d(in_dim, affine=False, eps=1e-6)
        self.linear = nn.Linear(in_dim, num_classes)
        nn.init.trunc_normal_(self.linear.weight, std=0.01)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(self.norm(features))  # [B, num_classes]
