"""``torchrun --nproc-per-node P -m wavepp.main``: one pipeline stage per rank (per
``--tp`` ranks with tensor parallelism inside a stage, its first rank speaking for it).

Checks the options and picks the run's backend (``wavepp.launch.backends``), sets up
the process groups, runs the rank (``wavepp.launch.rank``: planes, the agreed setup, the
stage and its executor, the rank's tasks, the leak check) and on rank 0 prints the
report and writes the JSON record. How the rank ends — signals, a failure, its exit
status — is its :class:`~wavepp.launch.lifecycle.Lifecycle`'s.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import sys

import anyio
import torch.distributed as dist

from wavepp.config import RunConfig, load
from wavepp.exec.device import pick_device, set_threads
from wavepp.exec.tp import TPLayout, make_groups
from wavepp.launch.lifecycle import FAULT_GRACE_S, Lifecycle, refuse_once
from wavepp.launch.log import log
from wavepp.launch.rank import Client, rank_main
from wavepp.launch.record import publish
from wavepp.launch.setup import preflight
from wavepp.transport.watchdog import Watchdog


def run_ranks(config: RunConfig, client: Client | None = None,
              sigterm_drains: bool = False) -> int:  # fmt: skip
    """Run this rank (under torchrun, or alone as a one-stage run); returns the exit status.

    ``client`` None runs the configured workload; otherwise rank 0 calls
    ``client(engine)`` (see :mod:`wavepp.engine`) and ranks > 0 serve their stage.
    ``sigterm_drains``: SIGTERM drains rank 0's engine rather than interrupting the run.
    """
    try:
        backend = preflight(config, int(os.environ.get("WORLD_SIZE", "1")))
    except SystemExit as error:
        refuse_once(error)
    set_threads(config.threads)
    if "RANK" not in os.environ:  # plain `python -m wavepp.main`: a one-stage run
        with socket.socket() as probe:  # a free port for the one-rank store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = TPLayout(world, config.tp, rank)
    watchdog = None
    if world > 1:
        watchdog = Watchdog(rank, world, log, dead_after_s=config.dead_after_s,
                            fault_grace_s=FAULT_GRACE_S if client and not layout.tp_rank
                            else 0.0, tp=config.tp).start()  # fmt: skip
    life = Lifecycle(watchdog)
    groups = None
    if config.tp > 1:
        try:
            groups = make_groups(layout, config.timeout_s, pick_device(config.device))
        except BaseException as error:
            life.fail(error)

    if layout.tp_rank:  # a TP follower: no record, no event loop
        status = life.follow(functools.partial(backend.follow_stage, groups), sigterm_drains)
        if watchdog is not None:
            watchdog.finish()
        if status:
            life.exit(status)
        dist.destroy_process_group()
        return 0
    life.guard()
    try:
        record, status = anyio.run(rank_main, config, backend, life, layout.stage,
                                   layout.stages, client, sigterm_drains, groups)  # fmt: skip
    except BaseException as error:  # a failed rank exits now, naming what it waited for
        life.fail(error)
    life.end(status)
    life.guard()  # the run's own watch put back the default handlers
    if watchdog is not None:
        watchdog.finish()
    if record is not None:
        publish(record, status, config.json)
    sys.stdout.flush()
    sys.stderr.flush()
    if status in (2, 130, 143) or (record is None and status):
        life.exit(status)  # planes may hold abandoned transfers: do not wait on them
    dist.destroy_process_group()
    return status


def main(argv: list[str] | None = None) -> None:
    try:
        config = load(argv)
    except SystemExit as error:
        refuse_once(error)
    sys.exit(run_ranks(config))


if __name__ == "__main__":
    main()
