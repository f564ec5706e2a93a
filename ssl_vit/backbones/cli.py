"""``ssl-vit backbones``: list the registry with each architecture's size."""

from __future__ import annotations

import argparse

from ssl_vit.backbones.registry import get_spec, list_backbones


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ssl-vit backbones", description=__doc__)
    parser.parse_args(argv)
    for name in list_backbones():
        spec = get_spec(name)
        print(f"{name:<22} {spec.description}")
        print(f"{'':<22} kwargs: {', '.join(spec.allowed_kwargs())}")
    return 0
