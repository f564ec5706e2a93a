"""The Vision Transformer of Dosovitskiy et al. 2021 ("An Image is Worth 16x16 Words"), §3.1.

image -> patches -> linear projection E -> prepend [CLS] -> + learnable 1-D position embedding
-> L pre-norm blocks (LN -> MHSA -> residual; LN -> GELU MLP -> residual) -> final LN.

Parameter names are timm's ``VisionTransformer`` names (``cls_token``, ``pos_embed``,
``patch_embed.proj``, ``blocks.{i}.norm1``, ``blocks.{i}.attn.qkv``, ...), so a state dict of this
model loads into the timm model of the same shape with ``strict=True`` and computes the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torchvision.ops import StochasticDepth

from ssl_vit.backbones.lean import gelu_linear, norm_linear
from ssl_vit.backbones.pos_embed import resample_pos_embed, sincos_2d_pos_embed

PatchHook = Callable[[Tensor], Tensor]
"""Maps the patch embeddings ``[B, N, D]`` (after E, before the position embedding) to
replacements of the same shape: how masked patch prediction corrupts its input (ViT paper B.1.2)."""


def patch_grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """The token grid of an image; where an image size the patch does not divide is refused."""
    if height % patch_size or width % patch_size:
        raise ValueError(f"image size {height}x{width} is not divisible by the patch size {patch_size}")
    return height // patch_size, width // patch_size


def check_image(x: Tensor, in_chans: int, what: str) -> None:
    """Clear errors for the mistakes users make most: not a batch of images, the wrong channels."""
    if x.ndim != 4:
        raise ValueError(f"{what} expects images [B, C, H, W], got a tensor of shape {tuple(x.shape)}")
    if x.shape[1] != in_chans:
        hint = {(1, 3): " (the backbone takes RGB images: set the data's in_chans to 3, which repeats grey ones)",
                (3, 1): " (the backbone takes grey images: set the data's in_chans to 1)"}.get((x.shape[1], in_chans), "")
        raise ValueError(f"{what} was built for {in_chans} input channels, got {x.shape[1]}{hint}")


class PatchEmbed(nn.Module):
    """Non-overlapping P×P patches, each linearly projected (E is a P-stride convolution)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size, self.in_chans = patch_size, in_chans
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """``[B, C, H, W]`` -> patch embeddings ``[B, N, D]`` and their grid ``(H/P, W/P)``."""
        check_image(x, self.in_chans, "ViT")
        grid = patch_grid(x.shape[-2], x.shape[-1], self.patch_size)
        return rearrange(self.proj(x), "b d h w -> b (h w) d"), grid


class Attention(nn.Module):
    """Multi-head self-attention. The hot path is ``F.scaled_dot_product_attention`` (fused
    kernels); ``return_attention=True`` takes the explicit softmax(QKᵀ/√d) path and returns the
    weights, which the analysis figures need."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attn_drop: float, proj_drop: float, lean_backward: bool) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.attn_drop, self.lean_backward = num_heads, attn_drop, lean_backward
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, norm: nn.LayerNorm, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        """``norm(x)`` ``[B, N, D]`` attended -> ``(output [B, N, D], weights [B, H, N, N] or None)``."""
        qkv = norm_linear(x, norm, self.qkv) if self.lean_backward else self.qkv(norm(x))  # [B, N, 3D]
        # Unbind before transposing (timm permutes first): the backward pass then stacks dq, dk,
        # dv straight into the [B, N, 3, H, d] layout of the QKV output, one copy instead of two.
        q, k, v = (t.transpose(1, 2) for t in qkv.unflatten(-1, (3, self.num_heads, -1)).unbind(2))  # each [B, H, N, d]
        drop = self.attn_drop if self.training else 0.0
        attn = None
        if return_attention:
            attn = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)  # [B, H, N, N]
            out = F.dropout(attn, drop) @ v  # [B, H, N, d]
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)  # [B, H, N, d]
        return self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)"))), attn


class Mlp(nn.Module):
    """Two linear layers with a GELU between (ViT paper eq. 3)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float, lean_backward: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden_dim), nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)
        self.lean_backward = lean_backward

    def forward(self, x: Tensor, norm: nn.LayerNorm) -> Tensor:
        """``norm(x)`` ``[B, N, D]`` -> ``[B, N, D]``."""
        h = norm_linear(x, norm, self.fc1) if self.lean_backward else self.fc1(norm(x))  # [B, N, hidden]
        if self.lean_backward and self.drop.p == 0.0:
            return gelu_linear(h, self.fc2)
        return self.drop(self.fc2(self.drop(F.gelu(h))))


class Block(nn.Module):
    """Pre-norm Transformer block (ViT paper eqs. 2-3) with stochastic depth on both branches.
    Each LayerNorm goes to the module it feeds, which with ``lean_backward`` runs it inside its
    first projection (``norm_linear``)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, drop: float, attn_drop: float, drop_path: float,
                 lean_backward: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, lean_backward)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop, lean_backward)
        # "row" drops the whole residual branch per sample (Huang et al. 2016, as in DeiT/timm).
        self.drop_path = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        y, attn = self.attn(x, self.norm1, return_attention)
        x = x + self.drop_path(y)
        return x + self.drop_path(self.mlp(x, self.norm2)), attn


class VisionTransformer(nn.Module):
    """ViT backbone (no classifier). See the module docstring for the architecture.

    Args:
        img_size: training resolution; other resolutions work too (the position embedding is
            resampled on the fly, bicubic), as long as the patch size divides them.
        patch_size: P; the sequence has (H/P)·(W/P) patch tokens.
        in_chans: input channels (1 for grey images, 3 for RGB).
        embed_dim, depth, num_heads, mlp_ratio: width D, layers L, heads, MLP width / D.
        qkv_bias: bias in the QKV projection (ViT and timm: True).
        drop_rate, attn_drop_rate: dropout after projections / on attention weights.
        drop_path_rate: stochastic depth, increasing linearly with depth up to this value.
        pos_embed: ``"learn"``: learnable 1-D (the ViT paper's; its Appendix D.4 found 2-D no better);
            ``"sincos"``: the fixed 2-D table of MoCo v3 §4.2, a frozen parameter in timm's layout.
        global_pool: ``"token"``: the [CLS] output is the representation (ViT paper §3.1);
            ``"avg"``: mean of the patch tokens after the final LayerNorm.
        patch_embed: the hybrid's ResNet in place of the P×P projection: images to ``([B, N, D],
            grid)``, with ``patch_size`` (pixels per token) and ``in_chans``.
        lean_backward: in training, run ``norm_linear`` and ``gelu_linear`` (``lean.py``): the same
            function and gradients with an eighth less activation memory. ``False`` runs the plain
            modules (two autograd nodes fewer per block, which a launch-bound GPU may prefer) and
            is needed for a second derivative: the lean backward passes are first-order only.
    """

    num_prefix_tokens = 1

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768, depth: int = 12,
                 num_heads: int = 12, mlp_ratio: float = 4.0, qkv_bias: bool = True, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, pos_embed: Literal["learn", "sincos"] = "learn", global_pool: Literal["token", "avg"] = "token",
                 patch_embed: nn.Module | None = None, lean_backward: bool = True) -> None:
        super().__init__()
        self.patch_embed = patch_embed if patch_embed is not None else PatchEmbed(patch_size, in_chans, embed_dim)
        self.in_chans, self.patch_size = self.patch_embed.in_chans, self.patch_embed.patch_size  # pixels per token
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
        self.grid_size = patch_grid(*self.img_size, self.patch_size)
        self.embed_dim, self.depth, self.num_heads = embed_dim, depth, num_heads
        self.pos_embed_type, self.global_pool = pos_embed, global_pool
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid_size[0] * self.grid_size[1], embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # DeiT/timm: linspace(0, rate, depth)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, r, lean_backward) for r in rates)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.grad_checkpointing = False
        self.init_weights()

    def init_weights(self) -> None:
        """timm's ViT initialisation: truncated-normal(0.02) for Linear weights and the learnable
        position embedding, N(0, 1e-6) for [CLS], zero biases; the patch projection keeps
        PyTorch's default conv init."""
        if self.pos_embed_type == "sincos":
            self.pos_embed.data.copy_(sincos_2d_pos_embed(self.embed_dim, self.grid_size))
            self.pos_embed.requires_grad_(False)
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.blocks.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names timm excludes from weight decay (its optimizer factory; MAE fine-tuning)."""
        return {"pos_embed", "cls_token"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in the backward pass: less memory, ~30 % more compute."""
        self.grad_checkpointing = enable

    @torch.no_grad()
    def set_img_size(self, img_size: int | tuple[int, int]) -> None:
        """Move to another resolution for good (fine-tuning at higher resolution, ViT paper
        §3.2): the position embedding is resampled bicubically to the new grid."""
        size = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
        grid = patch_grid(*size, self.patch_size)
        self.pos_embed = nn.Parameter(self._pos_embed_for(grid).detach().clone(), requires_grad=self.pos_embed.requires_grad)
        self.img_size, self.grid_size = size, grid
        self._record_kwarg("img_size", size[0] if size[0] == size[1] else list(size))

    def make_pos_embed_learnable(self) -> None:
        """Turn a fixed sin-cos table into a learned position embedding that starts from it
        (fine-tuning: MAE's and MoCo v3's fine-tuning code load the table into timm's learnable
        ``pos_embed``); from then on other resolutions resample it as any learned one."""
        if self.pos_embed_type == "sincos":
            self.pos_embed_type = "learn"
            self.pos_embed.requires_grad_(True)
            self._record_kwarg("pos_embed", "learn")

    def _record_kwarg(self, name: str, value: Any) -> None:
        """Keep the kwargs ``create_backbone`` recorded (export and resume rebuild the backbone
        from them) in step with a change made after construction."""
        if isinstance(getattr(self, "backbone_kwargs", None), dict):
            self.backbone_kwargs[name] = value

    def _pos_embed_for(self, grid: tuple[int, int]) -> Tensor:
        """The position embedding ``[1, 1+N, D]`` of a grid: the table itself, the sin-cos
        formula's, or the learned one resampled (DINO's local crops, evaluation at another size)."""
        if grid == self.grid_size:
            return self.pos_embed
        if self.pos_embed_type == "sincos":
            return sincos_2d_pos_embed(self.embed_dim, grid).to(self.pos_embed)
        return resample_pos_embed(self.pos_embed, grid, self.grid_size)

    def prepare_tokens(self, x: Tensor, patch_hook: PatchHook | None = None) -> Tensor:
        """Images ``[B, C, H, W]`` -> input sequence ``[B, 1+N, D]`` of the first block;
        ``patch_hook`` sees the patch embeddings before the position embedding is added."""
        tokens, grid = self.patch_embed(x)  # [B, N, D]
        if patch_hook is not None:
            tokens = patch_hook(tokens)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)  # [B, 1, D]
        return self.pos_drop(torch.cat([cls, tokens], dim=1) + self._pos_embed_for(grid))  # [B, 1+N, D]

    def _run_blocks(self, x: Tensor, return_attention: bool = False, keep: Sequence[int] = ()) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Tokens through every block -> (last output, attention weights, outputs of blocks ``keep``)."""
        attns, kept = [], []
        for i, blk in enumerate(self.blocks):
            if self.grad_checkpointing and self.training and not return_attention and torch.is_grad_enabled():
                x, attn = checkpoint(blk, x, use_reentrant=False)
            else:
                x, attn = blk(x, return_attention)
            if attn is not None:
                attns.append(attn)
            if i in keep:
                kept.append(x)
        return x, attns, kept

    def forward_features(self, x: Tensor, patch_hook: PatchHook | None = None) -> Tensor:
        """``[B, C, H, W]`` -> tokens after the final LayerNorm ``[B, 1+N, D]`` (as timm)."""
        return self.norm(self._run_blocks(self.prepare_tokens(x, patch_hook))[0])

    def pool(self, tokens: Tensor) -> Tensor:
        """Tokens ``[B, 1+N, D]`` -> representation ``[B, D]``."""
        return tokens[:, 1:].mean(dim=1) if self.global_pool == "avg" else tokens[:, 0]

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> pooled representation ``[B, D]`` ([CLS] by default)."""
        return self.pool(self.forward_features(x))

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1, norm: bool = True) -> list[Tensor]:
        """Outputs ``[B, 1+N, D]`` of the last ``n`` blocks (or of the blocks whose indices are
        given), optionally through the final LayerNorm: DINO's linear protocol concatenates the
        [CLS] of the last 4. Unlike timm's method of this name, [CLS] is kept and the norm applied
        by default (DINO's convention)."""
        keep = list(range(self.depth - n, self.depth)) if isinstance(n, int) else list(n)
        if not keep or not all(0 <= i < self.depth for i in keep):
            raise ValueError(f"n={n}: blocks {keep} are out of range for a backbone of depth {self.depth} (the last 1..{self.depth}, or indices)")
        kept = self._run_blocks(self.prepare_tokens(x), keep=keep)[2]
        return [self.norm(t) if norm else t for t in kept]

    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        """Attention weights of every layer: ``depth`` tensors ``[B, heads, 1+N, 1+N]`` (rows
        are queries and sum to 1); the last is DINO's ``get_last_selfattention``."""
        return self._run_blocks(self.prepare_tokens(x), return_attention=True)[1]
