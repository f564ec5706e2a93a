"""The one entry point, ``ssl-vit <command> ...``: each command is a module with ``main(argv) -> int``,
imported only when it runs (``ssl-vit --help`` stays fast); a failure is one line and an exit status."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings

from ssl_vit import __version__
from ssl_vit.errors import one_line

COMMANDS: dict[str, tuple[str, str]] = {  # command: (module, one-line help)
    "fit": ("ssl_vit.cli.fit", "pretrain (or train the supervised baseline) from YAML recipes via LightningCLI"),
    "eval": ("ssl_vit.cli.eval", "evaluate a backbone: linear | knn | fewshot | frozen (all three) | finetune"),
    "compare": ("ssl_vit.cli.compare", "tabulate result JSONs (SSL vs supervised vs random init)"),
    "demo": ("ssl_vit.cli.demo", "the main job: pretrain MPP, MoCo v3, DINO + supervised on Fashion-MNIST and compare"),
    "export": ("ssl_vit.cli.export", "extract a backbone: timm-compatible safetensors, config.json, TorchScript / torch.export / ONNX"),
    "visualize": ("ssl_vit.cli.visualize", "the ViT paper's figures: filters, position embeddings, attention distance, maps"),
    "benchmark": ("ssl_vit.cli.benchmark", "speed and memory against lightly+timm, and against the machine's matmul rate"),
    "backbones": ("ssl_vit.cli.backbones", "list the registered backbones"),
}
USAGE = "\n".join(["usage: ssl-vit <command> [options]   (ssl-vit <command> --help for its options)", "", "commands:",
                   *(f"  {name:<{max(map(len, COMMANDS))}}  {help_}" for name, (_, help_) in COMMANDS.items()), "", "global options:",
                   "  --debug   show full tracebacks instead of one-line errors", "  --version"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, argv = "--debug" in argv, [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help", "help", "--version"):
        print(f"ssl-vit {__version__}" if argv and argv[0] == "--version" else USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ssl-vit: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # OpenMP threads that sleep while they wait: with data-loading workers or another process on the
    # same cores, spinning threads slow a CPU run down several times over. The demo, one process that
    # loads its data itself unless given workers, runs faster with threads that spin. (Before torch is imported.)
    alone = command == "demo" and not any(a.startswith("--num-workers") for a in rest)
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE" if alone else "PASSIVE")
    from ssl_vit.runtime import keep_freed_memory, world_info

    # Lightning 2.6 with this torch warns at every fit of its own use of a deprecated pytree API.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    quiet_lightning_tips()
    # SSL_VIT_PLUGINS=mypkg.backbones,mypkg.byol: one's own modules (backbones they register, methods),
    # imported before any command so that eval / export / visualize know them too.
    plugins = [n.strip() for n in os.environ.get("SSL_VIT_PLUGINS", "").split(",") if n.strip()]
    try:
        keep_freed_memory()  # SSL_VIT_MALLOC=keep (ssl_vit.runtime)
        for name in plugins:
            try:
                importlib.import_module(name)
            except Exception as err:
                hint = " (is its folder on PYTHONPATH?)" if isinstance(err, ModuleNotFoundError) else ""
                raise ValueError(f"SSL_VIT_PLUGINS: cannot import {name}: {type(err).__name__}: {one_line(str(err))}{hint}") from err
    except ValueError as err:  # the environment's settings, before any command
        if debug:
            raise
        print(f"ssl-vit: error: {err}", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(COMMANDS[command][0]).main(rest) or 0)
    except KeyboardInterrupt:
        print("ssl-vit: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exit_:
        if isinstance(exit_.__context__, KeyboardInterrupt):  # Lightning ends a Ctrl-C it caught with exit(1)
            print("ssl-vit: interrupted", file=sys.stderr)
            return 130
        raise
    except BrokenPipeError:
        # The reader went away (`ssl-vit backbones | head -1`): nothing to report. Python's own flush
        # of stdout at exit would fail again, so stdout goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, TypeError, OSError, KeyError, NotImplementedError, RuntimeError) as err:
        if debug:
            raise
        # In a distributed run each process prints its own error (one's crash shows in the others as
        # a lost connection): the line says whose it is.
        rank, world = world_info()
        print(f"ssl-vit {command}: error{f' (process {rank} of {world})' if world > 1 else ''}: {one_line(str(err))}", file=sys.stderr)
        return 1


def _drop_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def quiet_lightning_tips() -> None:
    """Drop the advertisement Lightning logs at every Trainer's start ("💡 Tip: ... try installing
    litlogger"): a hosted service's, not a fact about the run. Its other start-up lines stay. (It
    goes to the rank_zero logger of whichever Lightning package was imported last: lightly imports
    ``pytorch_lightning``.)"""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_tip)  # (once, however often this runs)
