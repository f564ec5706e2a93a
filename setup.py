from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_version() -> str:
    for line in (HERE / "ssl_vit" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip('"')
    raise RuntimeError("ssl_vit/__init__.py defines no __version__")


setup(
    name="ssl_vit",
    version=read_version(),
    description="Self-supervised pretraining of Vision Transformers: masked patch prediction, "
    "MoCo v3, DINO and a supervised baseline around one ViT backbone",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ssl_vit", "ssl_vit.*"]),
    include_package_data=True,
    package_data={"ssl_vit": ["py.typed"]},
    install_requires=[
        "torch>=2.2",
        "torchvision>=0.17",
        "lightning>=2.2",
        "lightly>=1.5",
        "einops>=0.7",
        "tensorboard>=2.14",
        "jsonargparse[signatures]>=4.27",
        "safetensors>=0.4",
        # the export format (timm's parameter names, config.json, its model registry)
        "timm>=1.0",
        # figures of `ssl-vit visualize` and the demo's bar chart
        "matplotlib>=3.7",
        # streamed image shards (ImageShardsDataModule, tools/folder_to_shards.py); the version tested
        "litdata>=0.2.76",
    ],
    extras_require={
        # ONNX packages let the suite check exported graphs against the eager model.
        "test": [
            "pytest>=7.4",
            "pytest-xdist>=3.5",  # make test runs the suite in two worker processes
            "ruff>=0.4",
            "onnx>=1.15",
            "onnxscript>=0.1",
            "onnxruntime>=1.17",
        ],
        # ONNX export and its parity check.
        "onnx": ["onnx>=1.15", "onnxscript>=0.1", "onnxruntime>=1.17"],
    },
    entry_points={"console_scripts": ["ssl-vit=ssl_vit.cli:main"]},
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
