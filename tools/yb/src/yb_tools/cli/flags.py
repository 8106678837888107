"""Which flags a command was given, for refusing those its run would not read.

`argparse` keeps no record of what was typed: a flag counts as given when its value
differs from its default (one repeating its default changes nothing either way).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any


def defaults_of(add_parser: Callable[[Any], None]) -> argparse.ArgumentParser:
    """A fresh parser of the one command `add_parser` registers, for its defaults."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    (parser,) = sub.choices.values()
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def given(
    args: argparse.Namespace, defaults: argparse.ArgumentParser, flags: Mapping[str, str]
) -> list[str]:
    """The flags (argparse dest -> how it is spelt) whose value is not the default."""
    return [
        flag for dest, flag in flags.items() if getattr(args, dest) != defaults.get_default(dest)
    ]
