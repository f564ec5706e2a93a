"""Adam/AdamW state for parameters that have not had a gradient yet.

PyTorch's Adam creates a parameter's state (step, first and second moments) lazily, at the first
step in which the parameter has a gradient. Parameters that skip steps on purpose (DINO's last
layer, frozen in the first epoch by setting its gradient to ``None`` as the reference does; every
parameter of a batch skipped by the non-finite policy) therefore have no state for a while, and
FSDP's optimizer state dict cannot be gathered then ("... is not in the optimizer state"), so no
checkpoint can be written.

:func:`materialize_adam_state` creates exactly the state Adam would create lazily (step 0, zero
moments). Adam's first real step then finds step 0 and proceeds as if it had made the state
itself, so the numbers do not change (``tests/test_training_optimizer_state.py`` checks this
against an optimizer that was left alone).
"""

from __future__ import annotations

import torch


def materialize_adam_state(optimizer: torch.optim.Optimizer) -> int:
    """Give every parameter of an ``Adam``/``AdamW`` that has no state the state Adam would
    create at its first gradient; returns how many were filled (0 for other optimizers)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return 0
    filled = 0
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            if p in optimizer.state and len(optimizer.state[p]) > 0:
                continue
            # As torch.optim.Adam._init_group: the step counter lives on the CPU (in the default
            # float dtype) unless the optimizer is capturable or fused.
            if on_device:
                dtype = torch.float32 if group.get("fused") else _scalar_dtype()
                step = torch.zeros((), dtype=dtype, device=p.device)
            else:
                step = torch.tensor(0.0, dtype=_scalar_dtype())
            state = {
                "step": step,
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
            filled += 1
    return filled


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
