"""The options of ``ssl-vit eval`` checked before any work: values an evaluation cannot run
with, and output folders that could not take its records or its fine-tuned model."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ssl_vit.errors import OptionRule, check_option_values


def check_output_folder(folder: str | Path, what: str, create: bool = False) -> None:
    """Make sure ``folder`` can take the output, so that an output that cannot be written fails
    before any work, not after it: its nearest existing folder must take a file (a write is
    tried); ``create``: the folder is made (with its parents) too. ``what`` names the option in
    the message."""
    path = Path(folder).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}: {folder} exists and is not a folder")
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what}: cannot create the folder {folder}: {existing} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".ssl-vit-write-check-"):
            pass
    except OSError as err:
        raise OSError(f"{what}: cannot write into the folder {existing} ({err.strerror or err})") from None
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(f"{what}: cannot create the folder {folder} ({err.strerror or err})") from None


def check_out(out: str, create: bool = False) -> None:
    """``--out``: a folder of records, or a record file (``*.json``) in a folder, that can be
    written (``create``: its folder is made)."""
    path = Path(out).expanduser()
    if path.suffix.lower() == ".json":  # (ssl_vit.eval.run.names_a_record)
        if path.is_dir():
            raise ValueError(f"--out {out}: is a folder; a name ending in .json names the record file itself")
        check_output_folder(path.parent, f"--out {out}", create)
    elif path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder; name a folder for the records, or a record file ending in .json")
    else:
        check_output_folder(path, f"--out {out}", create)


def check_export(export: str, create: bool = False, backbone: str | None = None) -> None:
    """``--export DIR``: a folder (or a name for a new one) in a folder that can be written
    (``create``: that folder is made), so that the fine-tuned model is not lost after the run;
    not the export ``backbone`` (``--backbone``) is read from, which it would replace."""
    path = Path(export).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--export {export}: exists and is not a directory; name a folder")
    if backbone is not None and path.is_dir():
        source = Path(backbone).expanduser()
        source = source if source.is_dir() else source.parent
        from ssl_vit.export.save import CONFIG_FILE

        if source.is_dir() and source.resolve() == path.resolve() and (source / CONFIG_FILE).is_file():
            raise ValueError(f"--export {export}: is the export --backbone reads; the fine-tuned model would replace "
                             "the pretrained one: name another folder")
    check_output_folder(path if path.is_dir() else path.parent, f"--export {export}", create)


# dest: (valid?, the rule as the message says it). Checked for the options a protocol has.
_OPTION_RULES: dict[str, OptionRule] = {
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "num_workers": (lambda v: v >= 0, ">= 0"),
    "train_subset": (lambda v: v is None or v >= 1, ">= 1 (images)"),
    "test_subset": (lambda v: v is None or v >= 1, ">= 1 (images)"),
    "epochs": (lambda v: v >= 1, ">= 1"),
    "lr": (lambda v: v is None or (all(x > 0 for x in v) if isinstance(v, list) else v > 0), "> 0"),
    "select_fraction": (lambda v: v is None or 0 < v < 1, "in (0, 1)"),
    "warmup_epochs": (lambda v: v >= 0, ">= 0"),
    "probe_batch_size": (lambda v: v >= 2, ">= 2 (the probe's BatchNorm needs two examples)"),
    "k": (lambda v: all(k >= 1 for k in v), ">= 1"),
    "temperature": (lambda v: v > 0, "> 0"),
    "shots": (lambda v: all(s >= 1 for s in v), ">= 1 each"),
    "seeds": (lambda v: v >= 1, ">= 1"),
    "l2": (lambda v: v > 0, "> 0"),
    "layer_decay": (lambda v: 0 < v <= 1, "in (0, 1] (1: no decay)"),
    "drop_path": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "label_smoothing": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "mixup": (lambda v: v >= 0, ">= 0 (0: off)"),
    "cutmix": (lambda v: v >= 0, ">= 0 (0: off)"),
    "rand_augment": (lambda v: v is None or (v[0] >= 1 and 0 <= v[1] <= 30), "OPS MAGNITUDE with OPS >= 1 and MAGNITUDE in 0..30"),
    "random_erasing": (lambda v: 0 <= v <= 1, "a probability in [0, 1] (0: off)"),
    "img_size": (lambda v: v is None or v >= 1, ">= 1"),
    "crop_scale": (lambda v: v is None or 0 < v[0] <= v[1] <= 1, "LO HI with 0 < LO <= HI <= 1"),
    "max_steps": (lambda v: v == -1 or v >= 1, "-1 (no cap) or >= 1"),
    "checkpoint_every": (lambda v: v >= 1, ">= 1"),
    "devices": (lambda v: v >= 1, ">= 1"),
    "num_nodes": (lambda v: v >= 1, ">= 1"),
}


def check_options(args: argparse.Namespace) -> None:
    """Refuse the option values an evaluation cannot run with (or would record without running
    them: a negative MixUp alpha is off), before anything is loaded, naming the option."""
    check_option_values(args, _OPTION_RULES)
