"""The training job behind ``scripts/train_vit.py``: its command line (:func:`parser`) and the
run (:func:`run`: options checked before any work, one line and an exit code for every way it
can end).  ``python -m models.training.main`` is the worker a multi-process run's supervisor
starts."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from models import cli
from models.training import compare
from models.training import config
from models.training import data as data_lib
from models.training import distributed
from models.training import errors
from models.training import loop
from models.training import run_dir
from models.training import supervisor

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parser(doc: str | None = None) -> argparse.ArgumentParser:
  """The job's command line: :class:`TrainConfig`'s fields plus the run's own flags."""
  p = cli.parser(doc)
  p.add_argument("--data", type=pathlib.Path, help=".npz with x_train, y_train, x_test, y_test "
                 "(default: scikit-learn's digits)")
  # Every option that shapes the result: TrainConfig's fields.
  cli.add_arguments(p, config.TrainConfig)
  p.add_argument("--compare", action="store_true",
                 help="train standard and --configuration (inverted if standard) from the same seed")
  p.add_argument("--workdir", type=pathlib.Path, help="run directory (default: runs/<preset>-<time>)")
  p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--shard-params", action="store_true",
                 help="FSDP: split parameters and optimizer state over the devices (data axis) "
                      "instead of replicating them; a run may resume with or without it")
  p.add_argument("--stop-after", type=cli.positive_int, default=None, metavar="STEP",
                 help="stop once STEP is reached, as if killed (continue later with --resume)")
  g = p.add_argument_group("several processes (JAX multi-controller; give all processes the "
                           "same options and --workdir on a shared file system)")
  g.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
  g.add_argument("--num-processes", type=cli.positive_int, help="how many processes take part")
  g.add_argument("--process-id", type=cli.nonnegative_int, help="this process's rank, 0 .. N-1")
  g.add_argument("--distributed", action="store_true",
                 help="join the cluster JAX detects (SLURM, Open MPI, ...) with no addresses")
  g.add_argument("--distributed-timeout", type=cli.positive_int,
                 default=supervisor.DEFAULT_TIMEOUT_S,
                 help="seconds to wait for every process to join (default 120)")
  return p


def _latest_run(preset: str) -> pathlib.Path | None:
  runs = sorted((ROOT / "runs").glob(f"{preset}-*"), key=lambda p: p.stat().st_mtime)
  return runs[-1] if runs else None


def run(args: argparse.Namespace, argv: list[str]) -> int:
  """Run the job ``args`` (parsed by :func:`parser` from ``argv``); the exit code.

  One process of several runs under a supervisor (:mod:`.supervisor`) that starts this module
  again as its worker with the same ``argv``.

  Args:
    args: the parsed command line.
    argv: the command line's arguments (for the supervised worker).

  Returns:
    0, or the exit code of the one line printed on stderr (2: bad options or data; 1: diverged
    or a peer lost; 128 + N: stopped by signal N).
  """
  if (args.coordinator is not None or args.distributed) and not supervisor.as_worker():
    # One process of several: run it under a supervisor that turns XLA's aborts (a peer or the
    # coordinator gone, processes that never all join) into one line and an exit code.
    return supervisor.supervise(
        [sys.executable, "-m", __name__ if __name__ != "__main__" else "models.training.main",
         *argv],
        coordinator=args.coordinator, timeout_s=args.distributed_timeout)
  cli.one_line_warnings()
  import jax  # pylint: disable=import-outside-toplevel
  from jax import errors as jax_errors  # pylint: disable=import-outside-toplevel
  several = False
  try:
    several = args.coordinator is not None or args.distributed
    _check_modes(args, several)
    cfg = cli.from_args(config.TrainConfig, args)  # every option checked before any work
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           auto=args.distributed, timeout_s=args.distributed_timeout)
    dataset = data_lib.load_npz(args.data) if args.data else data_lib.load_digits(args.seed)
    workdir = _workdir(args)
    if several:  # every process must run the same job on the same data
      _agree(args, cfg, dataset, workdir)
    progress = not args.no_progress
    cli.say_on_stop(" before training started: nothing was saved; run the same command again")
    with errors.stop_on_signals():  # SIGINT/SIGTERM: the saves in flight complete, one line
      if args.compare:
        result = compare.compare(cfg, dataset, workdir, resume=args.resume, progress=progress,
                                 shard_params=args.shard_params)
        cli.say_on_stop(f" after training finished: the runs are complete in {workdir}")
        print(result["table"])
        print(f"\nwrote {result['json']}\nwrote {result['png']}")
        return 0
      summary = loop.train(cfg, dataset, workdir / cfg.run_name, resume=args.resume,
                               progress=progress, stop_after=args.stop_after,
                               shard_params=args.shard_params)
    cli.say_on_stop(f" after training finished: the run is complete in {workdir}")
    distributed.finished()
  except (data_lib.DataError, errors.ConfigError, OSError) as e:  # (OSError: e.g. the disk
    return distributed.fail(str(e), 2)                              # filled up mid-run)
  except errors.TrainingDiverged as e:
    return distributed.fail(str(e), 1)
  except errors.Interrupted as e:
    return distributed.fail(str(e), e.code)
  except errors.StopRequested as e:  # before training started: nothing was being saved
    import signal  # pylint: disable=import-outside-toplevel
    return distributed.fail(f"stopped by {signal.Signals(e.signum).name} before training "
                            "started: nothing was saved; run the same command again",
                            128 + e.signum)
  except jax_errors.JaxRuntimeError as e:
    if not several:
      raise
    distributed.collective_failed(e)  # e.g. a collective whose peer was killed
    return 1  # (not reached)
  except Exception as e:  # pylint: disable=broad-except  # a bug: say it, and tell the others
    if not several:
      raise
    import traceback  # pylint: disable=import-outside-toplevel
    traceback.print_exc()
    # Tell the others now: they would wait for this process until their watchdogs give up.
    return distributed.fail(f"unexpected {type(e).__name__}: {errors.first_line(e)} (the "
                            f"traceback is in process {jax.process_index()}'s output)", 1)
  if jax.process_index() == 0:
    _report(cfg, summary, workdir)
  return 0


