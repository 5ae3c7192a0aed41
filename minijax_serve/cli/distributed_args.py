"""``--coordinator-address``, ``--num-processes``, ``--process-id``: the command line on several
processes (``jax.distributed``; docs/parallel_and_simulator.md "Tensor parallelism"). Every process runs the same
command; the mesh of ``--tensor-parallel-size`` spans their devices and only process 0 prints."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several processes (jax.distributed)")
    group.add_argument("--coordinator-address", metavar="HOST:PORT",
                       help="process 0's address; every process runs the same command with it")
    group.add_argument("--num-processes", type=int, help="processes in all")
    group.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1")


def initialize(argv: Sequence[str] | None) -> None:
    """``jax.distributed.initialize`` from the flags in ``argv`` (or JAX's own environment
    detection when only ``--num-processes`` is given), before anything starts JAX's backend
    (the parser's help reads it); on a process other than 0, silence stdout. CPU devices talk
    through gloo."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --n is not --num-processes
    add_args(pre)
    args, _ = pre.parse_known_args(argv)
    if args.coordinator_address is None and args.num_processes is None:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes,
                               process_id=args.process_id)
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")


def check(args: argparse.Namespace) -> None:
    """What the command line cannot do on several processes: ValueError."""
    import jax

    if jax.process_count() == 1:
        return
    if getattr(args, "request_rate", math.inf) != math.inf:
        raise ValueError("several processes: bench is offline only (--request-rate inf); paced "
                         "arrivals would differ between the processes")
    if getattr(args, "baseline", "none") != "none":
        raise ValueError("several processes: --baseline is for one process")
