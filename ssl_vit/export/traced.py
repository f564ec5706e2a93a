"""TorchScript, ``torch.export`` and ONNX copies of a backbone, each checked against the eager
model right after it is written.

Both are traced at the export's image size; the batch dimension stays free (ONNX: a dynamic
``batch`` axis), and the check runs a different batch size than the trace to prove it. A file that
disagrees with the eager model by more than the tolerance is never moved into the export folder.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from ssl_vit.io import writing

TORCHSCRIPT_FILE = "model.torchscript.pt"
EXPORTED_FILE = "model.pt2"
ONNX_FILE = "model.onnx"
# Above this a protobuf cannot hold the weights; ONNX then stores them in a side file.
_ONNX_INLINE_LIMIT = 1_800_000_000


class ExportParityError(RuntimeError):
    """An exported file computes something else than the eager backbone."""


def example_input(model: nn.Module, batch: int, seed: int = 0) -> Tensor:
    """Random images ``[batch, C, H, W]`` at the backbone's size (fixed seed: reproducible reports)."""
    g = torch.Generator().manual_seed(seed)
    h, w = model.img_size
    return torch.randn(batch, model.in_chans, h, w, generator=g)


@torch.no_grad()
def check_parity(run: Callable[[Tensor], Tensor], model: nn.Module, x: Tensor, what: str, tolerance: float) -> float:
    """Max absolute difference between ``run(x)`` and ``model(x)``; raises above ``tolerance``."""
    expected = model(x)
    got = run(x)
    if got.shape != expected.shape:
        raise ExportParityError(f"{what}: output shape {tuple(got.shape)} differs from the eager backbone's {tuple(expected.shape)}")
    diff = float((got.float() - expected.float()).abs().max())
    if not diff <= tolerance:  # also catches NaN
        raise ExportParityError(
            f"{what}: outputs differ from the eager backbone by {diff:.3g} (max abs) > tolerance {tolerance:g}; "
            "the file was not written"
        )
    return diff


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # Tracing warns about every Python-level shape check and torch.jit about its own deprecation;
    # the parity check below is what tells whether the trace is right.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


class _SizeChecked(nn.Module):
    """A traced backbone behind a check of the input's size: tracing drops the model's own
    Python checks, and a traced ViT would silently crop an image larger than its trace's."""

    def __init__(self, traced: nn.Module, channels: int, height: int, width: int) -> None:
        super().__init__()
        self.traced = traced
        self.channels, self.height, self.width = channels, height, width

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.size(1) != self.channels or x.size(2) != self.height or x.size(3) != self.width:
            raise RuntimeError(
                "this TorchScript backbone takes images [batch, " + str(self.channels) + ", " + str(self.height) + ", "
                + str(self.width) + "] (traced at that size), got " + str(x.shape)
            )
        return self.traced(x)


def write_torchscript(model: nn.Module, folder: Path, tolerance: float) -> tuple[Path, float]:
    """``torch.jit.trace`` the backbone into ``folder/model.torchscript.pt`` (behind a check of
    the input size it was traced at) and check it."""
    path = folder / TORCHSCRIPT_FILE
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(model, example_input(model, 2), check_trace=False)
        h, w = model.img_size
        traced = torch.jit.script(_SizeChecked(traced, int(model.in_chans), int(h), int(w)))
        with writing(path), open(path, "wb") as f:  # (a Python file: a full disk is an OSError, not a C++ abort)
            torch.jit.save(traced, f)
        loaded = torch.jit.load(str(path), map_location="cpu")
    diff = check_parity(loaded, model, example_input(model, 3, seed=1), f"TorchScript {TORCHSCRIPT_FILE}", tolerance)
    return path, diff


def write_exported_program(model: nn.Module, folder: Path, tolerance: float) -> tuple[Path, float]:
    """``torch.export`` the backbone (batch dimension free) into ``folder/model.pt2``, the
    successor of TorchScript: ``torch.export.load(path).module()`` runs it."""
    path = folder / EXPORTED_FILE
    batch = torch.export.Dim("batch", min=1)
    with _quiet(), torch.no_grad():
        program = torch.export.export(model, (example_input(model, 2),), dynamic_shapes=({0: batch},))
        # Serialised in memory, then written by Python: torch.export.save into a file that cannot
        # take it (a full disk, a quota) aborts the process from a C++ destructor.
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        with writing(path):
            path.write_bytes(buffer.getbuffer())
        loaded = torch.export.load(str(path)).module()
    diff = check_parity(loaded, model, example_input(model, 3, seed=1), f"torch.export {EXPORTED_FILE}", tolerance)
    return path, diff


def write_onnx(model: nn.Module, folder: Path, tolerance: float, opset: int | None = None) -> tuple[Path, float]:
    """``torch.onnx.export`` (the torch.export-based exporter) into ``folder/model.onnx``, input
    ``images [batch, C, H, W]``, output ``features [batch, D]``; checked with onnxruntime."""
    import onnxruntime as ort

    path = folder / ONNX_FILE
    big = sum(p.numel() * p.element_size() for p in model.state_dict().values()) > _ONNX_INLINE_LIMIT
    batch = torch.export.Dim("batch", min=1)
    with _quiet():
        torch.onnx.export(
            model,
            (example_input(model, 2),),
            str(path),
            input_names=["images"],
            output_names=["features"],
            dynamic_shapes=({0: batch},),
            opset_version=opset,
            external_data=big,
            verbose=False,
            dynamo=True,
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(x: Tensor) -> Tensor:
        return torch.from_numpy(session.run(None, {"images": x.numpy()})[0])

    diff = check_parity(run, model, example_input(model, 3, seed=1), f"ONNX {ONNX_FILE}", tolerance)
    return path, diff
