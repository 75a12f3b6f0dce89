#!/usr/bin/env python3
"""Train a ViT with standard or inverted activations (or both, side by side).

With no arguments: a small ViT on scikit-learn's 8x8 digits (shipped with the package,
nothing downloaded), inverted activations, on every local device.

  python scripts/train_vit.py                       # default job
  python scripts/train_vit.py --compare             # standard vs inverted, same seed
  python scripts/train_vit.py --data cifar10.npz --preset ti16 --dtype bfloat16
  python scripts/train_vit.py --resume              # continue the latest run

Several processes (one per host; each sees its local devices, the mesh spans all of them):

  python scripts/train_vit.py --coordinator host0:1234 --num-processes 2 --process-id 0 ...
  python scripts/train_vit.py --coordinator host0:1234 --num-processes 2 --process-id 1 ...
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse(argv=None):
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  from models.experiments import training  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--data", type=pathlib.Path, help=".npz with x_train, y_train, x_test, y_test "
                 "(default: scikit-learn's digits)")
  # Every option that shapes the result: TrainConfig's fields (--activations: the old name).
  cli.add_arguments(p, training.TrainConfig)
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
  g.add_argument("--distributed-timeout", type=cli.positive_int, default=120,
                 help="seconds to wait for every process to join (default 120)")
  return p.parse_args(argv)


def _latest_run(preset: str) -> pathlib.Path | None:
  runs = sorted((ROOT / "runs").glob(f"{preset}-*"), key=lambda p: p.stat().st_mtime)
  return runs[-1] if runs else None


def main(argv=None) -> int:
  args = parse(argv)
  from models.experiments import supervisor  # pylint: disable=import-outside-toplevel
  if (args.coordinator is not None or args.distributed) and not supervisor.as_worker():
    # One process of several: run it under a supervisor that turns XLA's aborts (a peer or the
    # coordinator gone, processes that never all join) into one line and an exit code.
    return supervisor.supervise(
        [sys.executable, str(pathlib.Path(__file__).resolve()),
         *(sys.argv[1:] if argv is None else argv)],
        coordinator=args.coordinator, timeout_s=args.distributed_timeout)
  from models.experiments import distributed  # pylint: disable=import-outside-toplevel
  import warnings  # pylint: disable=import-outside-toplevel
  warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  from models.experiments import data as data_lib  # pylint: disable=import-outside-toplevel
  from models.experiments import training  # pylint: disable=import-outside-toplevel
  from models.experiments import compare  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel  # (distributed imported it already)
  from jax import errors as jax_errors  # pylint: disable=import-outside-toplevel
  several = False
  try:
    several = args.coordinator is not None or args.distributed
    if several and args.workdir is None:
      raise training.ConfigError("--workdir is required with several processes (the same "
                                 "directory for all, on a shared file system)")
    if several and args.compare:
      raise training.ConfigError("--compare runs in one process; drop --coordinator/--distributed")
    if args.compare and args.stop_after is not None:
      raise training.ConfigError("--stop-after does not apply to --compare (it trains both "
                                 "configurations to the end)")
    cfg = cli.from_args(training.TrainConfig, args)  # every option checked before any work
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           auto=args.distributed, timeout_s=args.distributed_timeout)
    dataset = data_lib.load_npz(args.data) if args.data else data_lib.load_digits(args.seed)
    workdir = args.workdir
    if workdir is None:
      workdir = _latest_run(args.preset) if args.resume else (
          ROOT / "runs" / f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
      if workdir is None:
        raise training.ConfigError(f"--resume: no earlier run of preset {args.preset!r} under runs/")
    if several:  # every process must run the same job on the same data
      distributed.agree({**training.run_identity(cfg, data_lib.fingerprint(dataset)),
                         "workdir": str(workdir), "resume": args.resume,
                         "stop_after": args.stop_after, "shard_params": args.shard_params},
                        timeout_s=args.distributed_timeout)
    progress = not args.no_progress
    with training.stop_on_signals():  # SIGINT/SIGTERM: the saves in flight complete, one line
      if args.compare:
        result = compare.compare(cfg, dataset, workdir, resume=args.resume, progress=progress,
                                 shard_params=args.shard_params)
        print(result["table"])
        print(f"\nwrote {result['json']}\nwrote {result['png']}")
        return 0
      summary = training.train(cfg, dataset, workdir / cfg.configuration, resume=args.resume,
                               progress=progress, stop_after=args.stop_after,
                               shard_params=args.shard_params)
    distributed.finished()
  except (data_lib.DataError, training.ConfigError) as e:
    return distributed.fail(str(e), 2)
  except OSError as e:  # e.g. the disk filled up or the run directory went away mid-run
    return distributed.fail(str(e), 2)
  except training.TrainingDiverged as e:
    return distributed.fail(str(e), 1)
  except training.Interrupted as e:
    return distributed.fail(str(e), e.code)
  except training.StopRequested as e:  # before training started: nothing was being saved
    return distributed.fail(f"stopped by signal {e.signum} before training started", 128 + e.signum)
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
    return distributed.fail(f"unexpected {type(e).__name__}: {training.first_line(e)} (the "
                            f"traceback is in process {jax.process_index()}'s output)", 1)
  if jax.process_index() == 0:
    shown = {k: v for k, v in summary.items() if k not in ("history", "trainer")}
    print(json.dumps(shown, indent=1))
    print(f"run directory: {workdir}")
  return 0


if __name__ == "__main__":
  code = main()
  if code:  # after the one line: no library shutdown noise (checkpoint writers' threads)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)
