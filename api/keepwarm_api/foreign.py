"""Another program's flags that a keepwarm program answers by name (vLLM's, for `keepwarm serve`).

A user who brings a `vllm serve` command line meets, for each of its flags, one of three answers:
the flag is keepwarm's own (a setting declared with that name or as an alias: ``keepwarm_api.settings``),
it is accepted because keepwarm already behaves so (``accepted``: no value, nothing changes, or it
stands for one setting's value), or it is refused by name with what to use instead (``refused``).
The last two are declared here, as ``Foreign`` entries in a settings class's ``FOREIGN_FLAGS``, beside
that program's settings; the settings layer registers them with argparse and checks what they
require (standard library only, like the settings layer).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FOREIGN_DEST = "_foreign_flags"  # argparse dest: the accepted foreign flags given, in order


@dataclass(frozen=True)
class Foreign:
    """One flag of the other program that this program does not take as a setting of its own."""

    flags: tuple[str, ...]  # its spellings, the long one first, e.g. ("--tensor-parallel-size", "-tp")
    answer: str  # refused: what to use instead; accepted: why keepwarm already behaves so
    refuse: bool  # True: the flag is refused by name; False: accepted
    sets: tuple[str, Any] | None = None  # accepted: (field, value) it stands for, as if that flag said so
    requires: str | None = None  # accepted: a field that must be set too (the other program's rule)

    @property
    def flag(self) -> str:
        return self.flags[0]


def refused(*flags: str, instead: str) -> Foreign:
    """A flag this program does not implement: refused at parse time, naming it and ``instead``."""
    return Foreign(tuple(flags), instead, refuse=True)


def accepted(
    *flags: str, why: str, sets: tuple[str, Any] | None = None, requires: str | None = None
) -> Foreign:
    """A flag (taking no value) whose effect is already this program's behaviour, or that stands for
    ``sets`` (field, value); with ``requires``, only together with that setting."""
    return Foreign(tuple(flags), why, refuse=False, sets=sets, requires=requires)


class _Refuse(argparse.Action):
    """Refuses the flag with its answer; takes an optional value so that ``--flag=VALUE`` and
    ``--flag VALUE`` are refused by this name too, not as an "ignored explicit argument"."""

    def __init__(self, option_strings: Sequence[str], dest: str, foreign: Foreign, **kwargs: Any) -> None:
        self.foreign = foreign
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None):
        parser.error(f"{option} is not implemented by keepwarm: {self.foreign.answer}")


class _Accept(argparse.Action):
    """Records the flag (for ``requires``) and stores the setting value it stands for, if any."""

    def __init__(self, option_strings: Sequence[str], dest: str, foreign: Foreign, **kwargs: Any) -> None:
        self.foreign = foreign
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None):
        given = getattr(namespace, FOREIGN_DEST, None) or []
        setattr(namespace, FOREIGN_DEST, [*given, self.foreign])
        if self.foreign.sets is not None:
            field, value = self.foreign.sets
            setattr(namespace, field, value)


def add_foreign_arguments(parser: argparse.ArgumentParser, entries: Sequence[Foreign], program: str) -> None:
    """Register each entry with argparse, under a help line that says what happens."""
    for entry in entries:
        if entry.refuse:
            parser.add_argument(
                *entry.flags,
                action=_Refuse,
                foreign=entry,
                dest=argparse.SUPPRESS,
                metavar="VALUE",
                help=f"{program}'s flag, refused: {entry.answer}",
            )
        else:
            parser.add_argument(
                *entry.flags,
                action=_Accept,
                foreign=entry,
                dest=argparse.SUPPRESS,
                help=f"{program}'s flag, accepted: {entry.answer}",
            )


def given(args: argparse.Namespace) -> list[Foreign]:
    """The accepted foreign flags on this command line."""
    return list(getattr(args, FOREIGN_DEST, None) or [])
