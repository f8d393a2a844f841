"""fcfs-swap: first come, first served; a preempted request's KV blocks go to the host swap pool and come
back before anyone new is admitted, so it resumes without recomputing. When the host pool is full the
scheduler falls back to recompute."""
from aserve.policy import PreemptionMode
from aserve_policies.fcfs import FCFSPolicy


class FCFSSwapPolicy(FCFSPolicy):
    name = "fcfs-swap"
    description = "arrival order; preempts the newest request and swaps its KV blocks to host memory"

    def preemption_mode(self, victim, kv_view):
        return PreemptionMode.SWAP if kv_view.num_free_host_blocks else PreemptionMode.RECOMPUTE
