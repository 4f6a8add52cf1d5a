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
    llm = LLM(checkpoints["llama"], tensor_parallel_size=4, ray_address=two_hosts.address,
              **tensor_parallel_options())
    try:
        executor = llm.engine.core.executor
        nodes = executor.node_ids()
        driver_node = ray.get_runtime_context().get_node_id()
        assert nodes[0] == nodes[1] == driver_node
        assert nodes[2] == nodes[3] != driver_node
        assert [(p.rank, p.local_rank, p.node_index) for p in executor.placements] == \
            [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
        assert greedy_tokens(llm, prompts, 16) == expected
        assert llm.engine.stats().graphs_compiled_after_warmup == 0
    finally:
        llm.shutdown()
