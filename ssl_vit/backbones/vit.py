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
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torchvision.ops import StochasticDepth

from ssl_vit.backbones.gelu_linear import gelu_linear
from ssl_vit.backbones.norm_linear import norm_linear
from ssl_vit.backbones.pos_embed import resample_pos_embed, sincos_2d_pos_embed

PatchHook = Callable[[Tensor], Tensor]
"""Maps the patch embeddings ``[B, N, D]`` (after E, before the position embedding) to
replacements of the same shape: how masked patch prediction corrupts its input (ViT paper B.1.2)."""


def as_pair(x: int | Sequence[int], what: str = "a size") -> tuple[int, int]:
    """An image or grid size as ``(h, w)``."""
    if isinstance(x, int) and not isinstance(x, bool):
        return (x, x)
    if isinstance(x, str) or not isinstance(x, Sequence) or len(x) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise ValueError(f"{what} must be an integer or a pair of integers (height, width), got {x!r}")
    return (int(x[0]), int(x[1]))


def check_image(x: Tensor, in_chans: int, stride: int, what: str) -> None:
    """Clear errors for the mistakes users make most: wrong rank, channels or size."""
    if x.ndim != 4:
        raise ValueError(f"{what} expects images [B, C, H, W], got a tensor of shape {tuple(x.shape)}")
    if x.shape[1] != in_chans:
        got = x.shape[1]
        hint = ""
        if (got, in_chans) == (1, 3):
            hint = " (the backbone takes RGB images: set the data's in_chans to 3, which repeats grey ones)"
        elif (got, in_chans) == (3, 1):
            hint = " (the backbone takes grey images: set the data's in_chans to 1)"
        raise ValueError(f"{what} was built for {in_chans} input channels, got {got}{hint}")
    h, w = x.shape[-2:]
    if h % stride or w % stride:
        raise ValueError(f"{what}: image size {h}x{w} is not divisible by the patch size {stride}")


class PatchEmbed(nn.Module):
    """Non-overlapping P×P patches, each linearly projected (a P-stride convolution is E)."""

    def __init__(self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        if img_size[0] % patch_size or img_size[1] % patch_size:
            raise ValueError(
                f"image size {img_size[0]}x{img_size[1]} is not divisible by the patch size {patch_size}"
            )
        self.img_size = img_size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.grid_size = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        check_image(x, self.in_chans, self.patch_size, "ViT")
        x = self.proj(x)  # [B, D, h, w]
        grid = (x.shape[-2], x.shape[-1])
        return x.flatten(2).transpose(1, 2), grid  # [B, N, D], (h, w)


class Attention(nn.Module):
    """Multi-head self-attention. The hot path is ``F.scaled_dot_product_attention`` (fused
    kernels); ``return_attention=True`` takes the explicit softmax(QKᵀ/√d) path and returns the
    weights, which the analysis figures need."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, return_attention: bool = False, norm: nn.LayerNorm | None = None) -> tuple[Tensor, Tensor | None]:
        """``x [B, N, C]`` -> ``(output [B, N, C], weights [B, H, N, N] or None)``; with ``norm``,
        ``x`` is normalised first (in one step with the QKV projection, see ``norm_linear``)."""
        B, N, C = x.shape
        qkv = norm_linear(x, norm, self.qkv) if norm is not None else self.qkv(x)  # [B, N, 3C]
        qkv = qkv.reshape(B, N, 3, self.num_heads, self.head_dim)  # [B, N, 3, H, d]
        # Unbind before transposing (timm permutes first): the backward pass then stacks dq, dk,
        # dv straight into the [B, N, 3, H, d] layout of the QKV output, one copy instead of two.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each [B, H, N, d]
        drop = self.attn_drop if self.training else 0.0
        attn = None
        if return_attention:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # [B, H, N, N]
            attn = attn.softmax(dim=-1)
            out = F.dropout(attn, drop) @ v  # [B, H, N, d]
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop)  # [B, H, N, d]
        out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out)), attn


class Mlp(nn.Module):
    """Two linear layers with a GELU between (ViT paper eq. 3)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, lean_backward: bool = True) -> None:
        super().__init__()
        self.lean_backward = lean_backward
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor, norm: nn.LayerNorm | None = None) -> Tensor:
        """``[B, N, D]`` -> ``[B, N, D]``; with ``norm``, ``x`` is normalised first (see ``norm_linear``)."""
        h = norm_linear(x, norm, self.fc1) if norm is not None else self.fc1(x)  # [B, N, hidden]
        if self.lean_backward and self.drop1.p == 0.0 and type(self.act) is nn.GELU and self.act.approximate == "none":
            return self.drop2(gelu_linear(h, self.fc2))  # the same function, leaner backward
        return self.drop2(self.fc2(self.drop1(self.act(h))))


