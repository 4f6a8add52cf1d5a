"""Replicas of two chips each on a simulated two-host cluster: each replica's ranks on one
host, greedy outputs equal to one offline engine's, every chip back after the application is
deleted. (A module of its own: it needs a Ray cluster of its own.)"""
from __future__ import annotations

import time

import pytest

from tests.common import mixed_prompts, replicated_server, tensor_parallel_options
from tests.tpu_executor.entrypoints.test_server_replicas import complete, offline_texts, wait_for_health

pytestmark = pytest.mark.slow  # a Ray cluster, Serve and engine replicas


def test_tensor_parallel_replicas_keep_their_ranks_on_one_host_and_give_the_chips_back(tmp_path_factory,
                                                                                          checkpoints):
    import ray
    from ray import serve

    prompts = mixed_prompts(4, 5, 40, vocab=500, seed=8)
    options = tensor_parallel_options(device="cpu", tensor_parallel_size=2)
    expected = offline_texts(checkpoints["llama"], prompts, **tensor_parallel_options(device="cpu"))
    with replicated_server(str(tmp_path_factory.mktemp("ray")), checkpoints["llama"], options,
                           cluster_nodes=[{"TPU": 2}, {"TPU": 2}]) as url:
        wait_for_health(url, "ok", timeout_s=240)
        texts = [complete(url, p)["choices"][0]["text"] for p in prompts]
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["state"] == "CREATED" and [b.get("TPU") for b in g["bundles"].values()] == [1.0, 1.0]]
        assert len(groups) == 2
        assert all(len(set(g["bundles_to_node_id"].values())) == 1 for g in groups), groups
        assert {n for g in groups for n in g["bundles_to_node_id"].values()} == {
            n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert texts == expected
        serve.delete("tpu_executor")  # drains the replicas; their workers and chips go back
        deadline = time.monotonic() + 60
        while ray.available_resources().get("TPU", 0) < 4:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.5)
