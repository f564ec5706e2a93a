"""``ssl-vit benchmark``: training-step speed and memory of every method against the same step
composed from lightly and timm, the bare backbone against timm's ViT, the achieved FLOP/s as a
fraction of the machine's matmul rate, and the augmentation pipelines' views per second.

Nothing here is a test: timing lives in this command, never in the test suite.
"""

from typing import Any

from ssl_vit.bench.config import BenchConfig, ModelSpec, preset

__all__ = ["BenchConfig", "ModelSpec", "preset", "run_benchmark"]


def __getattr__(name: str) -> Any:
    # run_benchmark pulls in torch, timm and lightly; `ssl-vit benchmark --help` should not wait.
    if name == "run_benchmark":
        from ssl_vit.bench.runner import run_benchmark

        return run_benchmark
    raise AttributeError(f"module 'ssl_vit.bench' has no attribute {name!r}")
