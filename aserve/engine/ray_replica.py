"""A data-parallel replica placed by Ray (`data_parallel_backend="ray"`): the engine core runs in a Ray actor on
whichever node of the cluster has room, and calls back to the front end over TCP; everything after that is the
engine-core process's protocol (engine.core_process), as over its local socket pair. The actor reserves
`ray_cpus_per_rank` CPUs for each rank of its engine (one, unless the replica is itself tensor- or
pipeline-parallel, whose ranks then start as processes of that node)."""
from __future__ import annotations

import os

from aserve.errors import ConfigError
from aserve.worker.ray_executor import PLACEMENT_TIMEOUT_S, CallbackServer, RayRank, call_back, init_ray


def core_actor_class():
    ray = init_ray()

    @ray.remote
    class CoreActor:
        def where(self) -> tuple[int, str]:
            return os.getpid(), ray.get_runtime_context().get_node_id()

        def run(self, serve, address, authkey: bytes) -> int:
            conn = call_back(address, authkey)
            try:
                serve(conn)
            finally:
                conn.close()
            return 0

    return CoreActor


def start_core(config, serve):
    """(the actor as a process-like RayRank, the connection to its engine core). `serve`: the core's loop
    (core_process.serve_core, passed by reference: this module stands below the one that calls it)."""
    ray = init_ray()
    cpus = config.ray_cpus_per_rank * config.world_size
    actor = core_actor_class().options(num_cpus=cpus).remote()
    server = CallbackServer()
    try:
        pid, node = ray.get(actor.where.remote(), timeout=PLACEMENT_TIMEOUT_S)  # first: run() keeps it busy
        run = actor.run.remote(serve, server.address, server.authkey)
        conn = server.accept()
    except (OSError, ray.exceptions.GetTimeoutError) as exc:
        ray.kill(actor, no_restart=True)
        raise ConfigError(f"a data-parallel replica on Ray did not start: {exc!r} (does the cluster have {cpus} "
                          f"free CPU(s) on one node?)") from None
    finally:
        server.close()
    return RayRank(actor, run, pid, node), conn
