"""Train a face-recognition backbone with a Partial FC head (DeepSpeed).

    deepspeed --num_gpus 8 launch/train.py --deepspeed_config configs/ms1mv2_r100_8gpu_fp16.json
    python launch/train.py                       # the CPU quickstart, one process (from a checkout)
    ds-pfc-train --deepspeed_config job.json     # the installed command

The config is DeepSpeed's JSON plus a ``ds_pfc`` block (see ds_pfc/app/config.py and the
README's configs table). Checkpoints, the csv monitor, the summary and the
safetensors export go to ``ds_pfc.train.output_dir``; a rerun resumes from the
newest complete checkpoint there (``--resume_from TAG`` picks another one; ``--resume``
resumes even where the config's ``ds_pfc.checkpoint.resume`` is false, ``--no_resume``
refuses to); a
rerun with changed settings is refused, listing them, unless
``--allow_config_change`` (or ``--allow_batch_change`` for another global batch).
``summary.json`` covers the whole run, across resumes: the loss of every step and
every evaluation since step 1 (strict JSON: ``null`` where a value is not a finite
number, e.g. a TAR the pairs cannot measure). ``training.log`` there holds rank 0's
console lines of every run, each under a header line. With
``ds_pfc.train.diagnostics.flip_mechanism`` on, ``summary.json`` also holds the
flip-mechanism numbers of every interval, keyed by the interval's last step (see
ds_pfc/app/diagnostics.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from .._args import parser
from ._launch import launch_env, leave_process_groups


def default_config() -> str | None:
    """The CPU quickstart config (shipped with the package), or None if it is missing."""
    from ..app.recipes import recipe_path
    try:
        return recipe_path("cpu_quickstart")
    except FileNotFoundError:
        return None


def _evaluation_json(results) -> dict:
    """One evaluation (``name -> VerificationResult``, or its plain form restored from a
    checkpoint) as JSON."""
    out = {}
    for name, r in results.items():
        if isinstance(r, dict):
            out[name] = {"accuracy": r["accuracy"], "accuracy_std": r["accuracy_std"],
                         "tar_at_far": {str(k): v for k, v in r["tar_at_far"].items()}}
        else:
            out[name] = {"accuracy": r.accuracy, "accuracy_std": r.accuracy_std,
                         "tar_at_far": {str(k): v for k, v in r.tar_at_far.items()}}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-train", __doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default=None, metavar="JOB",
                   help="job JSON file, or the name of a shipped config (--list-configs); default: cpu_quickstart, "
                        "the CPU quickstart")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="assignments",
                   help="set one config value, e.g. ds_pfc.train.max_steps=100 or optimizer.params.lr=0.05 "
                        "(repeatable; VALUE is read as JSON, else as a string; the key must be in the job or known "
                        "there, +KEY=VALUE adds a new one); kept in the checkpoints' config")
    p.add_argument("--list-configs", action="store_true", help="list the shipped configs and exit")
    p.add_argument("--schema", action="store_true",
                   help="print the JSON Schema of the job config (for editors) and exit")
    p.add_argument("--deepspeed", action="store_true",
                   help="accepted for DeepSpeed's usual command line; the app always trains through DeepSpeed")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--output_dir", default=None, help="overrides ds_pfc.train.output_dir")
    p.add_argument("--max_steps", type=int, default=None,
                   help="overrides ds_pfc.train.max_steps (0: write the initial state as a checkpoint and the "
                        "export, no training)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in the output directory, whatever "
                        "ds_pfc.checkpoint.resume says (a fresh start when there is none)")
    p.add_argument("--no_resume", action="store_true", help="start fresh (refused if checkpoints exist)")
    p.add_argument("--resume_from", default=None, metavar="TAG",
                   help="resume this checkpoint tag (e.g. step00004000) instead of the newest; newer tags move to "
                        "checkpoints/superseded/")
    p.add_argument("--allow_batch_change", action="store_true",
                   help="resume a checkpoint trained with another global batch (micro x accumulation x ranks)")
    p.add_argument("--allow_config_change", action="store_true",
                   help="resume a checkpoint trained with other settings that change training (head, margin, "
                        "sample rate, optimizer, lr/schedule, data, seeds, ...); the new values take effect")
    return p


def run(argv=None) -> dict | None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.list_configs:
        from ..app.recipes import recipe_dir, recipe_names, summary
        names = recipe_names()
        width = max(map(len, names), default=0)
        for name in names:
            print(f"{name:{width}}  {summary(name)}")
        print(f"({len(names)} configs in {recipe_dir()}; run one with ds-pfc-train --deepspeed_config NAME)")
        return None
    if args.schema:
        from ..app.schema import job_schema
        print(json.dumps(job_schema(), indent=1))
        return None
    if args.no_resume and (args.resume_from is not None or args.resume):
        p.error("--no_resume excludes --resume and --resume_from")
    if args.max_steps is not None and args.max_steps < 0:
        p.error(f"--max_steps must be >= 0 (0: write the initial state, no training), got {args.max_steps}")
    if args.deepspeed_config is None:
        args.deepspeed_config = default_config()
        if args.deepspeed_config is None:
            sys.exit("error: no job config: pass --deepspeed_config JOB.json (the shipped CPU quickstart, "
                     "cpu_quickstart, is missing from this installation)")

    launch_env()
    from ds_pfc.checkpoint.tags import CheckpointError, atomic_write
    from ds_pfc.app.config import ConfigError
    from ds_pfc.app.run_outputs import strict_json
    from ds_pfc.app.training import PREEMPTED_EXIT_CODE, Preempted, Trainer, TrainingStopped, load_config

    # What a user's input or environment can be wrong in: the config (its values, files,
    # data paths), the checkpoints, the batches (NaN, labels) and the collectives (NCCL,
    # timeouts). Anything else is a bug and keeps its traceback.
    user_errors = (ConfigError, CheckpointError, FileNotFoundError, TrainingStopped)
    trainer = None
    output_dir = [args.output_dir]

    def fail(err, user: bool):
        """One ``error:`` line on rank 0 (and in training.log), the full traceback of every
        rank in ``<output_dir>/errors/``; every rank exits with status 1."""
        rank = trainer.rank if hasattr(trainer, "world_size") else int(os.environ.get("RANK", "0") or 0)
        where = getattr(trainer, "output_dir", None) or output_dir[0]
        path = write_traceback(err, where, rank)
        text = " ".join(str(err).split("\n")) or type(err).__name__
        if not user:
            text = f"{type(err).__name__}: {text} (a bug in ds_pfc or a library it calls; please report it)"
        elif _collective_failure(err):
            text = f"{text} (a collective failed or timed out: see docs/troubleshooting.md)"
        line = f"error: {text}" + (f" (traceback: {path})" if path else "")
        if getattr(trainer, "_training_log", None) is not None:
            trainer.record(line)        # training.log, once it is open
        elif rank == 0 and where:
            log_error_line(where, line, config_path=args.deepspeed_config)   # before the run opened it
        if rank == 0:
            if not user:
                traceback.print_exception(err, file=sys.stderr)
            print(line, file=sys.stderr, flush=True)
        sys.exit(1)

    def refuse(err):
        fail(err, user=True)

    try:
        from ds_pfc.app.config import set_values
        from ds_pfc.app.recipes import resolve_config
        args.deepspeed_config = resolve_config(args.deepspeed_config)
        config = set_values(load_config(args.deepspeed_config), args.assignments)
        train_block = (config.get("ds_pfc") or {}).get("train") if isinstance(config, dict) else None
        if output_dir[0] is None and isinstance(train_block, dict) and isinstance(train_block.get("output_dir"), str):
            output_dir[0] = train_block["output_dir"]
        if args.no_resume or args.resume or args.resume_from is not None:
            # Asked for on the command line: it overrides the config's checkpoint.resume.
            checkpoint = config.setdefault("ds_pfc", {}).setdefault("checkpoint", {})
            if isinstance(checkpoint, dict):
                checkpoint["resume"] = not args.no_resume
        trainer = Trainer(config, output_dir=args.output_dir, max_steps=args.max_steps,
                          resume_from=args.resume_from, allow_batch_change=args.allow_batch_change,
                          allow_config_change=args.allow_config_change, config_path=args.deepspeed_config)
        trainer.setup()
        if trainer.rank == 0:
            # The config this run trains with (the file plus --set), beside its log.
            copy_path = os.path.join(trainer.output_dir, "config.json")
            atomic_write(copy_path, (json.dumps(config, indent=1) + "\n").encode())
            trainer.log(f"config: {copy_path} ({args.deepspeed_config}"
                        + (f" with --set {' '.join(args.assignments)}" if args.assignments else "") + ")")
    except (*user_errors, *_collective_errors()) as err:
        if trainer is not None:
            trainer.close()
        refuse(err)
    except Exception as err:
        if trainer is not None:
            trainer.close()
        fail(err, user=False)
    try:
        summary = trainer.run()
    except (*user_errors, *_collective_errors()) as err:
        refuse(err)
    except Preempted as err:
        # Every rank saved the same complete tag; rank 0 says so, and all exit for a requeue.
        trainer.record(f"preempted: {err}")
        if trainer.rank == 0:
            print(f"preempted: {err}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)
    except Exception as err:
        fail(err, user=False)
    finally:
        trainer.close()
    if trainer.rank == 0:
        history = trainer.history
        losses = summary["losses"]
        out = {"steps": history["start_step"] + len(losses), "first_loss_step": history["start_step"] + 1,
               "final_loss": losses[-1] if losses else None, "losses": losses,
               "elapsed_s": summary["elapsed_s"], "resumed": summary["resumed"],
               "train_elapsed_s": summary["train_elapsed_s"], "train_samples": summary["train_samples"],
               "checkpoint": summary["checkpoint"], "export": summary.get("export"),
               "evaluations": {str(step): _evaluation_json(results)
                               for step, results in sorted(summary["evaluations"].items())}}
        if history.get("nonfinite"):           # ds_pfc.train.on_nonfinite skip / rollback
            out["nonfinite"] = history["nonfinite"]
        if "flip_mechanism" in summary:       # ds_pfc.train.diagnostics.flip_mechanism
            out["flip_mechanism"] = {str(step): numbers for step, numbers in sorted(summary["flip_mechanism"].items())}
        path = os.path.join(trainer.output_dir, "summary.json")
        atomic_write(path, strict_json(out).encode())     # a TAR that cannot be measured: null
        trainer.log(f"summary {path}")
    return summary


def _collective_errors() -> tuple:
    """The exceptions of a failed or timed-out collective (NCCL's and Gloo's)."""
    import torch.distributed as dist
    return tuple(e for e in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None))
                 if e is not None)


def _collective_failure(err) -> bool:
    return isinstance(err, _collective_errors())


def log_error_line(output_dir: str, line: str, *, config_path: str | None) -> None:
    """Append ``line`` to ``<output_dir>/training.log`` under a header line of its own
    (:class:`~ds_pfc.app.run_outputs.TrainingLog`), for an error raised before the run
    opened the log (e.g. a refused config)."""
    from ds_pfc.app.run_outputs import TrainingLog
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world_size = 1
    try:
        TrainingLog(output_dir, config_path=config_path, world_size=world_size).write(line)
    except OSError:
        pass


def write_traceback(err: BaseException, output_dir: str | None, rank: int) -> str | None:
    """Write ``err``'s full traceback to ``<output_dir>/errors/rank<R>.txt`` (appended, under a
    time stamp); returns the path, or None when there is no output directory to write to."""
    if not output_dir:
        return None
    import datetime
    try:
        directory = os.path.join(output_dir, "errors")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{rank}.txt")
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(path, "a") as f:
            f.write(f"=== {stamp} rank {rank}\n")
            f.write("".join(traceback.format_exception(err)))
        return path
    except OSError:
        return None


def main(argv=None) -> int:
    """``ds-pfc-train`` / ``launch/train.py``: train, then leave the process groups."""
    run(argv)
    leave_process_groups()
    return 0


if __name__ == "__main__":     # python -m ds_pfc.cli.train
    sys.exit(main())
