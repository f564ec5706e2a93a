"""What training on several processes needs beyond Lightning's DDP / FSDP: BatchNorm over the
global batch (on CPU process groups too), clipping of sharded gradients, parameter names inside
wrappers. FSDP (``use_orig_params=True``) wraps the model before the optimiser is built: each
parameter is then a flat 1-D view of this process's shard, its name carrying the wrappers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

ClipMode = Literal["global", "per_param"]


def unwrapped_name(name: str) -> str:
    """A parameter's name without the parts FSDP, activation checkpointing and torch.compile insert:
    ``backbone.blocks.0._fsdp_wrapped_module.norm1.weight`` -> ``backbone.blocks.0.norm1.weight``."""
    for part in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name


def gradient_shard_group(strategy: Any) -> dist.ProcessGroup | None:
    """The group over which FSDP splits each gradient (for ``HYBRID_SHARD`` the node's); None when
    every process holds whole gradients (one process, DDP, ``NO_SHARD``)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(strategy, FSDPStrategy) or strategy.world_size <= 1 or strategy.sharding_strategy.name == "NO_SHARD":
        return None
    return getattr(strategy.model, "process_group", None) or dist.group.WORLD  # the root FSDP module's group


def clip_gradients(params: Sequence[nn.Parameter], max_norm: float, mode: ClipMode = "global",
                   shard_group: dist.ProcessGroup | None = None) -> Tensor:
    """Scale the gradients of ``params`` in place by ``min(1, max_norm / (norm + 1e-6))`` (as
    ``torch.nn.utils.clip_grad_norm_`` and DINO's ``utils.clip_gradients``), the norm over all of
    them (``global``, the ViT paper's) or each one's (``per_param``, DINO's); returns the norm(s).
    With a ``shard_group`` the squares are summed over its processes, so each applies the whole
    gradient's coefficient: all pass the same parameters in the same order (no gradient counts 0)."""
    grads = [p.grad for p in params]
    if shard_group is None and mode == "global":
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    # Where the norms are summed: the gradients' device (else the parameters': a skipped batch
    # dropped them); NCCL reduces CUDA tensors only, whatever device the gradients live on.
    device = next((g.device for g in grads if g is not None), params[0].device if params else torch.device("cpu"))
    if shard_group is not None and dist.get_backend(shard_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    squares = torch.stack([g.detach().float().pow(2).sum().to(device) if g is not None else torch.zeros((), device=device) for g in grads])
    if shard_group is not None:
        dist.all_reduce(squares, group=shard_group)  # [P]
    norms = squares.sum().sqrt() if mode == "global" else squares.sqrt()  # [] or [P]
    coefs = torch.clamp(max_norm / (norms + 1e-6), max=1.0).expand(len(grads))  # [P]
    for g, c in zip(grads, coefs.unbind()):
        if g is not None:
            g.mul_(c.to(device=g.device, dtype=g.dtype))
    return norms


def convert_sync_batchnorm(module: nn.Module, device_type: str = "cpu") -> nn.Module:
    """Every BatchNorm layer of ``module`` synchronised over the processes, sharing the old layers'
    parameters and buffers: torch's ``nn.SyncBatchNorm`` on the devices it synchronises (CUDA ...),
    :class:`AllReduceBatchNorm` elsewhere (torch's raises on CPU tensors, and DDP refuses a CPU
    module holding one). Returns ``module`` itself unless it is a BatchNorm layer."""
    if isinstance(module, nn.SyncBatchNorm | AllReduceBatchNorm):
        return module
    if device_type in ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name()):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, _BatchNorm):
        new = AllReduceBatchNorm(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var, new.num_batches_tracked = module.running_mean, module.running_var, module.num_batches_tracked
        return new.train(module.training)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device_type))
    return module


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm over the batch of every process, inputs ``[B, C, *]`` on any device; plain
    BatchNorm in eval mode or alone. The statistics are all-reduced with their gradients (the
    backward sums them over the processes, as torch's SyncBatchNorm kernel); arguments, parameters
    and buffers are ``nn.BatchNorm{1,2,3}d``'s."""

    def _check_input_dim(self, input: Tensor) -> None:
        assert input.dim() >= 2, f"expected at least 2-D input [B, C, ...], got {input.dim()}-D"

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not (self.training and dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return super().forward(input)
        x = input.float()  # statistics in float32, as torch's kernels (also under autocast)
        c, dims = x.shape[1], [0, *range(2, x.ndim)]  # every axis but the channels
        shape = [1, c] + [1] * (x.ndim - 2)
        total = _AllReduceSum.apply(torch.cat([x.sum(dims), x.new_tensor([x.numel() // c])]))  # [C + 1]: sums, count
        n = total[c]
        centred = x - (mean := total[:c] / n).view(shape)  # mean: [C]
        var = _AllReduceSum.apply(centred.pow(2).sum(dims)) / n  # [C], biased; two passes, as E[x²] - E[x]² cancels badly
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape)
        if self.bias is not None:  # (BatchNorm(affine=True, bias=False) has none)
            y = y + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), m)  # running <- (1 - m) running + m batch
                self.running_var.lerp_((var * n / (n - 1).clamp(min=1)).to(self.running_var.dtype), m)  # unbiased, as F.batch_norm
        return y.to(input.dtype)


class _AllReduceSum(torch.autograd.Function):
    """A sum over the processes whose gradient is the sum of the processes' gradients
    (``torch.distributed.nn.functional.all_reduce`` without its deprecation)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad
