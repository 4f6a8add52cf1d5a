"""Ray executor: one actor per TPU chip, across hosts, each wrapping a ``Worker``; on the JAX
path one actor per host, holding that host's chips (one JAX process per host, SPMD over them).

Start-up: check that the cluster has the chips, reserve one placement-group bundle per actor
(the first on the driver's host), start an actor in each, then number the ranks so that
they are contiguous per host with the driver's host first. Every call fans out to all actors;
the first worker that dies or raises fails the call with ``WorkerFailure``, without waiting for
the others (they may be blocked in a collective with the lost one).
"""
from __future__ import annotations

import socket
from dataclasses import replace
from typing import Any, Callable, List, Optional, Tuple

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.heap import freeze_startup_heap
from tpu_executor.executor.base import Executor, WorkerFailure, WorkerMaker
from tpu_executor.worker.distributed import RankPlacement
from tpu_executor.worker.worker import Worker

RESERVE_TIMEOUT_S = 120.0


class WorkerActor:
    """The body of a Ray actor: holds one ``Worker`` and calls its methods by name."""

    def __init__(self):
        self.worker = None

    def node_info(self) -> Tuple[str, str]:
        """(Ray node id, IP address) of the host this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this host (for the rank-0 rendezvous)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def init_worker(self, config: EngineConfig, placement: RankPlacement, worker_class: WorkerMaker) -> None:
        self.worker = worker_class(config, placement)

    def execute_method(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def freeze_heap(self) -> None:
        """The actor's process is ready to serve: see ``core/heap.py``."""
        freeze_startup_heap()


def check_cluster(tensor_parallel_size: int) -> None:
    """Fail with what to change unless the cluster has the chips and the driver sits on a TPU host."""
    import ray

    per_node = {n["NodeID"]: n["Resources"].get("TPU", 0) for n in ray.nodes() if n["Alive"]}
    total = int(sum(per_node.values()))
    if total < tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} TPU "
                         f"chips but the Ray cluster has {total} ({len(per_node)} nodes); lower "
                         "tensor_parallel_size or join more TPU hosts (`ray start --address=...` on each)")
    if not per_node.get(ray.get_runtime_context().get_node_id()):
        raise ValueError("the driver runs on a Ray node without TPU chips; start it on one of the "
                         "cluster's TPU hosts (rank 0 runs on the driver's host)")


def actor_layout(config: EngineConfig, driver_chips: int) -> Tuple[int, int]:
    """(actors, chips each): an actor per chip; on the JAX path an actor per host, with as many
    chips as the driver's host offers (at most ``tensor_parallel_size``)."""
    size = config.parallel.tensor_parallel_size
    if not config.device.is_jax:
        return size, 1
    per_host = max(1, min(size, driver_chips))
    if size % per_host:
        raise ValueError(f"tensor_parallel_size {size} does not fill whole hosts of {per_host} chips: the JAX "
                         f"path runs one process per host; use a multiple of {per_host}")
    return size // per_host, per_host


def driver_chips() -> int:
    """TPU chips of the Ray node this process runs on."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return int(next((n["Resources"].get("TPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0))


def rank_placements(nodes: List[Tuple[str, str]], driver_node: str) -> List[RankPlacement]:
    """A placement per actor (same order as ``nodes``, their (node id, ip)): ranks contiguous
    per host, the driver's host first, then hosts in order of first appearance."""
    order = sorted(dict.fromkeys(node for node, _ in nodes), key=lambda n: n != driver_node)
    ips = {node: ip for node, ip in nodes}
    members = {node: [i for i, (n, _) in enumerate(nodes) if n == node] for node in order}
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"the chips were reserved unevenly over hosts ({[len(m) for m in members.values()]} "
                         "workers): use a tensor_parallel_size that fills whole hosts, or free chips")
    local = sizes.pop()
    placements: List[RankPlacement] = [None] * len(nodes)  # type: ignore[list-item]
    for node_index, node in enumerate(order):
        for local_rank, actor_index in enumerate(members[node]):
            placements[actor_index] = RankPlacement(
                rank=node_index * local + local_rank, world_size=len(nodes), local_rank=local_rank,
                local_world_size=local, node_index=node_index, num_nodes=len(order),
                host_ips=tuple(ips[n] for n in order), master_addr=ips[order[0]])
    return placements


