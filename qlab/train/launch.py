"""Command line for training: ``qlab train`` and ``python -m qlab.train`` (what torchrun runs).

    qlab train [--config FILE.yaml] [-p KEY VALUE ...] [--nproc N]

With ``--nproc N > 1`` the command re-launches itself through ``torch.distributed.run``
(torchrun, single node, rendezvous on localhost) with N processes; gloo on CPU, NCCL on CUDA.
``nproc`` may also come from the config file or ``-p nproc N``. ``--set KEY=VALUE`` still works, with a
deprecation line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of TrainConfig fields")
    parser.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="set one TrainConfig field (VALUE parsed as YAML), as qlab run sets a parameter; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=argparse.SUPPRESS,  # the deprecated spelling of -p KEY VALUE: still read, not listed
    )
    parser.add_argument(
        "--nproc", type=int, help="processes (DDP through torchrun); overrides the config's nproc"
    )


def run(args: argparse.Namespace) -> int:
    """Validate the config, then train here (one process or already under torchrun) or launch torchrun."""
    from qlab import checks
    from qlab.train.config import load_config

    if args.overrides:
        print("qlab train: --set KEY=VALUE is deprecated; write -p KEY VALUE", file=sys.stderr)
    pairs = list(getattr(args, "parameter", []))
    for item in args.overrides:  # --set KEY=VALUE is -p KEY VALUE: a key is given once, either way
        if "=" not in item:
            raise ValueError(f"--set: expected key=value, got {item!r}")
        pairs.append(tuple(item.split("=", 1)))
    given = checks.given_once(pairs)
    overrides = [f"{name}={value}" for name, value in given.items()]
    if args.nproc is not None:
        checks.integer("--nproc", args.nproc, low=1)
        if "nproc" in given:
            raise ValueError(f"--nproc {args.nproc} and -p nproc {given['nproc']}: give nproc once")
        overrides.append(f"nproc={args.nproc}")
    config = load_config(args.config, overrides, argument="--config")  # errors come before a process starts
    under_torchrun = "LOCAL_RANK" in os.environ
    if config.nproc > 1 and not under_torchrun:
        from qlab.train.loop import check_out_dir

        check_out_dir(config)  # once here, not once per process
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={config.nproc}",
            "-m",
            "qlab.train",
        ] + (["--config", args.config] if args.config else [])
        for item in overrides:
            command += ["-p", *item.split("=", 1)]
        # a session of its own: a terminal's Ctrl-C reaches torchrun once, passed on below, not twice
        torchrun = subprocess.Popen(command, start_new_session=True)
        try:
            return torchrun.wait()
        except KeyboardInterrupt as stop:  # Ctrl-C, or qlab's SIGTERM: torchrun stops its workers on either
            torchrun.send_signal(signal.SIGTERM if type(stop).__name__ == "Terminated" else signal.SIGINT)
            torchrun.wait()
            raise
    from qlab.train.loop import train

    result = train(config)
    if int(os.environ.get("RANK", "0")) == 0:
        last = result.metrics.iloc[-1]
        saved = "nothing saved (-p out_dir DIR keeps a run)"
        if config.out_dir:
            saved = f"results in {config.out_dir}"
        print(
            f"qlab train: {config.recipe} step {int(last.step)} train_loss {last.train_loss:.4f} "
            f"val_loss {last.val_loss:.4f} in {result.seconds:.1f} s; {saved}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qlab.train", description="train a qlab model")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (
        ValueError,
        TypeError,
        OSError,
        ModuleNotFoundError,
    ) as err:  # OSError: e.g. an out_dir not makeable
        print(f"qlab train: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # training diverged (qlab.train.loop.TrainingDiverged)
        print(f"qlab train: {err}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
