"""Command-line plumbing shared by the chapter scripts: flags made from config dataclasses.

Hand-written (it teaches nothing). The flags of a chapter script are generated from the
fields of its config dataclass (one source, so flag and field cannot drift): a field
`max_completion_length: int = 4   # new tokens per completion` becomes
`--max-completion-length INT`, with the field's comment and default as its help. A nested
dataclass (`RLConfig.sampling`) becomes an argument group. A bad value is reported by
argparse, naming the flag, before anything is loaded: `error: argument
--max-completion-length: 0: must be >= 1`, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import tokenize
import types
import typing
from pathlib import Path

from minirl.utils.io import write_summary  # noqa: F401  (re-exported for the chapter scripts)
from minirl.utils.seeding import seed_everything  # noqa: F401  (re-exported for the chapter scripts)
from minirl.utils.validate import ConfigError


def common_parser(description: str, seed: bool = True, device: bool = True) -> argparse.ArgumentParser:
    """An ArgumentParser with the flags every chapter script shares: --out, --model (and --seed, --device,
    unless the script's config dataclass brings its own)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--out DIR] [options]   (--help lists every option)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "latest",
                        help="directory for summary.json, metrics and plots (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="any HF causal LM id or local directory (default: the embedded policy)")
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    return parser


def flag(name: str) -> str:
    """The command-line flag of a config field: max_completion_length -> --max-completion-length."""
    return "--" + name.replace("_", "-")


def field_comments(cls) -> dict[str, str]:
    """{field name: the comment on its line} from the dataclass's source ("" when it has none)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments, current = {}, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NEWLINE:
            current = None
        elif tok.type == tokenize.NAME and current is None and tok.start[1] == 4:
            current = tok.string                       # the first name on a class-body line
        elif tok.type == tokenize.COMMENT and current is not None:
            comments[current] = tok.string.lstrip("# ").strip()
    return comments


def _leaf_type(annotation):
    """(python type, optional?) of a field annotation such as `int`, `float | None`, `str`."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))    # noqa: S307 -- annotations of our own dataclasses
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return inner[0], len(inner) < len(args)
    return annotation, False


def _parse(kind, optional: bool, name: str):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    parse.__name__ = kind.__name__                     # argparse names the type in its messages
    return parse


def add_config_flags(parser: argparse.ArgumentParser, config, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per leaf field of the (nested) dataclass instance `config`, its values as defaults.

    Choices come from the dataclass's `choices` class attribute ({field: allowed values}),
    help from the comment on the field's line. Fields named in `skip` get no flag.
    """
    groups = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
              if dataclasses.is_dataclass(getattr(config, f.name))] or [("options", config)]
    for title, sub in groups:
        group = parser.add_argument_group(title)
        comments, hints = field_comments(type(sub)), typing.get_type_hints(type(sub))
        choices = getattr(type(sub), "choices", {})
        for f in dataclasses.fields(sub):
            if f.name in skip:
                continue
            kind, optional = _leaf_type(hints[f.name])
            default = getattr(sub, f.name)
            text = comments.get(f.name, "")
            help_ = f"{text} (default: {default})" if text else f"(default: {default})"
            if kind is bool:
                group.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=default, help=help_)
            else:
                allowed = choices.get(f.name)
                group.add_argument(flag(f.name), dest=f.name, type=_parse(kind, optional, f.name),
                                   default=default, choices=allowed, help=help_,
                                   metavar=None if allowed else kind.__name__.upper())


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, config):
    """A copy of `config` with every leaf field taken from `args`; a bad value exits via parser.error."""
    def rebuild(node):
        values = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                values[f.name] = rebuild(value)
            elif hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
        return dataclasses.replace(node, **values)
    try:
        return rebuild(config)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")


def check_args(parser: argparse.ArgumentParser, checks: dict[str, callable], args: argparse.Namespace) -> None:
    """Run `checks` ({dest: function(value) raising ConfigError}) on `args`, reporting the first failure."""
    for dest, check in checks.items():
        try:
            check(getattr(args, dest))
        except ConfigError as err:
            parser.error(f"argument {flag(dest)}: {err.value!r}: {err.why}")


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> set[str]:
    """The destinations of the flags the user typed in `argv` (not the ones left at their defaults)."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(namespace))
