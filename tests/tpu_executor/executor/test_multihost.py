"""tp=4 on a simulated two-host Ray cluster (two nodes with 2 "TPU" chips each): ranks 0-1
share the driver's host, ranks 2-3 the other, and greedy tokens equal transformers'."""
from __future__ import annotations

import pytest
import ray

from tests.common import greedy_tokens, hf_greedy, mixed_prompts, ray_session, tensor_parallel_options
from tpu_executor import LLM

pytestmark = pytest.mark.slow  # a simulated two-node Ray cluster


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with ray_session(str(tmp_path_factory.mktemp("ray")), cluster_nodes=[{"TPU": 2}, {"TPU": 2}]) as cluster:
        yield cluster


def test_tp4_over_two_hosts_places_ranks_per_host_and_matches_transformers(two_hosts, checkpoints):
    prompts = mixed_prompts(4, 5, 40, vocab=512, seed=3)
    expected, _ = hf_greedy(checkpoints["llama"], prompts, 16)
    # Placement is the executor's, the same on every path: the native path runs it without
    # compiling a graph on each of four ranks (XLA at tp = 4 is in test_tensor_parallel.py).
    llm = LLM(checkpoints["llama"], tensor_parallel_size=4, ray_address=two_hosts.address,
              **tensor_parallel_options(device="cpu"))
    try:
        executor = llm.engine.core.executor
        nodes = executor.node_ids()
        driver_node = ray.get_runtime_context().get_node_id()
        assert nodes[0] == nodes[1] == driver_node
        assert nodes[2] == nodes[3] != driver_node
        assert [(p.rank, p.local_rank, p.node_index) for p in executor.placements] == \
            [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
        assert greedy_tokens(llm, prompts, 16) == expected
    finally:
        llm.shutdown()


def mesh_worker_class():
    """A Worker that reports its JAX mesh. Defined on call so the class pickles by value."""
    from tpu_executor.worker.worker import Worker

    class MeshWorker(Worker):
        def mesh_layout(self):
            import jax

            weight = self.model.model.layers[0].mlp.gate_up_proj.weight.jax()
            return (jax.process_index(), [d.process_index for d in self.jax.mesh.devices.flat],
                    len(jax.local_devices()), len(weight.sharding.device_set), len(weight.addressable_shards))

    return MeshWorker


def test_jax_path_runs_one_process_per_host_and_matches_transformers(two_hosts, checkpoints, tmp_path):
    """The JAX path over two hosts: one actor (one JAX process) per host holding its two chips,
    joined by jax.distributed into one mesh of four; SPMD splits the weights over all four and
    XLA's collectives cross the hosts (gloo between the simulated hosts' processes)."""
    prompts = mixed_prompts(4, 5, 40, vocab=512, seed=3)
    expected, _ = hf_greedy(checkpoints["llama"], prompts, 16)
    options = tensor_parallel_options(cache_dir=str(tmp_path / "cache"))
    llm = LLM(checkpoints["llama"], device="jax", tensor_parallel_size=4, ray_address=two_hosts.address,
              worker_class=mesh_worker_class(), **options)
    try:
        executor = llm.engine.core.executor
        nodes = executor.node_ids()
        assert len(nodes) == 2 and nodes[0] == ray.get_runtime_context().get_node_id() != nodes[1]
        assert [(p.rank, p.world_size, p.node_index) for p in executor.placements] == [(0, 2, 0), (1, 2, 1)]
        # Each process: its index, the processes of the mesh's chips, its own chips, and how
        # the first layer's column-parallel weight is split (four parts, two held here).
        assert executor._call_workers("mesh_layout") == [(0, [0, 0, 1, 1], 2, 4, 2), (1, [0, 0, 1, 1], 2, 4, 2)]
        assert greedy_tokens(llm, prompts, 16) == expected
        stats = llm.engine.stats()
        assert stats.graphs_compiled_after_warmup == 0 and stats.compile_cache_misses > 0
    finally:
        llm.shutdown()
    # Process 0 writes the shared cache; a restart of both hosts compiles nothing.
    llm = LLM(checkpoints["llama"], device="jax", tensor_parallel_size=4, ray_address=two_hosts.address, **options)
    try:
        assert greedy_tokens(llm, prompts, 16) == expected
        stats = llm.engine.stats()
        assert stats.compile_cache_misses == 0 and stats.graphs_compiled_after_warmup == 0
    finally:
        llm.shutdown()
