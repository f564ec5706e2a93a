"""FLOPs: analytic counts of the backbones and of one training step of each pretext task, and the
running total of pretraining compute (the x-axis of the ViT paper's Figure 5).

Convention: only matrix products are counted (linear layers, convolutions, attention's QKᵀ and
AV), one multiply-add = 2 FLOPs. Normalisations, activations, softmaxes and the optimiser are left
out; they are a few per cent of a ViT's work and the usual tables leave them out too (timm's GMACs
in specs §1, fvcore, ``torch.utils.flop_counter.FlopCounterMode``). So half of
``vit_forward_flops`` is the GMAC figure: ViT-S/16 at 224 px -> 4.60 GMACs (timm: 4.61).

Training = forward + backward. The backward of a matrix product is two products of the same size
(the gradient of its input and of its weight), so a trained pass costs 3 x its forward, less the
gradients nobody computes: the image's (the first layer gets no input gradient) and a frozen
first layer's weight (MoCo v3's random patch projection). Momentum encoders and teachers run
forward only. Everything is per image.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.backbones.vit import as_pair
from ssl_vit.heads import WeightNormLinear
from ssl_vit.methods.sharding import unwrap_module

if TYPE_CHECKING:
    import lightning as L

Shape = Sequence[int]
ShapeOf = Callable[[Tensor], torch.Size]  # a parameter -> its shape before any FSDP wrapping

# --------------------------------------------------------------------------------------------
# analytic counts


def vit_block_flops(embed_dim: int, mlp_hidden_dim: int, seq_len: int) -> float:
    """Forward FLOPs of one pre-norm Transformer block on a sequence of ``seq_len`` tokens
    (ViT paper eqs. 2-3): QKV projection, QKᵀ and AV (all heads together: the head count only
    splits D, it does not change the work), output projection, the two MLP layers."""
    d, t = embed_dim, seq_len
    macs = t * d * 3 * d  # QKV: [T, D] @ [D, 3D]
    macs += 2 * t * t * d  # QKᵀ [T, d] @ [d, T] and AV [T, T] @ [T, d], summed over heads
    macs += t * d * d  # output projection
    macs += 2 * t * d * mlp_hidden_dim  # fc1 and fc2
    return 2.0 * macs


def vit_forward_flops(
    embed_dim: int,
    depth: int,
    num_heads: int,
    mlp_ratio: float,
    num_tokens: int,
    patch_size: int,
    in_chans: int,
    num_prefix_tokens: int = 1,
) -> float:
    """Forward FLOPs per image of a plain ViT (patch projection E + ``depth`` blocks).

    ``num_tokens`` is the number of *patch* tokens N = (H/P)·(W/P); the blocks see N +
    ``num_prefix_tokens`` ([CLS]) tokens. E is a P-stride convolution: N·P²·C·D multiply-adds.
    ``num_heads`` only has to divide ``embed_dim``.

    Example: ViT-S/16 at 224 px, ``vit_forward_flops(384, 12, 6, 4.0, 196, 16, 3) / 2`` = 4.60e9
    MACs (specs §1: 4.61 G).
    """
    if min(embed_dim, depth, num_heads, num_tokens, patch_size, in_chans) < 1 or num_prefix_tokens < 0:
        raise ValueError(
            "embed_dim, depth, num_heads, num_tokens, patch_size and in_chans must be >= 1 "
            f"and num_prefix_tokens >= 0, got {embed_dim}, {depth}, {num_heads}, {num_tokens}, "
            f"{patch_size}, {in_chans}, {num_prefix_tokens}"
        )
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
    patch_embed = 2.0 * num_tokens * patch_size * patch_size * in_chans * embed_dim
    blocks = depth * vit_block_flops(embed_dim, int(embed_dim * mlp_ratio), num_tokens + num_prefix_tokens)
    return patch_embed + blocks


def linear_flops(module: nn.Module) -> float:
    """Forward FLOPs per sample of every linear layer in ``module`` (a head applied to one vector:
    the sum of in·out over its layers, times 2)."""
    macs = 0
    for m in module.modules():
        if isinstance(m, nn.Linear | WeightNormLinear):
            macs += m.in_features * m.out_features
    return 2.0 * macs


def conv2d_flops(conv: nn.Conv2d, img_size: tuple[int, int]) -> float:
    """Forward FLOPs per image of a 2-D convolution on an ``img_size`` input."""
    h, w = _conv_out(conv, img_size)
    k = conv.kernel_size[0] * conv.kernel_size[1] * conv.in_channels // conv.groups
    return 2.0 * h * w * k * conv.out_channels


def backbone_forward_flops(backbone: nn.Module, img_size: int | tuple[int, int], shape_of: ShapeOf | None = None) -> float:
    """Forward FLOPs per image of a backbone from the registry at an input resolution.

    Plain ViTs are counted analytically (:func:`vit_forward_flops`). The ResNet trunk of a hybrid
    and plain ResNets are counted by ``FlopCounterMode`` on the meta device (shapes only, no
    memory, no compute); the hybrid's 1x1 projection and Transformer are then analytic. Any other
    backbone, a subclass of ``VisionTransformer`` included, is counted whole on the meta device. A backbone
    wrapped by FSDP is counted as the module inside; ``shape_of`` gives its parameters' shapes
    before wrapping (:meth:`BaseMethod.shape_before_wrapping`), for the meta-device count.
    """
    size = as_pair(img_size)
    from ssl_vit.backbones.vit import PatchEmbed, VisionTransformer

    backbone = unwrap_module(backbone)

    if type(backbone) is VisionTransformer:  # a subclass may compute more (its own pooling): counted below
        embed = backbone.patch_embed
        d = backbone.embed_dim
        mlp_hidden = backbone.blocks[0].mlp.fc1.out_features if len(backbone.blocks) else 4 * d
        if isinstance(embed, PatchEmbed):
            p = embed.patch_size
            if size[0] % p or size[1] % p:
                raise ValueError(f"image size {size[0]}x{size[1]} is not divisible by the patch size {p}")
            n = (size[0] // p) * (size[1] // p)
            return vit_forward_flops(d, backbone.depth, backbone.num_heads, mlp_hidden / d, n, p, embed.in_chans, backbone.num_prefix_tokens)
        # Hybrid (or any other patch embedding): count the embedding on the meta device.
        embed_flops, out = _meta_forward_flops(embed, (2, backbone.in_chans, *size), shape_of)
        n = out[0].shape[1]
        return embed_flops + backbone.depth * vit_block_flops(d, mlp_hidden, n + backbone.num_prefix_tokens)
    if not hasattr(backbone, "forward_features"):
        raise TypeError(f"backbone_forward_flops needs a backbone from the registry, got {type(backbone).__name__}")
    flops, _ = _meta_forward_flops(backbone, (2, backbone.in_chans, *size), shape_of)
    return flops


def backbone_train_flops(backbone: nn.Module, img_size: int | tuple[int, int], shape_of: ShapeOf | None = None) -> float:
    """Forward + backward FLOPs per image of a trained backbone: 3 x forward, less the first
    layer's input gradient (the image needs none) and, when that layer is frozen (MoCo v3's
    random patch projection), its weight gradient too."""
    size = as_pair(img_size)
    forward = backbone_forward_flops(backbone, size, shape_of)
    stem = _first_conv(unwrap_module(backbone))
    if stem is None:
        return 3.0 * forward
    stem_flops = conv2d_flops(stem, size)
    saved = stem_flops if stem.weight.requires_grad else 2.0 * stem_flops
    return 3.0 * forward - saved


class NoFlopModel(TypeError):
    """A module whose training step has no FLOP model."""


def method_step_flops(
    module: nn.Module,
    views_shapes: Sequence[Shape],
    world_size: int = 1,
    include_probe: bool = True,
) -> float:
    """FLOPs per image of one training step of a pretext module on views of these shapes
    (each ``[B, C, H, W]``; the per-device batch B matters only for MoCo v3's logits).

    - MPP: the backbone trained on one view, the linear head on the corrupted patch tokens.
    - Supervised: the backbone trained on one view, the linear classifier.
    - MoCo v3: 2 views through backbone + projector + predictor (trained), 2 through the momentum
      backbone + projector (forward), and the logits ``q kᵀ`` of ``ctr`` against the keys of all
      ``world_size`` devices (forward + the queries' gradient), twice.
    - DINO: the student trained on every view (backbone + head), the teacher forward on the
      global views, and lightly's loss, whose ``einsum`` over (teacher, student) view pairs is a
      matrix product too (forward + the student's gradient).
    - The online probe, when present and ``include_probe``: forward + its weight gradient (its
      input is detached).
    """
    from ssl_vit.methods import DINO, MPP, MoCoV3, Supervised

    shapes = _check_shapes(views_shapes)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    own = getattr(module, "step_flops", None)  # a method's own count (BaseMethod.step_flops)
    counted = own(shapes, world_size) if callable(own) else None
    if counted is not None:
        total = float(counted)
    elif isinstance(module, MoCoV3 | DINO | MPP | Supervised):
        total = _builtin_step_flops(module, shapes, world_size)
    else:
        raise NoFlopModel(
            f"no FLOP model for {type(module).__name__}: method_step_flops knows MPP, MoCoV3, DINO and Supervised, "
            "and a BaseMethod may count its own in step_flops (or measure with flop_counter())"
        )
    probe = getattr(module, "probe", None)
    if include_probe and probe is not None:
        total += 2.0 * linear_flops(probe)
    return total


def _builtin_step_flops(module: nn.Module, shapes: list[Shape], world_size: int) -> float:
    """FLOPs per image of a built-in method's step, the online probe aside (see
    :func:`method_step_flops`)."""
    from ssl_vit.methods import DINO, MPP, MoCoV3

    batch = shapes[0][0]
    backbone = module.backbone
    shape_of = module.shape_before_wrapping  # (FSDP flattens the parameters)

    if isinstance(module, MoCoV3):
        if len(shapes) != 2:
            raise ValueError(f"MoCo v3 takes two views, got {len(shapes)} shapes")
        proj, pred = linear_flops(module.projector), linear_flops(module.predictor)
        total = 0.0
        for s in shapes:
            total += backbone_train_flops(backbone, s[-2:], shape_of) + 3.0 * (proj + pred)
            total += backbone_forward_flops(module.momentum_backbone, s[-2:], shape_of) + linear_flops(module.momentum_projector)
        # ctr(q, k): logits [B, W·B] = q [B, C] @ k_allᵀ; forward and dL/dq, for both terms.
        ctr = 2.0 * world_size * batch * module.projector.output_dim
        total += 2 * (ctr + ctr)
    elif isinstance(module, DINO):
        g = module.n_global_crops
        if len(shapes) < max(g, 2):
            raise ValueError(f"DINO takes at least {max(g, 2)} views ({g} global first), got {len(shapes)} shapes")
        head, teacher_head = linear_flops(module.head), linear_flops(module.teacher_head)
        total = sum(backbone_train_flops(backbone, s[-2:], shape_of) + 3.0 * head for s in shapes)
        total += sum(backbone_forward_flops(module.teacher_backbone, s[-2:], shape_of) + teacher_head for s in shapes[:g])
        # lightly's DINOLoss: einsum("tbd,sbd->ts") is a [T, B·K] @ [B·K, S] product.
        out_dim = module.head.last_layer.out_features
        total += 2 * (2.0 * g * len(shapes) * out_dim)
    elif isinstance(module, MPP):
        s = shapes[0]
        from ssl_vit.masking import num_corrupted

        n = (s[-2] // backbone.patch_size) * (s[-1] // backbone.patch_size)
        k = num_corrupted(n, module.corruption_ratio)  # the head reads the corrupted tokens only
        total = backbone_train_flops(backbone, s[-2:], shape_of) + 3.0 * k * linear_flops(module.head)
    else:  # Supervised
        total = backbone_train_flops(backbone, shapes[0][-2:], shape_of) + 3.0 * linear_flops(module.classifier)
    return total


# --------------------------------------------------------------------------------------------
# measured counts


def _sdpa_flops(query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, **kwargs: Any) -> int:
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * (d + d_v)  # QKᵀ and AV


def _sdpa_backward_flops(grad_shape: Shape, query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, **kwargs: Any) -> int:
    return 2 * _sdpa_flops(query_shape, key_shape, value_shape)  # dV, dP, dQ, dK: four products


# torch's table covers the CUDA attention kernels only; on CPU F.scaled_dot_product_attention
# dispatches to these two ops, which FlopCounterMode would otherwise count as zero.
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
}


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` (no printout) that also counts the fused CPU attention kernels::

        with flop_counter() as counter:
            loss = model(x).sum(); loss.backward()
        counter.get_total_flops()
    """
    return FlopCounterMode(display=False, custom_mapping=dict(_CPU_ATTENTION))


def _meta_forward_flops(module: nn.Module, input_shape: Shape, shape_of: ShapeOf | None = None) -> tuple[float, Any]:
    """FLOPs per image of ``module(x)`` for an input of this shape, on the meta device (shapes
    only; ``shape_of`` gives each parameter's shape when it differs from the tensor's, as under
    FSDP). Give it two images at least: a module in training mode may need them (BatchNorm on a
    1x1 feature map, e.g. a ResNet at 32 px or less)."""
    shape = shape_of or (lambda t: t.shape)
    state = {n: torch.empty(shape(t), dtype=t.dtype, device="meta") for n, t in module.named_parameters()}
    state |= {n: torch.empty_like(t, device="meta") for n, t in module.named_buffers()}
    x = torch.empty(tuple(input_shape), device="meta")
    with torch.no_grad(), flop_counter() as counter:
        out = torch.func.functional_call(module, state, (x,))
    return float(counter.get_total_flops()) / input_shape[0], out


# --------------------------------------------------------------------------------------------
# cumulative pretraining compute


class PretrainFlops:
    """Running total of pretraining FLOPs, summed over devices.

    Per-image FLOPs are computed once per module and distinct view-shape signature (multi-crop
    and variable-resolution loaders have a handful) and cached.
    """

    def __init__(self) -> None:
        self.total = 0.0
        self._per_image: dict[tuple[Any, ...], float] = {}

    def per_image(self, module: nn.Module, views_shapes: Sequence[Shape], world_size: int = 1) -> float:
        # By the module itself (not its class): a counter reused for another model of the same
        # method (another size) counts that one.
        key = (id(module), world_size, tuple(tuple(int(d) for d in s) for s in views_shapes))
        if key not in self._per_image:
            self._per_image[key] = method_step_flops(module, views_shapes, world_size)
        return self._per_image[key]

    def add(self, module: nn.Module, views: Sequence[Tensor], world_size: int = 1) -> float:
        """Count one training step on ``views`` (this device's batch, on each of ``world_size``
        devices); returns the new total."""
        shapes = [tuple(v.shape) for v in views]
        self.total += self.per_image(module, shapes, world_size) * shapes[0][0] * world_size
        return self.total

    def state_dict(self) -> dict[str, float]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = float(state.get("total", 0.0))


class PretrainFlopsCounter(Callback):
    """Logs the cumulative pretraining FLOPs (``train/pretrain_flops``) after every training batch
    and keeps the total in checkpoints, so results can be placed on an accuracy-vs-compute plot
    (ViT paper Figure 5, specs §6).

    Every batch counts (gradient-accumulation micro-batches too). The total is also set as
    ``pl_module.pretrain_flops``, stored in the checkpoint under ``["ssl_vit"]["pretrain_flops"]``
    when that record exists and under ``["pretrain_flops"]`` in any case (read it back with
    :func:`pretrain_flops_from_checkpoint`), and restored when training resumes.
    """

    def __init__(self, log_name: str = "train/pretrain_flops") -> None:
        super().__init__()
        self.log_name = log_name
        self.flops = PretrainFlops()
        self.unknown = False  # the module has no FLOP model

    @property
    def total(self) -> float:
        return self.flops.total

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.unknown:
            return
        views = batch[0]
        if isinstance(views, Tensor):
            views = [views]
        try:
            total = self.flops.add(pl_module, views, trainer.world_size)
        except NoFlopModel as err:
            # A method without a FLOP model trains all the same; its results lack the compute axis.
            self.unknown = True
            rank_zero_warn(f"{err}; this run records no pretraining FLOPs")
            return
        pl_module.pretrain_flops = total
        # Every rank holds the same global total, so no reduction is needed.
        pl_module.log(self.log_name, total, on_step=True, on_epoch=False, batch_size=int(views[0].shape[0]))

    def state_dict(self) -> dict[str, float]:
        return self.flops.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.flops.load_state_dict(state_dict)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        total = None if self.unknown else self.total
        meta = checkpoint.get("ssl_vit")
        if isinstance(meta, dict):
            meta["pretrain_flops"] = total
        checkpoint["pretrain_flops"] = total

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        total = pretrain_flops_from_checkpoint(checkpoint)
        if total is not None:
            self.flops.total = total
            pl_module.pretrain_flops = total


def pretrain_flops_from_checkpoint(checkpoint: dict[str, Any]) -> float | None:
    """The cumulative pretraining FLOPs recorded in a checkpoint dict, or None."""
    meta = checkpoint.get("ssl_vit")
    value = meta.get("pretrain_flops") if isinstance(meta, dict) else None
    if value is None:
        value = checkpoint.get("pretrain_flops")
    return None if value is None else float(value)


# --------------------------------------------------------------------------------------------
# helpers


def _conv_out(conv: nn.Conv2d, size: tuple[int, int]) -> tuple[int, int]:
    if conv.padding == "same":
        return size
    out = []
    for i in range(2):
        pad = conv.padding[i] if isinstance(conv.padding, tuple) else 0  # "valid": no padding
        k, s, dil = conv.kernel_size[i], conv.stride[i], conv.dilation[i]
        out.append((size[i] + 2 * pad - dil * (k - 1) - 1) // s + 1)
    return out[0], out[1]


def _first_conv(backbone: nn.Module) -> nn.Conv2d | None:
    """The layer that sees the image: the ViT's patch projection, or a ResNet's (or hybrid
    trunk's) stem convolution."""
    embed = getattr(backbone, "patch_embed", None)
    if embed is not None:
        trunk = getattr(embed, "backbone", None)
        return getattr(trunk, "conv1", None) if trunk is not None else getattr(embed, "proj", None)
    return getattr(backbone, "conv1", None)


def _check_shapes(views_shapes: Sequence[Shape]) -> list[tuple[int, ...]]:
    shapes = [tuple(int(d) for d in s) for s in views_shapes]
    if not shapes:
        raise ValueError("method_step_flops needs the shape of at least one view")
    for s in shapes:
        if len(s) != 4:
            raise ValueError(f"every view must be [B, C, H, W], got a shape {s}")
        if s[0] != shapes[0][0]:
            raise ValueError(f"every view must have the same batch size, got shapes {shapes}")
    for s in shapes:
        if not math.prod(s):
            raise ValueError(f"empty view shape {s}")
    return shapes
