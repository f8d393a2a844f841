"""The Ray executor (`distributed_executor_backend="ray"`): every rank of tensor x pipeline parallelism placed on an
existing Ray cluster, one Ray actor (a process) per rank, reserved together in a placement group.

The ranks are the same program as with the multi-process executor: each actor runs worker.tp_worker.run_rank, so
the rendezvous, the process groups and the step loop are the same; only the way they start and reach the engine
differ. Ray places the actors; rank 0's node hosts the rendezvous (its address and a free port asked of that actor);
each rank connects back to the engine over TCP (multiprocessing's Connection with a random key, the same messages a
local rank sends over its pipe). A rank whose actor dies (a node lost, a kill) closes that connection, which the
executor sees as it sees a local process end: the engine ends through its dead-engine path, naming the rank.

Start the cluster first (`ray start --head` on one machine, `ray start --address HEAD:6379` on the others) and point
RAY_ADDRESS at it; without one, Ray starts a cluster of this machine alone.
"""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import threading
import weakref
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from aserve.config import EngineConfig
from aserve.errors import ConfigError
from aserve.worker.distributed import DistributedPlan
from aserve.worker.multiproc_executor import MultiprocExecutor
from aserve.worker.tp_messages import RankStart

log = logging.getLogger("aserve")
PLACEMENT_TIMEOUT_S = 120.0  # the cluster has that long to find room for every rank
CONNECT_TIMEOUT_S = 300.0  # and the ranks that long to start and call back (a first start installs nothing, but
# imports torch and may build the CPU kernels)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("distributed_executor_backend ray needs Ray: pip install 'aserve[ray]'") from None
    return ray


class RayRank:
    """A rank's actor, with the parts of a process the executor uses: wait for its end, kill it, its pid."""

    def __init__(self, actor, run, pid: int, node_id: str = ""):
        self.actor, self.run, self.pid, self.node_id = actor, run, pid, node_id

    def wait(self, timeout: float | None = None) -> int:
        ray = import_ray()
        try:
            return ray.get(self.run, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rank actor {self.pid} still running after {timeout} s") from None
        except ray.exceptions.RayError:  # the actor died (killed, or its node lost)
            return -9

    def poll(self) -> int | None:
        ray = import_ray()
        ready, _ = ray.wait([self.run], timeout=0)
        return self.wait() if ready else None

    def kill(self) -> None:
        import_ray().kill(self.actor, no_restart=True)

    @property
    def returncode(self) -> int | None:
        return self.poll()


def init_ray():
    """Ray, connected to the cluster at RAY_ADDRESS (or one of this machine alone), unless already connected
    (data-parallel replicas start on threads of their own: one of them connects)."""
    ray = import_ray()
    with _INIT_LOCK:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, logging_level=logging.WARNING)
    return ray


_INIT_LOCK = threading.Lock()


class CallbackServer:
    """Where actors call back to this process: a TCP port on this node, and multiprocessing's challenge with a random
    key (as its Listener does), so only the actors this process started get in."""

    def __init__(self):
        ray = import_ray()
        self.authkey = secrets.token_bytes(32)
        self.server = socket.create_server((ray.util.get_node_ip_address(), 0))
        self.server.settimeout(CONNECT_TIMEOUT_S)
        self.address = self.server.getsockname()[:2]

    def accept(self) -> Connection:
        """The next actor's connection (OSError after CONNECT_TIMEOUT_S, AuthenticationError for a stranger)."""
        sock, _ = self.server.accept()
        sock.settimeout(None)
        conn = Connection(sock.detach())
        deliver_challenge(conn, self.authkey)
        answer_challenge(conn, self.authkey)
        return conn

    def close(self) -> None:
        self.server.close()


def call_back(address, authkey: bytes) -> Connection:
    """An actor's side of CallbackServer."""
    return Client(tuple(address), authkey=authkey)


def _remove(remove_placement_group, group) -> None:
    """Give the ranks' reservation back (which ends their actors), unless Ray is already gone."""
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - at interpreter exit Ray may have shut down first
        pass


def rank_actor_class():
    """The actor class, made when Ray is imported (the module itself must not need Ray)."""
    ray = import_ray()

    @ray.remote
    class RankActor:
        def where(self) -> tuple[str, str, int]:
            """(node ip, node id, pid) of this actor's process."""
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

        def free_port(self) -> int:
            with socket.socket() as s:
                s.bind((ray.util.get_node_ip_address(), 0))
                return s.getsockname()[1]

        def run(self, start: bytes, address, authkey: bytes) -> int:
            from aserve.worker.tp_worker import run_rank

            start = pickle.loads(start)
            conn = call_back(address, authkey)
            conn.send(start.rank)  # who is calling back
            try:
                return run_rank(start, conn)
            finally:
                conn.close()

    return RankActor


class RayExecutor(MultiprocExecutor):
    """Ranks placed by Ray; everything after the start is the multi-process executor's."""

    def _start_ranks(self, config: EngineConfig, log_level: int) -> dict:
        ray = init_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world, cpus = config.world_size, config.ray_cpus_per_rank
        node_cpus = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]]
        if sum(int(n // cpus) for n in node_cpus) < world:
            raise ConfigError(f"the Ray cluster cannot hold {world} ranks of {cpus} CPU(s) each: its nodes have "
                              f"{', '.join(f'{n:.0f}' for n in node_cpus)} CPUs; add nodes, or lower "
                              f"ray_cpus_per_rank")
        group = placement_group([{"CPU": cpus}] * world, strategy="PACK")
        self._placement = weakref.finalize(self, _remove, remove_placement_group, group)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            self._placement()
            raise ConfigError(f"the Ray cluster found no room for {world} ranks of {cpus} CPU(s) in "
                              f"{PLACEMENT_TIMEOUT_S:.0f} s (it has {ray.cluster_resources().get('CPU', 0):.0f} "
                              f"CPUs): add nodes, or lower ray_cpus_per_rank")
        actor_class = rank_actor_class()
        actors = [actor_class.options(num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank)).remote() for rank in range(world)]
        where = ray.get([actor.where.remote() for actor in actors])
        nodes = list(dict.fromkeys(node for _, node, _ in where))
        local = [sum(1 for _, n, _ in where[:rank] if n == node) for rank, (_, node, _) in enumerate(where)]
        host, port = where[0][0], ray.get(actors[0].free_port.remote())  # rank 0's node hosts the rendezvous
        self.plan = DistributedPlan(world, len(nodes), 0, host, port, float(config.distributed_timeout),
                                    tuple(range(world)), tuple(local), max(local) + 1)
        server = CallbackServer()
        runs = [actor.run.remote(pickle.dumps(RankStart(config, self.plan, rank, local[rank], log_level, cpus)),
                                 server.address, server.authkey) for rank, actor in enumerate(actors)]
        ranks = {}
        try:
            while len(ranks) < world:
                conn = server.accept()
                rank = conn.recv()
                ranks[rank] = (RayRank(actors[rank], runs[rank], where[rank][2], where[rank][1]), conn)
        except (OSError, AuthenticationError) as exc:
            self._placement()  # and with it the actors
            raise ConfigError(f"Ray ranks did not call back within {CONNECT_TIMEOUT_S:.0f} s: {exc}") from None
        finally:
            server.close()
        log.info("ray: %d ranks on %d node(s), %d CPU(s) each; rendezvous at %s", world, len(nodes), cpus,
                 self.plan.init_method)
        return ranks

    def shutdown(self) -> None:
        super().shutdown()
        self._placement()

    def _kill(self) -> None:
        super()._kill()
        self._placement()
