"""One declarative settings layer for every keepwarm program (standard library only).

A program declares its settings once, as a frozen dataclass whose fields come from ``setting()``:
the annotation is the type, then the default and the help. Everything else is generated from that
declaration, so a flag cannot drift from its variable, its help or its documentation:

* the command-line flag: ``--`` + the field name with dashes (``max_num_seqs`` -> ``--max-num-seqs``);
* the environment variable: the program's prefix + the field name in upper case
  (``KEEPWARM_MAX_NUM_SEQS``), derived once, in ``env_name``;
* ``--help`` (each flag's help names its default and its variable) and the flag tables of
  docs/reference/flags.md (``markdown_table``, checked against the page by a test).

Precedence: a flag on the command line, else the environment variable, else the default.
The one rule for empty values (``present``): an unset variable and one that is empty or only
blanks both mean "not given", so the default applies; any other value is stripped and parsed, and a
value that does not parse is refused naming the variable (``SettingError``), never guessed.
Booleans take ``1/true/yes/on`` and ``0/false/no/off`` in any case (``parse_bool``); repeatable
settings take comma-separated values from the environment.

Another program's spelling (vLLM's, for `keepwarm serve`) is declared on the same line: ``aliases``
(another flag of the same meaning), ``many`` (several values after one flag, vLLM's ``nargs='+'``),
``shared`` (the other program has this very flag); flags of the other program that this one does not
take as its own are ``Foreign`` entries in the class's ``FOREIGN_FLAGS``: accepted where this program
already behaves so, refused by name with what to use instead otherwise (``foreign_table`` documents
them). Abbreviated flags are refused, never guessed (``allow_abbrev=False``).

Adding a setting is one line in the program's dataclass. Programs resolve their settings once, at
their entry point (``resolve``), and hand the dataclass on; no layer below reads argv or os.environ.
This module lives in keepwarm-api because the operator builds pods from the same names (see
``keepwarm_api.podenv``) and imports nothing heavier than the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .foreign import Foreign, add_foreign_arguments, given

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
DEFAULT_PREFIX = "KEEPWARM_"
_META_KEY = "keepwarm.setting"
T = TypeVar("T")


class SettingError(ValueError):
    """A value from the environment or the command line that cannot be used; the message names it."""


def env_name(field_name: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The environment variable of a setting: ``prefix`` + the field name in upper case."""
    return prefix + field_name.upper()


def flag_name(field_name: str) -> str:
    """The command-line flag of a setting: ``--`` + the field name with dashes."""
    return "--" + field_name.replace("_", "-")


