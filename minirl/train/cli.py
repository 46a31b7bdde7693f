"""Command-line plumbing of the chapter scripts that train (01, 04, 06): the run directory, --model, --resume.

Hand-written (it teaches nothing): every training chapter checks its run directory and
`--model` before anything loads, and on `--resume` takes the run's own settings back from its
`run.json`, letting only the flags that cannot change what was computed differ. One copy, so
that the three scripts cannot drift apart.
"""

from __future__ import annotations

import argparse

from minirl.config import RLConfig
from minirl.models.policy import ModelSourceError, check_model_source
from minirl.train.run import SAFE_ON_RESUME
from minirl.utils.cli import explicit_dests, flag
from minirl.utils.rundir import RunDirError, check_run_dir, read_run_record
from minirl.utils.validate import ConfigError


def check_run_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--out` (free, or ours with --resume / --overwrite) and `--model` (a directory or a hub id), before loading."""
    try:
        check_run_dir(args.out, resume=args.resume, overwrite=args.overwrite)
        if args.model is not None:
            check_model_source(args.model)          # a missing directory is named before anything loads
    except (RunDirError, ModelSourceError) as err:
        parser.error(str(err))


def resumed_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None,
                   also: dict | None = None, safe: tuple[str, ...] = SAFE_ON_RESUME) -> tuple[RLConfig, dict]:
    """(the run's RLConfig with the typed safe flags applied, its run.json record) for `--resume`.

    Sets `args.model` to the run's model. A typed flag that would change the run's settings
    (or those in `also`, {flag dest: saved value}, e.g. a parallel config) is a parser error
    naming each one; so is another `--model`. safe: the dests that may change (a script with
    more bookkeeping flags, such as chapter 07's --snapshot-every, names its own).
    """
    record = read_run_record(args.out)
    saved = RLConfig.from_dict(record["config"])
    if args.model is None:
        args.model = record.get("model")
    elif args.model != record.get("model"):
        parser.error(f"--resume: the run in {args.out} trained {record.get('model') or 'the embedded policy'}, "
                     f"not --model {args.model}; drop --model to resume it")
    typed = explicit_dests(parser, argv)
    olds = saved.flat() | (also or {})
    changed = [f"{flag(k)} {olds[k]!r} -> {getattr(args, k)!r}" for k in sorted(typed & set(olds))
               if k not in safe and olds[k] != getattr(args, k)]
    if changed:
        parser.error(f"--resume: the run in {args.out} was started with other settings ({'; '.join(changed)}); "
                     f"only {', '.join(flag(k) for k in safe)} may change on resume")
    try:
        return saved.replace(**{k: getattr(args, k) for k in typed & set(saved.flat())}), record
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")


def stop_line(what: str, checkpoint, resume_command: str) -> str:
    """The one line a training chapter prints when a run stops early (Ctrl-C, a dead rank, worker or producer).

    what: what happened, naming who died ("interrupted", "rank 1 (pid 4242) died", "the rollout worker on
    node 2 was killed by Ray's memory monitor"); checkpoint: the last intact checkpoint (a path) or None;
    resume_command: the command that continues the run.
    """
    where = f"the last intact checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
    return f"{what}: {where}; continue with: {resume_command}"
