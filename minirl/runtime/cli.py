"""Command-line plumbing shared by the chapter scripts: flags made from config dataclasses.

Hand-written (it teaches nothing). The flags of a chapter script are generated from the
fields of its config dataclass (one source, so flag and field cannot drift): a field
`max_completion_length: int = 4   # new tokens per completion` becomes
`--max-completion-length INT`, with the field's comment and default as its help. A nested
dataclass (`RLConfig.sampling`) becomes an argument group. A bad value is reported by
argparse, naming the flag, before anything is loaded: `error: argument
--max-completion-length: 0: must be >= 1`, exit status 2.

Every script made by `common_parser` also takes `--config FILE.yaml` (TRL's convention): a
YAML mapping of settings named as the flags' destinations (`learning_rate: 1.0e-5`; a `-`
for `_` is accepted too). Its values become flags placed before the command line's, so they
are typed and checked exactly as flags are, and a flag typed on the command line overrides
the file. `merged_settings` gives every setting's final value, for summary.json (and it is
itself a valid config file).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import os
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

from minirl.runtime.io import write_summary  # noqa: F401  (re-exported for the chapter scripts)
from minirl.runtime.smollm2 import resolve_model_name  # light (no torch): the alias smollm2 -> its directory
from minirl.runtime.trl_config import TRLConfigError, translate
from minirl.runtime.validate import ConfigError


def __getattr__(name: str):
    """`seed_everything`, re-exported for the chapter scripts, imported (with torch) only when asked for: a
    script can build its parser from this module and refuse a bad command line before torch loads."""
    if name == "seed_everything":
        from minirl.runtime.seeding import seed_everything
        return seed_everything
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ConfigFileParser(argparse.ArgumentParser):
    """An ArgumentParser with `--config FILE.yaml`: the file's settings, then the command line's flags.

    The file is a YAML mapping {setting: value}; a setting is a flag's destination
    (`num_generations` for `--num-generations`). Each value becomes that flag's tokens, put
    before the command line (so the last, the typed flag, wins; a repeatable flag typed on the
    command line replaces the file's list instead of adding to it): `true`/`false` for a switch,
    a list for a flag that takes several values or repeats. Errors name the file: an unknown
    setting (with the nearest valid names), a value a flag would refuse, a file that is not
    a YAML mapping.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--config", type=Path, default=None, metavar="FILE.yaml",
                          help="a YAML file of settings named as the flags, with _ (TRL's convention: "
                               "learning_rate: 1.0e-5); flags on the command line override it")
        self._from_config: tuple[Path, dict[str, list[str]]] | None = None
        self.given: set[str] = set()       # after parsing: the dests set by a typed flag or the --config file

    def settings(self) -> dict[str, argparse.Action]:
        """{setting name: its action} for every flag a config file may set."""
        return {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "config")
                and a.dest != argparse.SUPPRESS}

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        probe, _ = super().parse_known_args(args, argparse.Namespace())
        path = getattr(probe, "config", None)
        typed = self._typed(args)
        self.given = typed                 # the settings the user gave: typed, or (below) in the --config file
        if path is None:
            return super().parse_known_args(args, namespace)
        tokens = {dest: toks for dest, toks in self._config_tokens(Path(path)).items() if dest not in typed}
        self._from_config = (Path(path), {d: self.settings()[d].option_strings for d in tokens})
        self.given = typed | set(tokens)
        return super().parse_known_args([t for toks in tokens.values() for t in toks] + args, namespace)

    def error(self, message):
        """argparse's error, saying where a setting came from when it came from the config file."""
        if self._from_config is not None:
            path, options = self._from_config
            if any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", message) for opts in options.values()
                   for o in opts):
                message = f"{message} (set in --config {path})"
        super().error(message)

    def _typed(self, args: list[str]) -> set[str]:
        """Destinations of the flags typed in `args` (the config file is not read)."""
        saved = [(action, action.default) for action in self._actions]
        try:
            for action, _ in saved:
                action.default = argparse.SUPPRESS
            namespace, _ = super().parse_known_args(args, argparse.Namespace())
        finally:
            for action, default in saved:
                action.default = default
        return set(vars(namespace))

    def _config_tokens(self, path: Path) -> dict[str, list[str]]:
        """{setting: its command-line tokens} from the YAML file at `path`; parser errors naming the file."""
        import yaml  # imported here: only a script given --config needs it

        where = f"argument --config: {path}"
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as err:
            self.error(f"{where}: cannot be read ({err.strerror or err}); give a YAML file of settings")
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = f" on line {mark.line + 1}" if mark is not None else ""
            self.error(f"{where}: not valid YAML{line} ({getattr(err, 'problem', None) or err}); fix the file")
        data = {} if data is None else data
        if not isinstance(data, dict):
            self.error(f"{where}: holds a {type(data).__name__}, not a mapping of settings (learning_rate: 1.0e-5)")
        settings, tokens = self.settings(), {}
        try:      # TRL's GRPOConfig names: renamed to the chapter's, ignored with one line, or refused
            data, ignored = translate(data, set(settings), int(os.environ.get("WORLD_SIZE", 1)))
        except TRLConfigError as err:
            self.error(f"{where}: {err}")
        if ignored:
            print(f"--config {path}: TRL settings this chapter does not use, ignored: {'; '.join(ignored)}",
                  file=sys.stderr)
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name == "config":
                self.error(f"{where}: a config file cannot name another (config: {value}); merge the two files")
            if name not in settings:
                close = difflib.get_close_matches(name, settings, n=3, cutoff=0.6)
                hint = f"did you mean {', '.join(close)}?" if close else "the settings are the flags' names with _ " \
                                                                        "(--help lists them)"
                self.error(f"{where}: {key!r} is no setting; {hint}")
            tokens[name] = self._tokens(settings[name], value, f"{where}: {key}")
        return tokens

    def _tokens(self, action: argparse.Action, value, where: str) -> list[str]:
        """The command-line tokens that set `action` to the YAML `value`."""
        option = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            if not isinstance(value, bool):
                self.error(f"{where}: {value!r}: give true or false")
            if isinstance(action, argparse.BooleanOptionalAction):
                return [option if value else "--no-" + option[2:]]
            return [option] if value == action.const else []      # store_true: true sets it, false leaves it
        if value is None and action.default is None:
            return []                                                # null: the flag's default, "not given"
        if isinstance(value, dict):
            self.error(f"{where}: a mapping; give a value (or a list of values)")
        values = value if isinstance(value, list) else [value]
        if isinstance(action, argparse._AppendAction):
            return [f"{option}={_yaml_token(v)}" for v in values]
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):
            if not values and action.nargs != "*":
                self.error(f"{where}: an empty list; give at least one value")
            return [option, *map(_yaml_token, values)]
        if isinstance(value, list):
            self.error(f"{where}: a list; {option} takes one value")
        return [f"{option}={_yaml_token(value)}"]


