"""Synchronised BatchNorm on every device, CPU process groups (gloo) included.

MoCo v3 normalises the BatchNorm layers of its heads over the *global* batch (reference
``main_moco.py``: "apply SyncBN", the whole model is converted), and so does DINO when its model has
BatchNorm (``main_dino.py``: ``has_batchnorms`` -> ``convert_sync_batchnorm``). Without it each
device normalises with its own few samples and the result depends on how the batch is split.

torch's ``nn.SyncBatchNorm`` only synchronises CUDA/XPU/HPU tensors: it raises on CPU, and
``DistributedDataParallel`` refuses a CPU module that contains one. That rules out CPU clusters and
the CPU (gloo) tests that prove the distributed code paths. :func:`convert_sync_batchnorm` therefore
uses torch's layer (and its fused kernels) on the devices it supports, and elsewhere
:class:`AllReduceBatchNorm`, which computes the global mean and variance with autograd-aware
all-reduces, so that the backward pass sums the gradient of the batch statistics over all
processes exactly as torch's kernel does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

# Devices whose tensors torch's own SyncBatchNorm synchronises.
NATIVE_SYNC_BN_DEVICES = ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes with a gradient: the gradient of a sum taken on every process is the
    sum of the gradients. (``torch.distributed.nn.functional.all_reduce`` does this but is
    deprecated; its replacement lives in a private module.)"""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm over the batch of all processes of ``process_group`` (default: all), for inputs
    ``[B, C, *]`` on any device; plain BatchNorm in eval mode or outside a process group.

    Same parameters and buffers as ``nn.BatchNorm{1,2,3}d``, so checkpoints load either way.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None, bias: bool = True) -> None:
        # (``bias=False``, an affine BN without shift, exists only in recent torch versions.)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **({} if bias else {"bias": False}))
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input [B, C, ...], got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        distributed = self.training and dist.is_available() and dist.is_initialized()
        group = (self.process_group or dist.group.WORLD) if distributed else None
        if group is None or dist.get_world_size(group) == 1:
            return super().forward(input)
        x = input.float()  # statistics in float32, as torch's kernels keep them (also under autocast)
        c = x.shape[1]
        dims = [0, *range(2, x.ndim)]  # every axis but the channels
        shape = [1, c] + [1] * (x.ndim - 2)
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() // c])])  # [C + 1]: sums, count
        total = _AllReduceSum.apply(local, group)  # [C + 1] over all processes
        n = total[c]
        mean = total[:c] / n  # [C]
        centred = x - mean.view(shape)
        # Two passes (mean, then squared deviations) rather than E[x^2] - E[x]^2, which cancels badly.
        var = _AllReduceSum.apply(centred.pow(2).sum(dims), group) / n  # [C], biased
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape)
        if self.bias is not None:
            y = y + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                # running <- (1 - m) running + m batch, with the unbiased variance (as F.batch_norm)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), m)
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), m)
        return y.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, device_type: str = "cpu") -> nn.Module:
    """Every BatchNorm layer of ``module`` synchronised over processes, for training on
    ``device_type``: torch's ``nn.SyncBatchNorm`` where it works, :class:`AllReduceBatchNorm`
    elsewhere. Parameters and buffers are shared with the old layers, synchronised layers are left
    as they are; returns ``module`` itself unless it is a BatchNorm layer."""
    if isinstance(module, nn.SyncBatchNorm | AllReduceBatchNorm):
        return module
    if isinstance(module, _BatchNorm):
        if device_type in NATIVE_SYNC_BN_DEVICES:
            return nn.SyncBatchNorm.convert_sync_batchnorm(module)
        new = AllReduceBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats, bias=module.bias is not None or not module.affine)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        if module.track_running_stats:
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device_type))
    return module
