"""The one entry point: ``ssl-vit <command> ...``.

Each command lives in its own module with a ``main(argv) -> int``; this file only dispatches, so
``ssl-vit --help`` stays fast (nothing heavy is imported until a command runs).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings

# command: (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("ssl_vit.cli.fit", "pretrain (or train the supervised baseline) from YAML recipes via LightningCLI"),
    "eval": ("ssl_vit.cli.eval", "evaluate a backbone: linear | knn | fewshot | frozen (all three) | finetune"),
    "compare": ("ssl_vit.eval.compare", "tabulate result JSONs (SSL vs supervised vs random init)"),
    "demo": ("ssl_vit.cli.demo", "the main job: pretrain MPP, MoCo v3, DINO + supervised on Fashion-MNIST and compare"),
    "export": ("ssl_vit.cli.export", "extract a backbone: timm-compatible safetensors, config.json, TorchScript / torch.export / ONNX"),
    "visualize": ("ssl_vit.cli.visualize", "the ViT paper's figures: filters, position embeddings, attention distance, maps"),
    "benchmark": ("ssl_vit.cli.benchmark", "speed and memory against lightly+timm, and against the machine's matmul rate"),
    "backbones": ("ssl_vit.cli.backbones", "list the registered backbones"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: ssl-vit <command> [options]   (ssl-vit <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "global options:", "  --debug   show full tracebacks instead of one-line errors", "  --version"]
    return "\n".join(lines)


def one_line(message: str) -> str:
    """An error message on one line (a library's may span several: a URL error, a traceback-like
    explanation), so that logs and wrapper scripts see one ``ssl-vit <command>: error: ...``."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from ssl_vit import __version__

        print(f"ssl-vit {__version__}")
        return 0
    # OpenMP threads that sleep instead of spinning while they wait: with data-loading workers or
    # another process on the same cores, spinning threads slow a CPU run down several times over
    # (measured 10x on 2 cores); on an idle machine the cost is within noise. Must precede torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # SSL_VIT_MALLOC=keep: reuse freed activation memory instead of faulting it in again every
    # step (5-6 % faster CPU training steps, for some peak RSS; see ssl_vit.runtime.keep_freed_memory).
    from ssl_vit.runtime import keep_freed_memory

    try:
        keep_freed_memory()
    except ValueError as err:
        print(f"ssl-vit: error: {err}", file=sys.stderr)
        return 2
    # Lightning 2.6 with this torch warns at every fit that it calls a deprecated pytree API: its
    # internals, nothing a user of ssl-vit can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    quiet_lightning_tips()
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ssl-vit: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # SSL_VIT_PLUGINS=mypkg.backbones,mypkg.byol: modules of one's own (backbones they register,
    # methods) imported before any command, so that eval / export / visualize know them too.
    for name in filter(None, (n.strip() for n in os.environ.get("SSL_VIT_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as err:
            if debug:
                raise
            hint = " (is its folder on PYTHONPATH?)" if isinstance(err, ModuleNotFoundError) else ""
            print(f"ssl-vit: error: SSL_VIT_PLUGINS: cannot import {name}: {type(err).__name__}: {one_line(str(err))}{hint}", file=sys.stderr)
            return 2
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        print("ssl-vit: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exit_:
        # Lightning ends a Ctrl-C it caught itself (a second one, after the first's checkpoint) with exit(1).
        if isinstance(exit_.__context__, KeyboardInterrupt):
            print("ssl-vit: interrupted", file=sys.stderr)
            return 130
        raise
    except BrokenPipeError:
        # The reader of the output went away (`ssl-vit backbones | head -1`): nothing to report.
        # Python's own flush of stdout at exit would fail again, so it goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, TypeError, OSError, KeyError, NotImplementedError, RuntimeError) as err:
        # Bad input gets one clear line; --debug shows where it came from.
        if debug:
            raise
        print(f"ssl-vit {command}: error{_which_process()}: {one_line(str(err))}", file=sys.stderr)
        return 1


def _drop_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def quiet_lightning_tips() -> None:
    """Drop the advertisement Lightning logs at every Trainer's start ("💡 Tip: For seamless cloud
    logging ... try installing litlogger"): a hosted service's, not a fact about the run. Its
    other start-up lines (accelerator, devices) stay."""
    # rank_zero_info's logger: lightning.pytorch's when it is imported, fabric's alone otherwise.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if _drop_tip not in log.filters:
            log.addFilter(_drop_tip)


def _which_process() -> str:
    """`` (process R of N)`` in a distributed run, whose processes each print their own error
    (one's crash shows in the others as a lost connection: the line says whose that is)."""
    from ssl_vit.runtime import world_info

    rank, world = world_info()
    return f" (process {rank} of {world})" if world > 1 else ""


if __name__ == "__main__":
    sys.exit(main())
