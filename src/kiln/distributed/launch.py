"""``kiln launch``: a thin wrapper over ``torch.distributed.run`` (torchrun).

    kiln launch --nproc-per-node 2 -- train my.toml --set parallel.strategy=fsdp

is exactly ``torchrun --standalone --nproc-per-node 2 -m kiln train ...``; with
``--rdzv-endpoint`` the workers of every node meet at a c10d rendezvous instead, and under a
scheduler that sets torchrun's ``PET_*`` variables (Kubeflow) those are used. Process
management, restarts and error reporting are torchrun's own: the elastic agent restarts the
whole group up to ``--max-restarts`` times, and kiln resumes from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", default="1", help="workers on this node: a number, or gpu/cpu/auto (default 1)")
    p.add_argument("--nnodes", help="nodes, or MIN:MAX for an elastic range (default 1)")
    p.add_argument("--node-rank", type=int, help="this node's rank, for a static rendezvous")
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="c10d rendezvous every node joins (default: a standalone single node)",
    )
    p.add_argument("--rdzv-id", help="job id shared by the nodes of one job (default kiln)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers this many times when one fails; kiln resumes from its newest checkpoint",
    )
    p.add_argument("--monitor-interval", type=float, help="seconds between the agent's health checks of its workers")
    p.add_argument(
        "kiln_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="a kiln command, e.g. -- train my.toml"
    )


def torchrun_args(args: argparse.Namespace) -> list[str]:
    command = args.kiln_command[1:] if args.kiln_command[:1] == ["--"] else args.kiln_command
    if not command:
        raise ValueError(
            "kiln launch: give the kiln command to run after --, e.g. kiln launch --nproc-per-node 2 -- train"
        )
    out = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if args.nnodes:
        out += ["--nnodes", args.nnodes]
    if args.rdzv_endpoint:
        out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id or "kiln"]
    elif "PET_RDZV_ENDPOINT" in os.environ:
        pass  # set by a scheduler (e.g. Kubeflow's PyTorchJob): torchrun reads the PET_* variables itself
    elif args.nnodes in (None, "1"):
        out.append("--standalone")
    else:
        raise ValueError("kiln launch: --nnodes above 1 needs --rdzv-endpoint HOST:PORT (a host every node can reach)")
    if args.node_rank is not None:
        out += ["--node-rank", str(args.node_rank)]
    if args.monitor_interval is not None:
        out += ["--monitor-interval", str(args.monitor_interval)]
    return [*out, "-m", "kiln", *command]


def launch(argv: list[str]) -> int:
    """Run torchrun with ``argv`` (from ``torchrun_args``); the exit code of the first failed rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    prepare_agent(argv)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        return failed_exit_code(e)
    return 0


def prepare_agent(argv: list[str]) -> None:
    """Set up this process for torchrun's agent to run ``argv``, and show the command line."""
    # By default the agent lends its rendezvous TCPStore to the workers, and keeps it across
    # restarts without clearing it: restarted workers then find their predecessors' addresses
    # there and fail to connect ("Connection refused"). A store per round avoids that.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    print("kiln: torchrun " + " ".join(argv), file=sys.stderr, flush=True)


def failed_exit_code(e: ChildFailedError) -> int:
    """The exit code of a failed launch: the first failed rank's, 1 for a signal (torchrun has
    already printed each failed rank with its error and exit code)."""
    code = next(iter(e.failures.values())).exitcode if e.failures else 1
    return code if code and code > 0 else 1
