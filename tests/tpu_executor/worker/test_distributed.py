"""Rank placement and the per-worker TPU environment (pure functions; no Ray, no TPU)."""
from __future__ import annotations

import pytest

from tpu_executor.core.config import (
    CacheConfig,
    CompileConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tpu_executor.executor.ray_executor import actor_layout, rank_placements
from tpu_executor.worker.distributed import RankPlacement, tpu_topology_env


def test_ranks_are_contiguous_per_host_driver_host_first():
    # Bundles came back interleaved over two hosts; the driver is on host "b".
    nodes = [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("a", "10.0.0.1"), ("b", "10.0.0.2")]
    placements = rank_placements(nodes, driver_node="b")
    assert [p.rank for p in placements] == [2, 0, 3, 1]
    assert [p.local_rank for p in placements] == [0, 0, 1, 1]
    assert [p.node_index for p in placements] == [1, 0, 1, 0]
    assert {p.host_ips for p in placements} == {("10.0.0.2", "10.0.0.1")}
    assert {p.master_addr for p in placements} == {"10.0.0.2"}
    assert {(p.world_size, p.local_world_size, p.num_nodes) for p in placements} == {(4, 2, 2)}


def test_uneven_hosts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="unevenly over hosts"):
        rank_placements([("a", "ip1"), ("a", "ip1"), ("a", "ip1"), ("b", "ip2")], driver_node="a")


def _config(device: str, chips: int, checkpoint: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=checkpoint), cache=CacheConfig(), scheduler=SchedulerConfig(),
                        compile=CompileConfig(), device=DeviceConfig(device), max_model_len=64,
                        parallel=ParallelConfig(tensor_parallel_size=chips, ray_address="auto"))


def test_actor_layout_is_a_chip_each_or_on_the_jax_path_a_host_each(tmp_path):
    assert actor_layout(_config("xla", 8, str(tmp_path)), driver_chips=4) == (8, 1)
    assert actor_layout(_config("jax", 8, str(tmp_path)), driver_chips=4) == (2, 4)  # two hosts of four chips
    assert actor_layout(_config("jax", 2, str(tmp_path)), driver_chips=4) == (1, 2)  # part of one host
    assert actor_layout(_config("jax", 4, str(tmp_path)), driver_chips=1) == (4, 1)
    with pytest.raises(ValueError, match="does not fill whole hosts of 4 chips"):
        actor_layout(_config("jax", 6, str(tmp_path)), driver_chips=4)


def test_single_host_tpu_env_gives_each_worker_its_chip():
    envs = [tpu_topology_env(RankPlacement(rank=r, world_size=4, local_rank=r, local_world_size=4))
            for r in range(4)]
    assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["CLOUD_TPU_TASK_ID"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["TPU_PROCESS_PORT"] for e in envs] == ["8476", "8477", "8478", "8479"]
    assert {e["TPU_PROCESS_BOUNDS"] for e in envs} == {"2,2,1"}
    assert {e["TPU_HOST_BOUNDS"] for e in envs} == {"2,2,1"}
    assert {e["TPU_CHIPS_PER_HOST_BOUNDS"] for e in envs} == {"1,1,1"}
    assert envs[0]["TPU_PROCESS_ADDRESSES"] == "127.0.0.1:8476,127.0.0.1:8477,127.0.0.1:8478,127.0.0.1:8479"


def test_multi_host_tpu_env_multiplies_the_host_grid():
    placement = RankPlacement(rank=5, world_size=8, local_rank=1, local_world_size=4, node_index=1,
                              num_nodes=2, host_ips=("10.0.0.1", "10.0.0.2"), master_addr="10.0.0.1")
    env = tpu_topology_env(placement, host_bounds=(1, 1, 2))
    assert env["TPU_PROCESS_BOUNDS"] == "2,2,2"
    assert env["TPU_VISIBLE_CHIPS"] == "1" and env["CLOUD_TPU_TASK_ID"] == "5"
    assert env["TPU_PROCESS_ADDRESSES"].split(",")[4:6] == ["10.0.0.2:8476", "10.0.0.2:8477"]


def test_bad_placements_fail_clearly():
    with pytest.raises(ValueError, match="workers on one host"):
        tpu_topology_env(RankPlacement(rank=0, world_size=3, local_world_size=3))
    with pytest.raises(ValueError, match="every host must run the same number"):
        RankPlacement(rank=0, world_size=4, local_world_size=3)
    with pytest.raises(ValueError, match="outside world_size"):
        RankPlacement(rank=4, world_size=4, local_world_size=4)