class Block(nn.Module):
    """Pre-norm Transformer block (ViT paper eqs. 2-3) with stochastic depth on both branches."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        qkv_bias: bool,
        drop: float,
        attn_drop: float,
        drop_path: float,
        lean_backward: bool = True,
    ) -> None:
        super().__init__()
        self.lean_backward = lean_backward
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop, lean_backward=lean_backward)
        # "row" mode drops the whole residual branch per sample (Huang et al. 2016, as in DeiT/timm).
        self.drop_path = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        # LN -> MHSA -> residual; LN -> MLP -> residual. With lean_backward each LN runs inside the
        # projection after it (norm_linear: the same values, less kept for the backward pass).
        if self.lean_backward:
            y, attn = self.attn(x, return_attention, norm=self.norm1)
            x = x + self.drop_path(y)
            return x + self.drop_path(self.mlp(x, norm=self.norm2)), attn
        y, attn = self.attn(self.norm1(x), return_attention)
        x = x + self.drop_path(y)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x, attn


class VisionTransformer(nn.Module):
    """ViT backbone (no classifier). See the module docstring for the architecture.

    Args:
        img_size: training resolution; other resolutions work too (the position embedding is
            resampled on the fly, bicubic), as long as they are divisible by the patch size.
        patch_size: P; the sequence has (H/P)·(W/P) patch tokens.
        in_chans: input channels (1 for grey images, 3 for RGB).
        embed_dim, depth, num_heads, mlp_ratio: width D, layers L, heads, MLP width / D.
        qkv_bias: bias in the QKV projection (ViT and timm: True).
        drop_rate, attn_drop_rate: dropout after projections / on attention weights.
        drop_path_rate: stochastic depth, increasing linearly with depth up to this value.
        pos_embed: ``"learn"``: learnable 1-D embedding (ViT paper default, Appendix D.4 found
            2-D variants no better); ``"sincos"``: fixed 2-D sin-cos table (MoCo v3 §4.2), kept as
            a frozen parameter so state dicts keep timm's layout.
        global_pool: ``"token"``: the [CLS] output is the representation (ViT paper §3.1);
            ``"avg"``: mean of the patch tokens after the final LayerNorm.
        patch_embed: a replacement for the P×P patch projection that maps images to
            ``([B, N, D], (h, w))``, e.g. the ResNet stem of the hybrid (ViT paper §3.1 "Hybrid").
        lean_backward: in training, compute each LayerNorm inside the projection after it and
            recompute it in the backward pass (``norm_linear``: an eighth less activation memory,
            about 1 % more compute), and give GELU's backward fc2's gradient buffer
            (``gelu_linear``). The same function and gradients either way (a bf16 input on a CPU
            aside, whose LayerNorm gradients this sums in fp32 as on CUDA); ``False`` runs the plain
            modules (two autograd nodes fewer per block in Python, which a launch-bound GPU run
            with a small model may prefer) and is needed for a second derivative (gradient
            penalties, ``create_graph=True``): the fused backward passes are first-order only.
    """

    num_prefix_tokens = 1

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        pos_embed: Literal["learn", "sincos"] = "learn",
        global_pool: Literal["token", "avg"] = "token",
        patch_embed: nn.Module | None = None,
        lean_backward: bool = True,
    ) -> None:
        super().__init__()
        if pos_embed not in ("learn", "sincos"):
            raise ValueError(f"pos_embed must be 'learn' or 'sincos', got {pos_embed!r}")
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must be in [0, 1), got {drop_path_rate}")
        for name, value in (("patch_size", patch_size), ("in_chans", in_chans), ("embed_dim", embed_dim), ("depth", depth), ("num_heads", num_heads)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {mlp_ratio}")
        self.embed_dim = embed_dim
        self.num_features = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.pos_embed_type = pos_embed
        self.global_pool = global_pool
        self.patch_embed = patch_embed if patch_embed is not None else PatchEmbed(as_pair(img_size, "img_size"), patch_size, in_chans, embed_dim)
        self.img_size = self.patch_embed.img_size
        self.in_chans = self.patch_embed.in_chans
        self.patch_size = self.patch_embed.patch_size  # the stride of one token, in input pixels
        self.grid_size = self.patch_embed.grid_size
        num_patches = self.grid_size[0] * self.grid_size[1]

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + num_patches, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        # stochastic depth grows linearly with depth (as torch.linspace(0, rate, depth) in DeiT/timm)
        dpr = [drop_path_rate * i / (depth - 1) if depth > 1 else 0.0 for i in range(depth)]
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, dpr[i], lean_backward) for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.grad_checkpointing = False
        self.init_weights()

    # ------------------------------------------------------------------ init
    def init_weights(self) -> None:
        """timm's default ViT initialisation: truncated-normal(0.02) for Linear weights and the
        learnable position embedding, N(0, 1e-6) for [CLS], zero biases; the patch projection keeps
        PyTorch's default conv init."""
        if self.pos_embed_type == "sincos":
            self.pos_embed.data.copy_(sincos_2d_pos_embed(self.embed_dim, self.grid_size, self.num_prefix_tokens))
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
        """Permanently move to another resolution (fine-tuning at higher resolution, ViT paper
        §3.2): the position embedding is resampled bicubically to the new grid."""
        img_size = as_pair(img_size, "img_size")
        stride = self.patch_size
        if img_size[0] % stride or img_size[1] % stride:
            raise ValueError(f"image size {img_size[0]}x{img_size[1]} is not divisible by the patch size {stride}")
        new_grid = (img_size[0] // stride, img_size[1] // stride)
        if self.pos_embed_type == "sincos":
            new = sincos_2d_pos_embed(self.embed_dim, new_grid, self.num_prefix_tokens)
        else:
            new = resample_pos_embed(self.pos_embed.data, new_grid, self.grid_size, self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(new.to(self.pos_embed), requires_grad=self.pos_embed.requires_grad)
        self.img_size = img_size
        self.grid_size = new_grid
        self.patch_embed.img_size = img_size
        self.patch_embed.grid_size = new_grid
        self._record_kwarg("img_size", img_size[0] if img_size[0] == img_size[1] else list(img_size))

    def make_pos_embed_learnable(self) -> None:
        """Turn a fixed sin-cos table into a learned position embedding that starts from it
        (fine-tuning: MAE's and MoCo v3's fine-tuning code load the table into timm's learnable
        ``pos_embed``); from then on other resolutions resample it as any learned one."""
        if self.pos_embed_type != "sincos":
            return
        self.pos_embed_type = "learn"
        self.pos_embed.requires_grad_(True)
        self._record_kwarg("pos_embed", "learn")

    def _record_kwarg(self, name: str, value: Any) -> None:
        """Keep the kwargs record ``create_backbone`` attaches (export and resume rebuild the
        backbone from it) in step with a change made after construction."""
        kwargs = getattr(self, "backbone_kwargs", None)
        if isinstance(kwargs, dict):
            kwargs[name] = value

    # --------------------------------------------------------------- forward
    def _pos_embed_for(self, grid: tuple[int, int]) -> Tensor:
        if grid == self.grid_size:
            return self.pos_embed
        if self.pos_embed_type == "sincos":
            return sincos_2d_pos_embed(self.embed_dim, grid, self.num_prefix_tokens).to(self.pos_embed)
        # Other resolutions (DINO's local crops, evaluation at another size): resample on the fly.
        return resample_pos_embed(self.pos_embed, grid, self.grid_size, self.num_prefix_tokens)

    def prepare_tokens(self, x: Tensor, patch_hook: PatchHook | None = None) -> Tensor:
        """Images ``[B, C, H, W]`` -> input sequence ``[B, 1+N, D]`` of the first block.

        ``patch_hook`` sees the patch embeddings after E and before the position embedding is
        added, where masked patch prediction replaces tokens (ViT paper B.1.2)."""
        tokens, grid = self.patch_embed(x)  # [B, N, D]
        if patch_hook is not None:
            tokens = patch_hook(tokens)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)  # [B, 1, D]
        x = torch.cat([cls, tokens], dim=1) + self._pos_embed_for(grid)  # [B, 1+N, D]
        return self.pos_drop(x)

    def _run_blocks(
        self, x: Tensor, return_attention: bool = False, keep: Sequence[int] = ()
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        attns: list[Tensor] = []
        kept: list[Tensor] = []
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
        x, _, _ = self._run_blocks(self.prepare_tokens(x, patch_hook))
        return self.norm(x)

    def pool(self, tokens: Tensor) -> Tensor:
        """Tokens ``[B, 1+N, D]`` -> representation ``[B, D]``."""
        if self.global_pool == "avg":
            return tokens[:, self.num_prefix_tokens :].mean(dim=1)
        return tokens[:, 0]

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C, H, W]`` -> pooled representation ``[B, D]`` ([CLS] by default)."""
        return self.pool(self.forward_features(x))

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1, norm: bool = True) -> list[Tensor]:
        """Outputs of the last ``n`` blocks (or of the blocks whose indices are given), each
        ``[B, 1+N, D]``, optionally passed through the final LayerNorm (DINO's linear protocol
        concatenates the [CLS] of the last 4 of these). Unlike timm's method of this name, the
        [CLS] token is kept and the norm applied by default (DINO's convention)."""
        if isinstance(n, int):
            if not 1 <= n <= self.depth:
                raise ValueError(f"n={n}: the last n blocks of a backbone of depth {self.depth} need n in 1..{self.depth}")
            keep = list(range(self.depth - n, self.depth))
        else:
            keep = list(n)
            if not keep or any(not 0 <= i < self.depth for i in keep):
                raise ValueError(f"block indices {keep} out of range for depth {self.depth} (0..{self.depth - 1})")
        _, _, kept = self._run_blocks(self.prepare_tokens(x), keep=keep)
        return [self.norm(t) if norm else t for t in kept]

    def get_attention_maps(self, x: Tensor) -> list[Tensor]:
        """Attention weights of every layer and head: a list of ``depth`` tensors
        ``[B, heads, 1+N, 1+N]`` (rows are queries and sum to 1)."""
        _, attns, _ = self._run_blocks(self.prepare_tokens(x), return_attention=True)
        return attns

    def get_last_selfattention(self, x: Tensor) -> Tensor:
        """The last layer's attention ``[B, heads, 1+N, 1+N]`` (DINO's attention figures)."""
        return self.get_attention_maps(x)[-1]