def _yaml_token(value) -> str:
    """A YAML scalar as a command-line token: null -> "none" (what optional settings parse), a float -> its repr."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


def merged_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """{setting: final value} of every flag, after the config file and the command line, as JSON values.

    What summary.json records; written out as YAML it is a config file that repeats the run.
    """
    actions = parser.settings() if isinstance(parser, ConfigFileParser) else \
        {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    def plain(value):
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return {dest: plain(getattr(args, dest)) for dest in actions if hasattr(args, dest)}


def common_parser(description: str, seed: bool = True, device: bool = True) -> ConfigFileParser:
    """An ArgumentParser with the flags every chapter script shares: --out, --model, --config (and --seed,
    --device, unless the script's config dataclass brings its own)."""
    parser = ConfigFileParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                              usage="%(prog)s [--out DIR] [options]   (--help lists every option)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "latest",
                        help="directory for summary.json, metrics and plots (default: %(default)s)")
    parser.add_argument("--model", default=None, type=resolve_model_name,
                        help="any HF causal LM id or local directory, or smollm2 (SmolLM2-135M-Instruct, converted "
                             "by chapters/00_warm_start.py --real-model) (default: the embedded policy)")
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


def add_config_flags(parser: argparse.ArgumentParser, config, skip: tuple[str, ...] = (),
                     choices: dict | None = None) -> None:
    """Add one flag per leaf field of the (nested) dataclass instance `config`, its values as defaults.

    Choices come from the dataclass's `choices` class attribute ({field: allowed values}) and
    from `choices` (a registry the dataclass's layer cannot import, e.g. the engines' names),
    help from the comment on the field's line. Fields named in `skip` get no flag.
    """
    groups = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
              if dataclasses.is_dataclass(getattr(config, f.name))] or [("options", config)]
    for title, sub in groups:
        group = parser.add_argument_group(title)
        comments, hints = field_comments(type(sub)), typing.get_type_hints(type(sub))
        allowed_by_field = getattr(type(sub), "choices", {}) | (choices or {})
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
                allowed = allowed_by_field.get(f.name)
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


def check_device(parser: argparse.ArgumentParser, device: str, dest: str = "device") -> None:
    """A parser error (one line, exit status 2) when `device` cannot run on this machine; see `device_problem`."""
    from minirl.runtime.validate import device_problem

    problem = device_problem(device)
    if problem is not None:
        parser.error(f"argument {flag(dest)}: {device!r}: {problem}")
