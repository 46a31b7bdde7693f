"""Command-line plumbing of the chapter scripts that train (01, 04, 06, 07): run directory, --model, --resume, task.

Hand-written (it teaches nothing): every training chapter checks its run directory (free, and
writable) and `--model` before anything loads, and on `--resume` takes the run's own settings
back from its `run.json`, letting only the flags that cannot change what was computed differ;
the task flags (`--dataset`, `--eval-dataset`, `--reward`, `--reward-weights`) and the task they
build are the same in every chapter. `run.json` also records a content hash of every file the
task reads (`data_record`): a resume whose data or reward file changed since is refused, naming
the file, unless `--allow-changed-data`. One copy, so that the scripts cannot drift apart.

Importing this module is light (no torch): a chapter can build its parser from it and refuse a
bad command line before the heavy imports; the functions import what they need.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import importlib.machinery
import os
import re
import sys
import tempfile
from pathlib import Path

from minirl.config import RLConfig
from minirl.rollout.registry import ENGINES, check_engine
from minirl.runtime.cli import add_config_flags, explicit_dests, flag
from minirl.runtime.rundir import RunDirError, check_run_dir, read_run_record
from minirl.runtime.validate import ConfigError

LOG_COMPLETIONS = 4   # the chapters' --log-completions (RLConfig's 0 is TRL's log_completions False)
TASK_FLAGS = ("dataset", "eval_dataset", "dataset_columns", "reward", "reward_weights")   # run.json's "task"
BUILT_IN_REWARDS = ("arithmetic", "math", "format")  # minirl.tasks.rewards.REWARDS' names (a test keeps them equal)
REWARD_SPEC_HELP = (f"a built-in ({', '.join(BUILT_IN_REWARDS)}) or module:function (my_rewards:length_penalty, "
                    "my_rewards.length_penalty as TRL writes it, or path/to/rewards.py:length_penalty)")
# rewards.SPEC_HELP, without importing torch


def add_rl_flags(parser: argparse.ArgumentParser, config: RLConfig, skip: tuple[str, ...] = ()) -> None:
    """A flag per setting of `config` (`add_config_flags`), --rollout-engine taking the engine registry's names
    (every notebook's engines: the registry names them without importing any); a chapter logs
    `LOG_COMPLETIONS` completions per logged step unless its config logs some already."""
    config = config if config.run.log_completions else config.replace(log_completions=LOG_COMPLETIONS)
    add_config_flags(parser, config, skip, choices={"rollout_engine": tuple(ENGINES)})


def check_engine_flag(parser: argparse.ArgumentParser, config: RLConfig) -> None:
    """Refuse, in one line and before torch or a model loads, an engine this run cannot use (vLLM without vLLM
    or CUDA): `minirl.rollout.registry.check_engine`, reported against --rollout-engine (exit 2)."""
    try:
        check_engine(config)
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")


def out_problem(path) -> str | None:
    """Why nothing can be written at `path` (a read-only file system or directory, a full disk), or None.

    Tries a temporary file in `path`, or in its nearest existing parent when it does not exist yet.
    """
    where = Path(path).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        with tempfile.TemporaryFile(dir=where):
            return None
    except OSError as err:
        return f"cannot write in {where} ({err.strerror or err}); pass a writable --out"


def write_failure(err: OSError, out) -> str | None:
    """The one line for an OSError of writing the run (disk full, read-only, no permission), or None for another."""
    if err.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT):
        return None
    advice = "free some space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return (f"cannot write {err.filename or out} ({err.strerror}): {advice}, or pass another --out; nothing "
            "half-written is promoted (checkpoints are renamed into place once whole)")


def model_path_problem(name: str | None) -> str | None:
    """Why --model cannot load, known without torch: a path (absolute, ./, ../ or ~/...: never a hub id) that does
    not exist; else None (the rest, a directory's files and a hub id's form, is `check_model_source`'s)."""
    if name is None or not (Path(name).is_absolute() or name.startswith((".", "~"))):
        return None
    if Path(name).expanduser().exists():
        return None
    return "no such directory, and not a hub id (a hub id looks like 'Qwen/Qwen2.5-0.5B')"


def check_run_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--out` (free, or ours with --resume / --overwrite; writable) and `--model` (a directory or a hub id),
    before loading; a missing --out directory or --model path is refused before torch is imported."""
    try:
        check_run_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    except RunDirError as err:
        parser.error(str(err))
    problem = out_problem(args.out)
    if problem is not None:
        parser.error(f"argument --out: {args.out}: {problem}")
    if (problem := model_path_problem(args.model)) is not None:
        parser.error(f"argument --model: {args.model}: {problem}")
    if args.model is not None:
        from minirl.runtime.model_loading import ModelSourceError, check_model_source  # noqa: PLC0415 (torch)

        try:
            check_model_source(args.model)          # a directory without config.json, a malformed hub id
        except ModelSourceError as err:
            parser.error(f"argument --model: {err}")


def resumed_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None,
                   also: dict | None = None, safe: tuple[str, ...] | None = None) -> tuple[RLConfig, dict]:
    """(the run's RLConfig with the typed safe flags applied, its run.json record) for `--resume`.

    Sets `args.model` to the run's model. A typed flag that would change the run's settings
    (or those in `also`, {flag dest: saved value}, e.g. a parallel config) is a parser error
    naming each one; so is another `--model`. safe: the dests that may change (a script with
    more bookkeeping flags, such as chapter 07's --snapshot-every, names its own; default stage 1's
    SAFE_ON_RESUME).
    """
    if safe is None:
        from minirl.runtime.callbacks import SAFE_ON_RESUME  # noqa: PLC0415 (torch: after parsing)
        safe = SAFE_ON_RESUME
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
    resume_command: the command that continues the run. Without a checkpoint there is nothing to resume
    (`--resume` would be refused): the line says so and gives that command with --overwrite instead.
    """
    if checkpoint:
        return f"{what}: the last intact checkpoint is {checkpoint}; continue with: {resume_command}"
    again = re.sub(r"(?<!\S)--resume(?!\S)", "--overwrite", resume_command)
    return f"{what}: no checkpoint was written yet; start the run again with: {again}"


def write_stop(err: OSError, out, resume_command: str) -> int:
    """For `except OSError` around a run: a failed write (a full or read-only disk: `write_failure`) prints its one
    line, with the last intact checkpoint and the command that goes on, and gives exit status 1; another
    OSError is raised again."""
    line = write_failure(err, out)
    if line is None:
        raise err
    print(stop_line(f"error: {line}", last_checkpoint(out), resume_command), file=sys.stderr, flush=True)
    return 1


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """--dataset, --eval-dataset, --reward (repeatable), --reward-weights: the task of every training chapter."""
    group = parser.add_argument_group("task (default: the embedded arithmetic task)")
    group.add_argument("--dataset", default=None, metavar="PATH_OR_ID",
                       help="training rows: a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk directory, or "
                            "a dataset id (org/name[:config], through datasets.load_dataset), with a 'prompt' column "
                            "(text or chat messages); its other columns go to the rewards")
    group.add_argument("--dataset-columns", nargs="+", type=column_pair, default=None, metavar="OLD=NEW",
                       help="rename columns of --dataset and --eval-dataset first: question=prompt answer=solution")
    group.add_argument("--eval-dataset", default=None, metavar="PATH",
                       help="held-out rows, decoded greedily and scored by the rewards (default: the embedded task's "
                            "held-out split without --dataset, else no evaluation)")
    group.add_argument("--reward", action="append", default=None, metavar="NAME_OR_MODULE:FUNCTION",
                       help=f"a reward function, repeatable: {REWARD_SPEC_HELP} (default: arithmetic)")
    group.add_argument("--reward-weights", type=float, nargs="+", default=None, metavar="W",
                       help="one weight per --reward, in their order (default: 1 each)")
    group.add_argument("--allow-changed-data", action="store_true",
                       help="--resume even though a --dataset, --eval-dataset or --reward file changed since the run "
                            "started (run.json records their content hashes, and then what changed)")


def column_pair(text: str) -> list[str]:
    """--dataset-columns' OLD=NEW as [OLD, NEW] (a list: JSON keeps it as it is, for run.json)."""
    old, sep, new = text.partition("=")
    if not (sep and old.strip() and new.strip()):
        raise argparse.ArgumentTypeError(f"{text!r}: write OLD=NEW, e.g. question=prompt")
    return [old.strip(), new.strip()]


def resolve_task_paths(args: argparse.Namespace) -> None:
    """One spelling of --dataset and --eval-dataset (absolute; a dataset id as it is): run.json records it,
    --resume compares it."""
    from minirl.runtime.data_files import is_dataset_id  # noqa: PLC0415

    for dest in ("dataset", "eval_dataset"):
        if getattr(args, dest) is not None and not is_dataset_id(getattr(args, dest)):
            setattr(args, dest, str(Path(getattr(args, dest)).expanduser().resolve()))


def saved_task(args: argparse.Namespace) -> dict:
    """On --resume: the task flags as the run's run.json records them (compare with `resumed_config(also=...)`,
    then `restore_task_flags`)."""
    return read_run_record(args.out).get("task") or dict.fromkeys(TASK_FLAGS)


def restore_untyped(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None,
                    saved: dict) -> None:
    """On --resume: each flag of `saved` ({dest: value}, what run.json recorded) not typed now (nor set by --config)
    takes the run's value, so that `--out OUT --resume` alone continues the run where it ran (chapter 06's
    --placement, --pools, --sync, --address)."""
    typed = explicit_dests(parser, argv)
    for dest, value in saved.items():
        if dest not in typed:
            setattr(args, dest, value)


def restore_task_flags(args: argparse.Namespace, saved: dict) -> None:
    """Put the run's own task flags (`saved_task`) into args."""
    for dest in TASK_FLAGS:
        setattr(args, dest, saved.get(dest))


def content_hash(path: Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (their paths relative to it, and their bytes)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(f"{file.relative_to(path).as_posix()}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def reward_file(spec: str) -> Path | None:
    """The file a --reward spec's function is loaded from (rewards._import's rule), found without importing it;
    None for a built-in, or a module not found (loading the task names that)."""
    module, sep, _ = spec.strip().rpartition(":")
    if spec.strip() in BUILT_IN_REWARDS or not sep or not module:
        return None
    if module.endswith(".py") or os.sep in module or "/" in module:
        return Path(module).expanduser()
    found, where = None, [os.getcwd(), *sys.path]              # as rewards._import: beside the working directory
    for part in module.split("."):
        found = importlib.machinery.PathFinder.find_spec(part if found is None else f"{found.name}.{part}", where)
        if found is None:
            return None
        where = found.submodule_search_locations or []
    return Path(found.origin) if found.origin else None


def data_record(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """run.json's "data_files", [{"flag", "path", "sha256"}] of each file the task reads (--dataset, --eval-dataset,
    each --reward loaded from a file), and "changed_data" (the changes --allow-changed-data let resumes go on with).

    Call it once the task flags are final (on --resume, the run's own: after `restore_task_flags`). On --resume a
    file whose content differs from the hash its run.json recorded is a parser error naming the flag and the file,
    unless --allow-changed-data. The embedded task and the built-in rewards are the package's: not hashed; a run.json
    written before hashes were recorded has nothing to compare.
    """
    files = [(flag(dest), Path(getattr(args, dest))) for dest in ("dataset", "eval_dataset")
             if getattr(args, dest) is not None]
    files += [("--reward", path) for spec in args.reward or [] if (path := reward_file(spec)) is not None]
    data = [{"flag": name, "path": str(path.resolve()), "sha256": content_hash(path)} for name, path in files
            if path.exists()]
    record = read_run_record(args.out) if args.resume else {}
    changed, now = list(record.get("changed_data", [])), {entry["path"]: entry["sha256"] for entry in data}
    for entry in record.get("data_files", []):
        if now.get(entry["path"]) == entry["sha256"]:
            continue
        if not args.allow_changed_data:
            what = "is gone" if entry["path"] not in now else "changed"
            parser.error(f"--resume: {entry['flag']} {entry['path']} {what} since the run started (run.json has its "
                         f"sha256 {entry['sha256'][:12]}, now {now.get(entry['path'], 'none')[:12]}); put it back "
                         "as it was, or pass --allow-changed-data to go on with it as it is now")
        changed.append({**entry, "sha256_now": now.get(entry["path"])})
    return {"data_files": data, "changed_data": changed}


def tokenizer_only(parser: argparse.ArgumentParser, name: str | None):
    """The tokenizer of --model, loaded alone (a chat template is checked before the model loads)."""
    if name is None:
        return None                                   # the embedded policy's tokenizer has no chat template
    from minirl.runtime.policy_cache import load_tokenizer  # noqa: PLC0415 (transformers: after parsing)

    try:
        return load_tokenizer(name)
    except Exception as err:                           # offline hub ids, damaged files: one line, as load_policy's
        parser.error(f"argument --model: {name}: its tokenizer does not load ({type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''})")


def task_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The run's Task from --dataset, --eval-dataset, --reward, --reward-weights; a parser error before loading."""
    from minirl.runtime.data_files import is_dataset_id, load_rows  # noqa: PLC0415
    from minirl.runtime.task_files import load_task  # noqa: PLC0415 (torch: after parsing)

    tokenizer = tokenizer_only(parser, args.model) if args.dataset or args.eval_dataset else None
    columns = dict(getattr(args, "dataset_columns", None) or [])
    try:            # an id or renamed columns: read here (a file is read by load_task, which names it in errors)
        dataset, eval_dataset = (load_rows(spec, dest, columns) if spec and (columns or is_dataset_id(spec)) else spec
                                 for dest, spec in (("dataset", args.dataset), ("eval_dataset", args.eval_dataset)))
        return load_task(dataset, eval_dataset, args.reward, args.reward_weights, tokenizer=tokenizer,
                         reward_errors=getattr(args, "reward_errors", "raise"))
    except ConfigError as err:
        value = err.value if isinstance(err.value, str) else " ".join(map(str, err.value or []))
        parser.error(f"argument {flag(err.name)}: {value + ': ' if value else ''}{err.why}")


def check_task_prompts(task, tokenizer, model, config: RLConfig, args: argparse.Namespace) -> None:
    """Every prompt of the task's two splits fits `model` (known characters, room to generate); PromptError naming
    the flag (--dataset, --eval-dataset) and the file otherwise. Call it once the model is loaded, before training."""
    from minirl.runtime.model_loading import PromptError, check_prompts  # noqa: PLC0415 (torch: after parsing)

    context = getattr(model.config, "max_position_embeddings", None)
    max_new_tokens = task.max_new_tokens or config.sampling.max_completion_length
    for dest, rows, new in (("dataset", task.train, config.sampling.max_completion_length),
                            ("eval_dataset", task.test, max_new_tokens)):
        try:
            if rows:
                check_prompts(tokenizer, [r["prompt"] for r in rows], context, new)
        except PromptError as err:
            raise PromptError(f"{flag(dest)} {getattr(args, dest) or '(the embedded task)'}: {err}") from None


def data_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, config: RLConfig, task) -> RLConfig:
    """The run's config with the defaults that fit its data; `args.defaults` says which set applied, for summary.json.

    With --dataset (the user's data): every setting of `trl_config.TRL_DEFAULTS` (max_completion_length,
    learning_rate, seed, lr_scheduler_type, warmup_steps) the chapter has and the user did not give (a typed flag
    or a --config key always wins) takes TRL 1.16's GRPOConfig default: "trl". Without it, the embedded task keeps
    the chapter's own, tuned for it: "embedded". TRL's max_completion_length is lowered to what --model's context
    leaves after the longest prompt, when that is less (said in one line). On --resume the run keeps its own
    settings: the config is run.json's, and the other flags take the values run.json recorded. Call it once the
    task is built (on --resume, with the run's own task flags restored).
    """
    from minirl.runtime.trl_config import TRL_DEFAULTS  # noqa: PLC0415

    args.defaults = "embedded" if args.dataset is None else "trl"
    given = getattr(parser, "given", None)
    given = explicit_dests(parser, None) if given is None else given
    if args.resume:
        recorded = read_run_record(args.out).get("settings") or {}
        for dest, value in {**recorded, **config.flat()}.items():        # what the run was started with
            if dest not in given and hasattr(args, dest) and (dest in TRL_DEFAULTS or dest in config.flat()):
                setattr(args, dest, value)
        return config
    if args.defaults == "embedded":
        return config
    changes = {k: v for k, v in TRL_DEFAULTS.items() if hasattr(args, k) and k not in given and getattr(args, k) != v}
    shown = {k: str(v) for k, v in changes.items()}
    if "max_completion_length" in changes:
        room = room_to_generate(parser, args.model, task)
        if room is not None and 0 < room < changes["max_completion_length"]:
            shown["max_completion_length"] = (f"{room} (what --model's context leaves after the longest prompt; "
                                              f"TRL's is {changes['max_completion_length']})")
            changes["max_completion_length"] = room
    for dest, value in changes.items():
        setattr(args, dest, value)
    if changes:
        print("--dataset: TRL's defaults where nothing was set (the embedded task's are tuned for it alone): "
              + ", ".join(f"{k} {v}" for k, v in shown.items()), file=sys.stderr)
    try:
        return config.replace(**{k: v for k, v in changes.items() if k in config.flat()})
    except ConfigError as err:
        parser.error(f"argument {flag(err.name)}: {err.value!r}: {err.why}")


def room_to_generate(parser: argparse.ArgumentParser, model: str | None, task) -> int | None:
    """Positions --model's context (the embedded policy's without it) leaves after the task's longest prompt
    (training or held-out); None when unknown (a config without max_position_embeddings, a model that does not
    load here, an embedded policy not built yet)."""
    from transformers import AutoConfig  # noqa: PLC0415 (after parsing)

    if model is None:
        from minirl.models.policy import default_policy_dir  # noqa: PLC0415

        model = str(default_policy_dir())
        if not (Path(model) / "config.json").is_file():
            return None
    try:
        context = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    except Exception:                                 # offline, damaged: the model's loading says so later
        return None
    prompts = [r["prompt"] for r in [*task.train, *task.test] if isinstance(r.get("prompt"), str)]
    if context is None or not prompts:
        return None
    tokenizer = tokenizer_only(parser, model)
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    return context - longest


def task_summary(task, args: argparse.Namespace) -> dict:
    """summary.json's "task": its name, flags, reward names and weights, held-out rows and metric."""
    metric = f"accuracy ({task.accuracy_reward})" if task.accuracy_reward else "mean weighted reward"
    return {"name": task.name, **{k: getattr(args, k) for k in TASK_FLAGS}, "rewards": task.reward_names,
            "reward_weights": task.reward_weights, "eval_rows": len(task.test), "eval_metric": metric}


def summary_extras(args: argparse.Namespace, records: list[dict]) -> dict:
    """summary.json's "defaults" (the set `data_defaults` applied: "trl" or "embedded") and the last held-out
    evaluation's `eval/` metrics among `records` (each reward function's mean, as TRL names them)."""
    evals = [r for r in records if "accuracy" in r]
    return {"defaults": getattr(args, "defaults", None),
            **{k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval/")}}


def held_out_line(task, summary: dict, seconds: float) -> str:
    """The line a training chapter ends with: held-out metric before -> after, in points, steps and seconds."""
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    what = "greedy accuracy" if task.accuracy_reward else "greedy mean weighted reward"
    return (f"held-out {what} {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points) in "
            f"{summary['steps']} steps, {seconds:.0f} s")


def interrupted_line(out, resume_command: str) -> str:
    """stop_line for Ctrl-C: the newest intact checkpoint under out/checkpoints (verified as a resume would)."""
    return stop_line("interrupted", last_checkpoint(out), resume_command)


def last_checkpoint(out):
    """The newest intact checkpoint's path under out/checkpoints, or None (broken newer ones are skipped)."""
    import warnings  # noqa: PLC0415

    from minirl.runtime.checkpoint import latest_checkpoint  # noqa: PLC0415 (torch)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # a broken newer one is named when the run resumes
        found = latest_checkpoint(Path(out) / "checkpoints")
    return None if found is None else found[0]


def resume_command(out, script: str | None = None) -> str:
    """`python SCRIPT --out OUT --resume`: the command that continues the run in `out`."""
    return f"python {script or sys.argv[0]} --out {out} --resume"
