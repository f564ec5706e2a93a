"""Errors as a user sees them: one line each, with the likely spelling of a misspelt name, and a
value of the wrong type named by its argument (``embed_dim must be an integer, got 'abc'``)."""

from __future__ import annotations

import argparse
import difflib
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

OptionRule = tuple[Callable[[Any], bool], str]  # (is the value valid?, the rule as the message says it)
_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
# Lines of jsonargparse's nested explanation that restate the problem rather than name it.
_NOISE = ("Does not validate against any of the Union subtypes", "Expected a <class 'NoneType'>", "Subtypes:", "Errors:", "Given value")


class ConfigError(ValueError):
    """A recipe or command line that cannot run, found before any work starts."""


def one_line(message: str) -> str:
    """A message on one line (a library's may span several), for one ``ssl-vit <command>: error: ...``."""
    lines = [ln.strip().removeprefix("- ") for ln in message.splitlines() if ln.strip(" -")]
    return "; ".join(dict.fromkeys([ln for ln in lines if not ln.startswith(_NOISE)] or lines)).replace(":; ", ": ")


def closest(name: str, candidates: Collection[str]) -> str | None:
    """The likely spelling of ``name`` among ``candidates`` (difflib's ratio >= 0.7, case ignored)."""
    by_lower = {c.lower(): c for c in candidates if c != name}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.7)
    return by_lower[close[0]] if close else None


def did_you_mean(name: str, candidates: Collection[str]) -> str:
    return f" (did you mean {close!r}?)" if (close := closest(name, candidates)) else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments: --epocs" names the likely option among its
    own and its subcommands' (argparse suggests only from Python 3.14)."""

    def error(self, message: str) -> typing.NoReturn:
        if found := re.search(r"unrecognized arguments: (--[\w-]+)", message):
            parsers = [self, *(p for a in self._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values())]
            message += did_you_mean(found.group(1), [o for p in parsers for a in p._actions for o in a.option_strings if o.startswith("--")])
        super().error(message)


def check_argument_types(fn: Callable[..., Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Raise ``TypeError`` naming the first value that breaks its plain (int, float, bool, str) or ``Literal``
    annotation, ``| None`` or not: ``{where}embed_dim must be an integer, got 'abc'`` (for dicts no parser types)."""
    try:
        params = inspect.signature(fn, eval_str=True).parameters
    except NameError:  # an annotation naming what is not importable here: left as text, unchecked
        params = inspect.signature(fn).parameters
    for name, value in kwargs.items():
        hint = params[name].annotation if name in params else None
        union = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kinds = [k for k in union if k is not type(None)]
        kind, none_ok = kinds[0] if len(kinds) == 1 else None, len(kinds) < len(union)
        if typing.get_origin(kind) is typing.Literal:
            fits, rule = value in typing.get_args(kind), f"one of {', '.join(map(repr, typing.get_args(kind)))}"
        else:
            fits, rule = kind not in _WORDS or isinstance(value, kind) or (kind is float and isinstance(value, int)), _WORDS.get(kind)
        if not (fits or (value is None and none_ok)):
            raise TypeError(f"{where}{name} must be {rule}{' or null' if none_ok else ''}, got {value!r}")


def check_option_values(args: Any, rules: Mapping[str, OptionRule]) -> None:
    """Raise ``ValueError`` naming the first option (argparse dest -> rule) that is not finite or
    breaks its rule: ``--lr must be > 0, got -1``; a list is shown item by item."""
    for dest, (valid, rule) in ((d, r) for d, r in rules.items() if hasattr(args, d)):
        values = value if isinstance(value := getattr(args, dest), list | tuple) else [value]
        if not (all(not isinstance(v, float) or math.isfinite(v) for v in values) and valid(value)):
            raise ValueError(f"--{dest.replace('_', '-')} must be {rule}, got {' '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in values)}")
