"""Keyword arguments checked against the annotations of what takes them, so that a value of the
wrong type (``embed_dim: "abc"`` in a recipe, ``--data-arg img_size=abc``) is one line naming the
argument rather than an error from deep inside the constructor.

Only plain annotations are checked (``int``, ``float``, ``bool``, ``str`` and ``X | None`` of
one); anything richer is left to the callee."""

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

# An option's rule: (is the value valid?, the rule as the message says it).
OptionRule = tuple[Callable[[Any], bool], str]

_PLAIN: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def plain_type(annotation: Any) -> tuple[type, bool] | None:
    """``(type, None allowed)`` of a plain annotation, else None."""
    if annotation in _PLAIN:
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2 and rest[0] in _PLAIN:
            return rest[0], True
    return None


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` annotation (``Literal[...] | None``: with None), else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        literals = [a for a in args if typing.get_origin(a) is typing.Literal]
        if len(literals) == 1 and all(a is type(None) or a in literals for a in args):
            return (*typing.get_args(literals[0]), *((None,) if type(None) in args else ()))
    return None


def _accepts(kind: type, value: Any) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def annotations_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """The resolved parameter annotations of a function, or of a class's ``__init__`` and those of
    its bases (which take what it passes on in ``**kwargs``); an ``__init__`` whose annotations
    cannot be resolved adds none."""
    targets = [k.__dict__["__init__"] for k in reversed(fn.__mro__) if "__init__" in k.__dict__] if inspect.isclass(fn) else [fn]
    hints: dict[str, Any] = {}
    for target in targets:  # the class's own last: it wins
        try:
            hints.update(typing.get_type_hints(target))
        except Exception:  # an annotation naming what this module cannot import: not checked
            continue
    hints.pop("return", None)
    return hints


def check_argument_types(fn: Callable[..., Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Raise ``TypeError`` naming the first argument whose value does not fit its plain
    annotation: ``"{where}embed_dim must be an integer, got 'abc'"``."""
    hints = annotations_of(fn)
    for name, value in kwargs.items():
        choices = literal_choices(hints.get(name))
        if choices is not None:
            if value not in choices:
                raise TypeError(f"{where}{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
            continue
        plain = plain_type(hints.get(name))
        if plain is None:
            continue
        kind, optional = plain
        if (value is None and optional) or _accepts(kind, value):
            continue
        raise TypeError(f"{where}{name} must be {_PLAIN[kind]}{' or null' if optional else ''}, got {value!r}")


def _finite(v: Any) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


def check_option_values(args: Any, rules: Mapping[str, OptionRule]) -> None:
    """Raise ``ValueError`` naming the first command-line option (``rules``: argparse dest ->
    rule) whose value is not finite or breaks its rule: ``"--lr must be > 0, got -1"``. A list
    value is checked as a whole and shown item by item; options ``args`` lacks are skipped."""
    for dest, (valid, rule) in rules.items():
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        values = value if isinstance(value, list | tuple) else [value]
        if not (all(_finite(v) for v in values) and valid(value)):
            shown = " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
            raise ValueError(f"--{dest.replace('_', '-')} must be {rule}, got {shown}")


def closest(name: str, candidates: Collection[str]) -> str | None:
    """The one of ``candidates`` that is a likely spelling of ``name`` (difflib's similarity >= 0.7,
    ignoring case: ``batchsize`` finds ``batch_size``, ``vit_gigantic`` nothing), else None."""
    by_lower = {c.lower(): c for c in candidates if c != name}  # "Dino" finds "DINO"
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.7)
    return by_lower[close[0]] if close else None


def did_you_mean(name: str, candidates: Collection[str]) -> str:
    """``" (did you mean 'max_epochs'?)"`` when ``closest`` finds one, else ``""``."""
    close = closest(name, candidates)
    return f" (did you mean {close!r}?)" if close else ""


def init_parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The named arguments ``fn(...)`` accepts: a function's, or a class's ``__init__`` and, while
    it passes ``**kwargs`` on, those of its bases (what a recipe's ``init_args`` may name)."""
    targets = [vars(k)["__init__"] for k in fn.__mro__ if "__init__" in vars(k)] if inspect.isclass(fn) else [fn]
    params: dict[str, inspect.Parameter] = {}
    for target in targets:  # the class's own first: it wins
        try:
            signature = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):  # a builtin's __init__
            break
        for p in signature:
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                params.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in signature):
            break
    return params


def unexpected_keyword_hint(err: TypeError, fn: Callable[..., Any]) -> str:
    """The suggestion for Python's ``f() got an unexpected keyword argument 'x'`` raised by
    calling ``fn``: ``" (did you mean 'y'?)"`` or ``""``."""
    found = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    return did_you_mean(found.group(1), init_parameters(fn)) if found else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments: --epocs" also names the likely option
    (``--epochs``) among its own and its subcommands' (Python's argparse suggests only from 3.14)."""

    def error(self, message: str) -> typing.NoReturn:
        found = re.search(r"unrecognized arguments: (--[\w-]+)", message)
        if found:
            message += did_you_mean(found.group(1), option_strings(self))
        super().error(message)


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--option`` of a parser and of its subcommands' parsers."""
    names: list[str] = []
    for action in parser._actions:
        names += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                names += option_strings(sub)
    return list(dict.fromkeys(names))