class RayExecutor(Executor):
    """Ray actors in rank order: ``tensor_parallel_size`` of one chip each, or on the JAX path
    one per host (``actor_layout``). ``worker_class`` swaps in a ``Worker`` subclass (tests
    inject faults with it)."""

    def __init__(self, config: EngineConfig, worker_class: Optional[WorkerMaker] = None):
        import ray

        super().__init__(config)
        self.worker_class = worker_class or Worker
        self.actors: List[Any] = []
        self.placement_group = None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=config.parallel.ray_address, log_to_driver=False)
        try:
            self.num_actors, self.chips_per_actor = actor_layout(config, driver_chips())
            if not self._in_reserved_group():
                check_cluster(config.parallel.tensor_parallel_size)
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _in_reserved_group(self) -> bool:
        """Whether this process runs in a placement group of one bundle per actor, of its
        chips, that someone else reserved for these workers (a Ray Serve replica's)."""
        import ray

        group = ray.util.get_current_placement_group()
        wanted = [float(self.chips_per_actor)] * self.num_actors
        return group is not None and [b.get("TPU", 0) for b in group.bundle_specs] == wanted

    def _reserve(self):
        """A placement group of a bundle per actor: this process's own (a Serve replica's),
        else a new one whose first bundle is on the driver's host (and, for one actor per
        host, each bundle on a host of its own)."""
        import ray
        from ray.util.placement_group import placement_group

        if self._in_reserved_group():
            return ray.util.get_current_placement_group()
        # The first bundle asks for a sliver of the driver's node resource, which pins it there.
        chips = float(self.chips_per_actor)
        driver_ip = ray.util.get_node_ip_address()
        bundles = [{"TPU": chips, f"node:{driver_ip}": 0.001}] + [{"TPU": chips}] * (self.num_actors - 1)
        strategy = "STRICT_SPREAD" if self.config.device.is_jax else "PACK"
        self.placement_group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=RESERVE_TIMEOUT_S)
        if not ready:
            raise ValueError(f"could not reserve {self.num_actors} x {self.chips_per_actor:g} TPU chips within "
                             f"{RESERVE_TIMEOUT_S:.0f} s (other jobs hold them?); free chips or lower "
                             "tensor_parallel_size")
        return self.placement_group

    def _start_actors(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size = self.num_actors
        group = self._reserve()
        actor_class = ray.remote(WorkerActor)
        actors = [actor_class.options(
            num_cpus=0, resources={"TPU": float(self.chips_per_actor)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote() for i in range(size)]
        nodes = ray.get([a.node_info.remote() for a in actors])
        placements = rank_placements(nodes, ray.get_runtime_context().get_node_id())
        by_rank = sorted(range(size), key=lambda i: placements[i].rank)
        self.actors = [actors[i] for i in by_rank]
        port = ray.get(self.actors[0].free_port.remote())
        self.placements = [replace(placements[i], master_port=port) for i in by_rank]
        self._gather("init_worker", [a.init_worker.remote(self.config, p, self.worker_class)
                                     for a, p in zip(self.actors, self.placements)])

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        return self._start_on_workers(method, *args, timeout_s=timeout_s)()

    def _start_on_workers(self, method: str, *args: Any,
                          timeout_s: Optional[float] = None) -> Callable[[], List[Any]]:
        """Send the call to every actor, each argument serialised once (one object in Ray's
        store that every rank reads: a step is sent once). An actor runs its calls in order."""
        import ray

        if not self.actors:
            raise WorkerFailure(f"cannot call {method}: the workers have been shut down")
        arg_refs = [ray.put(arg) for arg in args]
        refs = [a.execute_method.remote(method, *arg_refs) for a in self.actors]
        return lambda: self._gather(method, refs, timeout_s)

    def _gather(self, method: str, refs: List[Any], timeout_s: Optional[float] = None) -> List[Any]:
        """Every rank's result, failing on the first rank that dies or raises (the others may
        be blocked in a collective with it) or when no rank answers for ``timeout_s``."""
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not done:
                ranks = [refs.index(ref) for ref in pending]
                raise WorkerFailure(f"worker ranks {ranks} did not answer {method} within {timeout_s:.0f} s")
            try:
                ray.get(done[0])
            except Exception as err:  # the actor died (RayActorError) or the method raised
                cause = getattr(err, "cause", None) or err
                raise WorkerFailure(f"worker rank {refs.index(done[0])} failed in {method}: "
                                    f"{type(cause).__name__}: {cause}") from err
        return ray.get(refs)

    def warmup(self, show_progress: bool) -> None:
        super().warmup(show_progress)
        # Each actor is a process of its own, with its own start-up heap to freeze.
        self._gather("freeze_heap", [a.freeze_heap.remote() for a in self.actors])

    def node_ids(self) -> List[str]:
        """The Ray node id of each rank's actor."""
        import ray

        return [node for node, _ in ray.get([a.node_info.remote() for a in self.actors])]

    def shutdown(self) -> None:
        """Kill the actors and release their chips (a blocked collective cannot hold this up)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