def _check_modes(args: argparse.Namespace, several: bool) -> None:
  """One line for options that do not go together (before any work)."""
  if several and args.workdir is None:
    raise errors.ConfigError("--workdir is required with several processes (the same "
                             "directory for all, on a shared file system)")
  if several and args.compare:
    raise errors.ConfigError("--compare runs in one process; drop --coordinator/--distributed")
  if args.compare and args.stop_after is not None:
    raise errors.ConfigError("--stop-after does not apply to --compare (it trains both "
                             "configurations to the end)")


def _workdir(args: argparse.Namespace) -> pathlib.Path:
  """``--workdir``, or the latest run of the preset (``--resume``), or a new one under runs/."""
  if args.workdir is not None:
    return args.workdir
  if not args.resume:
    return ROOT / "runs" / f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
  workdir = _latest_run(args.preset)
  if workdir is None:
    raise errors.ConfigError(f"--resume: no earlier run of preset {args.preset!r} under runs/")
  return workdir


def _agree(args: argparse.Namespace, cfg: config.TrainConfig, dataset, workdir) -> None:
  """Every process's job and data the same as process 0's, or one line naming the option."""
  distributed.agree({**run_dir.run_identity(cfg, data_lib.fingerprint(dataset)),
                     "workdir": str(workdir), "resume": args.resume,
                     "stop_after": args.stop_after, "shard_params": args.shard_params},
                    timeout_s=args.distributed_timeout)


def _report(cfg: config.TrainConfig, summary: dict, workdir: pathlib.Path) -> None:
  """The summary, the run directory and, for a finished run, the line on what its activations
  cost against standard."""
  import jax  # pylint: disable=import-outside-toplevel
  shown = {k: v for k, v in summary.items() if k not in ("history", "trainer")}
  print(json.dumps(shown, indent=1))
  print(f"run directory: {workdir}")
  # (a finished run's last line; a second model compiled: one process's job)
  if summary["finished"] and jax.process_count() == 1:
    print(compare.memory_line(cfg, compare.against_standard(summary["trainer"])))


def main(argv: list[str] | None = None, doc: str | None = None) -> int:
  """Parse ``argv`` (default: ``sys.argv[1:]``) and run the job.

  Args:
    argv: the command line's arguments.
    doc: the entry point's docstring, shown by ``--help``.

  Returns:
    :func:`run`'s exit code.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  return run(parser(doc).parse_args(argv), argv)


if __name__ == "__main__":
  cli.finish(main)