def present(raw: str | None) -> str | None:
    """The one rule for empty values: None (not given: the default applies) for an unset, empty or
    blank value, else the value stripped. Every KEEPWARM_* variable is read through this function."""
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` in any case; anything else raises ValueError."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{text!r} is not a boolean; use true or false (empty means the default)")


def repeated(container: type, parse_one: Callable[[str], Any]) -> Callable[[str], Any]:
    """The parser of a repeatable setting's variable: comma-separated values, blanks skipped, each
    parsed by ``parse_one`` into ``container`` (tuple or frozenset)."""

    def parse(text: str) -> Any:
        return container(parse_one(part.strip()) for part in text.split(",") if part.strip())

    return parse


def env_value(name: str, parse: Callable[[str], Any], default: Any, environ: Mapping[str, str]) -> Any:
    """``environ[name]`` parsed, or ``default`` when it is not given (see ``present``)."""
    raw = present(environ.get(name))
    if raw is None:
        return default
    try:
        return parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SettingError(f"{name}={environ[name]!r} is not valid: {exc}") from None


@dataclass(frozen=True)
class _Meta:
    help: str
    choices: tuple[Any, ...] | None
    parse: Callable[[str], Any] | None
    positional: bool
    required: bool
    group: str | None
    env: str | None  # an explicit variable name (a Kubernetes convention such as NODE_NAME)
    metavar: str | None
    unset: str | None  # what a None default means, for --help and the flag tables
    flag: str | None  # an explicit flag (a singular flag for a plural field, e.g. --namespace)
    aliases: tuple[str, ...]  # other spellings of the flag, same meaning (another program's, e.g. vLLM's)
    many: bool  # repeatable: several values may follow one flag (vLLM's nargs='+'), as well as repeats
    shared: bool  # the other program (FOREIGN_PROGRAM) has this flag under this name and meaning


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    positional: bool = False,
    required: bool = False,
    group: str | None = None,
    env: str | None = None,
    metavar: str | None = None,
    unset: str | None = None,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    many: bool = False,
    shared: bool = False,
) -> Any:
    """A field of a settings dataclass. ``parse`` turns one text value into the field's type (default:
    the annotation's type); ``group`` lets a program pick fields out (e.g. "engine"); ``env`` replaces
    the derived variable name and ``flag`` the derived flag where an older name must stay;
    ``required`` settings have no usable default and must come from the flag or the variable;
    ``unset`` says what a None default means; ``aliases``, ``many`` and ``shared`` speak another
    program's command line (see the module's docstring)."""
    meta = _Meta(
        help,
        tuple(choices) if choices else None,
        parse,
        positional,
        required,
        group,
        env,
        metavar,
        unset,
        flag,
        tuple(aliases),
        many,
        shared,
    )
    if isinstance(default, list | set):
        raise TypeError("use a tuple or frozenset for the default of a repeatable setting")
    if many and not isinstance(default, tuple | frozenset):
        raise TypeError("many= is for repeatable settings (a tuple or frozenset default)")
    if positional and aliases:
        raise TypeError("a positional setting takes no flag aliases")
    return dataclasses.field(default=default, metadata={_META_KEY: meta})


@dataclass(frozen=True)
class Spec:
    """One setting as every generator sees it."""

    name: str  # the dataclass field
    kind: type  # str, int, float or bool (the element type of a repeatable setting)
    repeat: type | None  # tuple or frozenset: a repeatable flag, a comma-separated variable
    optional: bool  # None is a value (unset)
    default: Any
    meta: _Meta
    prefix: str

    @property
    def flag(self) -> str:
        return self.meta.flag or flag_name(self.name)

    @property
    def env(self) -> str:
        return self.meta.env or env_name(self.name, self.prefix)

    def parse_one(self, text: str) -> Any:
        """One text value as the setting's type, checked against its choices."""
        if self.meta.parse is not None:
            value = self.meta.parse(text)
        elif self.kind is bool:
            value = parse_bool(text)
        else:
            value = self.kind(text.strip() if self.kind is not str else text)
        if self.meta.choices is not None and value not in self.meta.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(map(str, self.meta.choices))}")
        return value

    def parse_env(self, text: str) -> Any:
        if self.repeat:
            return repeated(self.repeat, self.parse_one)(text)
        return self.parse_one(text)

    def shown_default(self) -> str | None:
        """The default as --help and the flag tables show it; None when there is none to show."""
        if _empty(self.default):
            return self.meta.unset
        return _show(self.default)

    def help_text(self) -> str:
        said = "required" if self.meta.required else f"default: {self.shown_default() or 'unset'}"
        return f"{self.meta.help} ({said}; env {self.env})".replace("%", "%%")


def _empty(value: Any) -> bool:
    """No value: None, or a repeatable setting with no element."""
    return value is None or (isinstance(value, tuple | frozenset) and not value)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | frozenset):
        return ",".join(map(str, sorted(value) if isinstance(value, frozenset) else value))
    return str(value)


def specs(cls: type) -> list[Spec]:
    """The settings of a dataclass declared with ``setting()``, in declaration order; its variables
    start with the class's ``ENV_PREFIX`` (a ClassVar; default KEEPWARM_)."""
    prefix = getattr(cls, "ENV_PREFIX", DEFAULT_PREFIX)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        kind, repeat, optional = _unpack(hints[f.name], f"{cls.__name__}.{f.name}")
        out.append(Spec(f.name, kind, repeat, optional, f.default, meta, prefix))
    return out


def _unpack(hint: Any, where: str) -> tuple[type, type | None, bool]:
    """(element type, container, optional) of an annotation such as ``int | None``, ``tuple[str, ...]``."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"{where}: one type (or it | None) per setting, got {hint}")
        hint = args[0]
    container = typing.get_origin(hint)
    if container in (tuple, frozenset):
        return typing.get_args(hint)[0], container, optional
    if hint not in (str, int, float, bool):
        raise TypeError(
            f"{where}: settings are str, int, float, bool, or tuples or frozensets of them, got {hint}"
        )
    return hint, None, optional


PRECEDENCE = (
    "Every flag also reads its environment variable; a flag wins, an empty variable means the default."
)


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    cls: type,
    help: str,
    handler: Callable[[argparse.Namespace], int] | None = None,
) -> argparse.ArgumentParser:
    """A subcommand whose flags are the settings of ``cls``; ``handler`` becomes ``args.handler``."""
    parser = subparsers.add_parser(
        name, help=help, description=f"{help[:1].upper()}{help[1:]}. {PRECEDENCE}", allow_abbrev=False
    )
    add_arguments(parser, cls)
    if handler is not None:
        parser.set_defaults(handler=handler)
    return parser


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argparse argument per setting (under its flag and its aliases), then the class's foreign
    flags. A setting's parsed default is None ("not on the command line"), so ``resolve`` can tell a
    flag from the environment and the declared default."""
    for spec in specs(cls):
        common: dict[str, Any] = {"default": None, "help": spec.help_text()}
        if spec.meta.metavar:
            common["metavar"] = spec.meta.metavar
        if spec.meta.positional:
            parser.add_argument(spec.name, nargs="?", type=_argparse_type(spec), **common)
            continue
        common["dest"] = spec.name
        flags = (spec.flag, *spec.meta.aliases)
        if spec.kind is bool and not spec.repeat:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        elif spec.repeat:
            several = {"action": "extend", "nargs": "+"} if spec.meta.many else {"action": "append"}
            parser.add_argument(*flags, type=_argparse_type(spec), **several, **common)
        else:
            parser.add_argument(*flags, type=_argparse_type(spec), choices=spec.meta.choices, **common)
    add_foreign_arguments(parser, foreign_flags(cls), foreign_program(cls))


def foreign_flags(cls: type) -> tuple[Foreign, ...]:
    """The other program's flags a settings class answers (its ``FOREIGN_FLAGS`` ClassVar; none by
    default)."""
    return tuple(getattr(cls, "FOREIGN_FLAGS", ()))


def foreign_program(cls: type) -> str:
    """Whose command line ``aliases``, ``shared`` and ``FOREIGN_FLAGS`` speak (``FOREIGN_PROGRAM``)."""
    return getattr(cls, "FOREIGN_PROGRAM", "another program")


def _argparse_type(spec: Spec) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return spec.parse_one(text)
        except ValueError as exc:  # argparse shows ArgumentTypeError's message as is
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = spec.kind.__name__
    return parse


def resolve(
    cls: type[T],
    args: argparse.Namespace,
    environ: Mapping[str, str] = os.environ,
) -> T:
    """The settings object: each field from its flag, else its variable, else its default.

    Raises SettingError naming the variable of a value that does not parse, or the flag and variable
    of a required setting given neither way."""
    values = {}
    missing = []
    for spec in specs(cls):  # every value is parsed first: a bad one is named before a missing one
        flagged = getattr(args, spec.name, None)
        if flagged is not None:
            value = spec.repeat(flagged) if spec.repeat else flagged
        else:
            value = env_value(spec.env, spec.parse_env, spec.default, environ)
        if spec.meta.required and _empty(value):
            missing.append(
                f"give {spec.name.upper() if spec.meta.positional else spec.flag} (or set {spec.env})"
            )
        values[spec.name] = value
    for foreign in given(args):  # e.g. vLLM's --enable-auto-tool-choice needs --tool-call-parser
        if foreign.requires is not None and _empty(values[foreign.requires]):
            spec = next(s for s in specs(cls) if s.name == foreign.requires)
            missing.append(f"{foreign.flag} needs {spec.flag} (or {spec.env})")
    if missing:
        raise SettingError("; ".join(missing))
    return cls(**values)


def carry_over(settings: Any, target: type[T], **overrides: Any) -> T:
    """``target`` (a dataclass of a lower layer) built from the same-named fields of ``settings``,
    then ``overrides``: the settings object is handed down, never argv or os.environ."""
    shared = {f.name for f in dataclasses.fields(target)} & {f.name for f in dataclasses.fields(settings)}
    return target(**({name: getattr(settings, name) for name in shared} | overrides))


def env_names(cls: type) -> frozenset[str]:
    """Every environment variable a settings class reads."""
    return frozenset(spec.env for spec in specs(cls))


def group(settings: Any, name: str) -> dict[str, Any]:
    """The fields of one group that are set (not None, not an empty repeatable), as keyword arguments."""
    return {
        spec.name: getattr(settings, spec.name)
        for spec in specs(type(settings))
        if spec.meta.group == name and not _empty(getattr(settings, spec.name))
    }


def markdown_table(cls: type) -> str:
    """The flag table of a program's settings (docs/reference/flags.md): flag, variable, default, meaning."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for spec in specs(cls):
        flag = spec.name.upper() if spec.meta.positional else spec.flag
        default = _table_default(spec)
        text = spec.meta.help.replace("|", "\\|")
        if spec.meta.choices:
            text += " (" + " \\| ".join(f"`{c}`" for c in spec.meta.choices) + ")"
        if spec.repeat:
            text += "; repeatable (comma-separated in the variable)"
        rows.append(f"| `{flag}` | `{spec.env}` | {default} | {text} |")
    return "\n".join(rows)


def foreign_table(cls: type) -> str:
    """The table of the other program's flags (``FOREIGN_PROGRAM``'s) and what this program does with
    each: its own flag under the same name (``shared``), another name for one of its flags
    (``aliases``), accepted as already so, or refused with what to use instead (``FOREIGN_FLAGS``)."""
    program = foreign_program(cls)
    rows = [f"| {program} flag | keepwarm | what happens |", "|---|---|---|"]
    for spec in specs(cls):
        text = spec.meta.help.replace("|", "\\|")
        if spec.meta.shared:
            rows.append(f"| `{spec.flag}` | `{spec.flag}` | the same flag: {text} |")
        for alias in spec.meta.aliases:
            rows.append(f"| `{alias}` | `{spec.flag}` | another name for it: {text} |")
    for foreign in foreign_flags(cls):
        flags = ", ".join(f"`{f}`" for f in foreign.flags)
        answer = foreign.answer.replace("|", "\\|")
        if foreign.refuse:
            rows.append(f"| {flags} | refused | {answer} |")
        else:
            rows.append(f"| {flags} | accepted | {answer} |")
    return "\n".join(rows)


def _table_default(spec: Spec) -> str:
    if spec.meta.required:
        return "required"
    if _empty(spec.default):
        return spec.meta.unset or ""
    return f"`{_show(spec.default)}`"
