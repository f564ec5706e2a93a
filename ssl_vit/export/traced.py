"""TorchScript, ``torch.export`` and ONNX copies of a backbone, each checked against the eager model
right after it is written. They are traced at the export's image size with the batch dimension
free (ONNX: a dynamic ``batch`` axis), and checked at another batch size than the trace's."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from ssl_vit.io import writing

FILES = {"torchscript": "model.torchscript.pt", "export": "model.pt2", "onnx": "model.onnx"}
_LABELS = {"torchscript": "TorchScript", "export": "torch.export", "onnx": "ONNX"}
_ONNX_INLINE_LIMIT = 1_800_000_000  # bytes a protobuf can hold; above, ONNX stores the weights in model.onnx.data


class ExportParityError(RuntimeError):
    """An exported file computes something else than the eager backbone."""


def example_input(model: nn.Module, batch: int, seed: int = 0) -> Tensor:
    """Random images ``[batch, C, H, W]`` at the backbone's size (seeded: reproducible reports)."""
    h, w = model.img_size
    return torch.randn(batch, model.in_chans, h, w, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def check_parity(run: Callable[[Tensor], Tensor], model: nn.Module, what: str, tolerance: float) -> float:
    """Max absolute difference between ``run(x)`` and ``model(x)`` on 3 images (the traces' batch
    size is 2: a trace that baked it in fails); raises above ``tolerance``."""
    x = example_input(model, 3, seed=1)
    expected, got = model(x), run(x)
    if got.shape != expected.shape:
        raise ExportParityError(f"{what}: output shape {tuple(got.shape)} differs from the eager backbone's {tuple(expected.shape)}")
    diff = float((got.float() - expected.float()).abs().max())
    if not diff <= tolerance:  # (NaN too)
        raise ExportParityError(f"{what}: outputs differ from the eager backbone by {diff:.3g} (max abs) > tolerance {tolerance:g}; "
                                "the file was not written")
    return diff


class _SizeChecked(nn.Module):
    """A traced backbone behind a check of the input's size: tracing drops the model's own checks,
    and a traced ViT would silently crop an image larger than its trace's."""

    def __init__(self, traced: nn.Module, size: list[int]) -> None:
        super().__init__()
        self.traced, self.size = traced, size  # [C, H, W]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1:] != self.size:
            raise RuntimeError(f"this TorchScript backbone takes images [batch, {self.size[0]}, {self.size[1]}, {self.size[2]}] "
                               f"(traced at that size), got {x.shape}")
        return self.traced(x)


def _torchscript(model: nn.Module, path: Path, opset: int | None) -> Callable[[Tensor], Tensor]:
    traced = torch.jit.trace(model, example_input(model, 2), check_trace=False)
    scripted = torch.jit.script(_SizeChecked(traced, [int(model.in_chans), *map(int, model.img_size)]))
    with writing(path), open(path, "wb") as f:  # a Python file: a full disk is an OSError, not a C++ abort
        torch.jit.save(scripted, f)
    return torch.jit.load(str(path), map_location="cpu")


def _exported(model: nn.Module, path: Path, opset: int | None) -> Callable[[Tensor], Tensor]:
    """``torch.export``, the successor of TorchScript: ``torch.export.load(path).module()`` runs it."""
    program = torch.export.export(model, (example_input(model, 2),), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    buffer = io.BytesIO()  # written by Python: torch.export.save into a full disk aborts from a C++ destructor
    torch.export.save(program, buffer)
    with writing(path):
        path.write_bytes(buffer.getbuffer())
    return torch.export.load(str(path)).module()


def _onnx(model: nn.Module, path: Path, opset: int | None) -> Callable[[Tensor], Tensor]:
    """ONNX through torch.export: ``images [batch, C, H, W]`` -> ``features [batch, D]``, run with onnxruntime."""
    import onnxruntime as ort

    big = sum(t.numel() * t.element_size() for t in model.state_dict().values()) > _ONNX_INLINE_LIMIT
    torch.onnx.export(model, (example_input(model, 2),), str(path), input_names=["images"], output_names=["features"],
                      dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), opset_version=opset, external_data=big, dynamo=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"images": x.numpy()})[0])


def write_traced(fmt: str, model: nn.Module, folder: Path, tolerance: float, opset: int | None = None) -> float:
    """Write ``folder/FILES[fmt]`` and return its max abs difference from the eager backbone."""
    path = folder / FILES[fmt]
    # (the parity check, not the tracers' warnings or the exporters' progress, tells whether a trace is right)
    with warnings.catch_warnings(action="ignore"), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        run = {"torchscript": _torchscript, "export": _exported, "onnx": _onnx}[fmt](model, path, opset)
    return check_parity(run, model, f"{_LABELS[fmt]} {path.name}", tolerance)
