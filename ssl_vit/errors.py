"""Errors as a user sees them: one line each, with the likely spelling of a misspelt name, and a
value of the wrong type named by its argument (``embed_dim must be an integer, got 'abc'``) rather
than failing deep inside a constructor."""

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
_PLAIN: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
# Lines of jsonargparse's nested explanation that restate the problem rather than name it.
_NOISE = ("Does not validate against any of the Union subtypes", "Expected a <class 'NoneType'>", "Subtypes:", "Errors:", "Given value")


class ConfigError(ValueError):
    """A recipe or command line that cannot run, found before any work starts."""


def one_line(message: str) -> str:
    """A message on one line (a library's may span several: a URL error, jsonargparse's nested
    explanation), so that logs and wrapper scripts see one ``ssl-vit <command>: error: ...``."""
    lines = [ln.strip().removeprefix("- ") for ln in message.splitlines() if ln.strip(" -")]
    return "; ".join(dict.fromkeys([ln for ln in lines if not ln.startswith(_NOISE)] or lines)).replace(":; ", ": ")


def closest(name: str, candidates: Collection[str]) -> str | None:
    """The one of ``candidates`` that is a likely spelling of ``name`` (difflib's ratio >= 0.7,
    ignoring case: ``batchsize`` finds ``batch_size``, ``vit_gigantic`` nothing), else None."""
    by_lower = {c.lower(): c for c in candidates if c != name}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.7)
    return by_lower[close[0]] if close else None


def did_you_mean(name: str, candidates: Collection[str]) -> str:
    close = closest(name, candidates)
    return f" (did you mean {close!r}?)" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose "unrecognized arguments: --epocs" names the likely option among its
    own and its subcommands' (argparse suggests only from Python 3.14)."""

    def error(self, message: str) -> typing.NoReturn:
        if found := re.search(r"unrecognized arguments: (--[\w-]+)", message):
            message += did_you_mean(found.group(1), _option_strings(self))
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    names = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names += [o for sub in action.choices.values() for o in _option_strings(sub)]
    return names


def _inits(fn: Callable[..., Any]) -> list[Callable[..., Any]]:
    """A function, or a class's ``__init__`` and, while it passes ``**kwargs`` on, its bases'."""
    if not inspect.isclass(fn):
        return [fn]
    inits = []
    for init in (vars(k)["__init__"] for k in fn.__mro__ if "__init__" in vars(k)):
        inits.append(init)
        try:
            if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
                break
        except (TypeError, ValueError):  # a builtin's __init__
            break
    return inits


def init_parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The named arguments ``fn(...)`` accepts (what a recipe's ``init_args`` may name)."""
    params: dict[str, inspect.Parameter] = {}
    for init in _inits(fn):
        try:
            found = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            break
        for p in found:
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                params.setdefault(p.name, p)
    return params


def annotations_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of what ``fn(...)`` accepts (the class's own win over its bases')."""
    hints: dict[str, Any] = {}
    for init in reversed(_inits(fn)):
        try:
            hints.update(typing.get_type_hints(init))
        except Exception:  # an annotation naming what this module cannot import: not checked
            continue
    hints.pop("return", None)
    return hints


def _optional(annotation: Any) -> tuple[Any, bool]:
    """``(X, None allowed)`` of ``X`` or ``X | None``."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    rest = tuple(a for a in args if a is not type(None))
    return (rest[0] if len(rest) == 1 else None), len(rest) < len(args)


def plain_type(annotation: Any) -> tuple[type, bool] | None:
    """``(type, None allowed)`` of a plain annotation (int, float, bool, str, ``X | None``), else None."""
    kind, optional = _optional(annotation)
    return (kind, optional) if kind in _PLAIN else None


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of ``Literal[...]`` (with None for ``Literal[...] | None``), else None."""
    kind, optional = _optional(annotation)
    return (*typing.get_args(kind), *((None,) if optional else ())) if typing.get_origin(kind) is typing.Literal else None


def check_argument_types(fn: Callable[..., Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Raise ``TypeError`` naming the first argument whose value breaks its plain or ``Literal``
    annotation: ``"{where}embed_dim must be an integer, got 'abc'"``; richer ones are the callee's."""
    hints = annotations_of(fn)
    for name, value in kwargs.items():
        if (choices := literal_choices(hints.get(name))) is not None:
            if value not in choices:
                raise TypeError(f"{where}{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        elif (plain := plain_type(hints.get(name))) is not None:
            kind, optional = plain
            fits = isinstance(value, kind) or (kind is float and isinstance(value, int))
            if not ((value is None and optional) or (fits and (kind is bool or not isinstance(value, bool)))):
                raise TypeError(f"{where}{name} must be {_PLAIN[kind]}{' or null' if optional else ''}, got {value!r}")


def check_option_values(args: Any, rules: Mapping[str, OptionRule]) -> None:
    """Raise ``ValueError`` naming the first option (argparse dest -> rule) that is not finite or
    breaks its rule: ``"--lr must be > 0, got -1"``; a list is shown item by item."""
    for dest, (valid, rule) in rules.items():
        if hasattr(args, dest):
            value = getattr(args, dest)
            values = value if isinstance(value, list | tuple) else [value]
            if not (all(not isinstance(v, float) or math.isfinite(v) for v in values) and valid(value)):
                shown = " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
                raise ValueError(f"--{dest.replace('_', '-')} must be {rule}, got {shown}")
