"""The replicated server's pieces that need no cluster: the router's prefix, session and
adapter affinity, the replica config's checks, the replica deployment's options, per-replica metrics
and request times moved onto the ingress's clock."""
from __future__ import annotations

import pytest

from tpu_executor.core.request import RequestMetrics
from tpu_executor.engine.stats import EngineStats
from tpu_executor.entrypoints.openai.config import ReplicaConfig, ServerConfig
from tpu_executor.entrypoints.openai.metrics import ServerMetrics
from tpu_executor.entrypoints.ray_serve.app import replica_deployment_options
from tpu_executor.entrypoints.ray_serve.replicas import in_local_time
from tpu_executor.entrypoints.ray_serve.routing import Preference, PrefixAffinity, block_hashes

SYSTEM = list(range(100, 164))  # four blocks of 16


def test_block_hashes_name_whole_prefixes():
    assert len(block_hashes(SYSTEM + [1, 2, 3], 16)) == 4  # a partial block has no hash
    assert block_hashes(SYSTEM, 16)[:2] == block_hashes(SYSTEM[:32] + [9] * 40, 16)[:2]
    # The same block after another prefix is another prefix.
    assert block_hashes([5] * 16 + SYSTEM[:16], 16)[1] != block_hashes(SYSTEM[:16], 16)[0]


def test_a_request_goes_where_its_longest_prefix_went():
    affinity = PrefixAffinity(block_size=16)
    assert affinity.preferred(SYSTEM, None, ["a", "b"]).reason == "least_loaded"
    affinity.record(SYSTEM[:32], None, "a")
    affinity.record(SYSTEM, None, "b")
    assert affinity.preferred(SYSTEM + [7, 8], None, ["a", "b"]) == affinity.preferred(SYSTEM, None, ["a", "b"])
    assert affinity.preferred(SYSTEM + [7], None, ["a", "b"]).replica == "b"
    assert affinity.preferred(SYSTEM[:40], None, ["a", "b"]).replica == "b"  # b was sent those 2 blocks last
    assert affinity.preferred(SYSTEM, None, ["a"]).replica == "a"  # b is gone: a holds the first two blocks
    assert affinity.preferred([1] * 64, None, ["a", "b"]).replica is None


def test_a_session_sticks_to_its_replica_until_that_replica_is_gone():
    affinity = PrefixAffinity(block_size=16)
    affinity.record([1, 2, 3], "s1", "a")
    affinity.record(SYSTEM, None, "b")
    choice = affinity.preferred(SYSTEM, "s1", ["a", "b"])
    assert (choice.replica, choice.reason) == ("a", "session")  # the session wins over the prefix
    affinity.forget("a")
    assert affinity.preferred(SYSTEM, "s1", ["a", "b"]).replica == "b"  # a's entries are gone


def test_an_adapters_requests_go_where_it_went_and_its_prefixes_hash_apart():
    """A prefix sent under adapter 1 is no prefix of the base model's (their KV differs); with
    no prefix known, a request goes where its adapter went last, until that replica is gone."""
    affinity = PrefixAffinity(block_size=16)
    assert block_hashes(SYSTEM, 16, adapter=1) != block_hashes(SYSTEM, 16)
    affinity.record(SYSTEM, None, "a", adapter=1)
    affinity.record([5] * 16, None, "b", adapter=2)
    assert affinity.preferred(SYSTEM, None, ["a", "b"], adapter=1) == Preference("a", "prefix")
    assert affinity.preferred(SYSTEM, None, ["a", "b"]).reason == "least_loaded"  # the base's own prefix
    assert affinity.preferred([7] * 40, None, ["a", "b"], adapter=2) == Preference("b", "adapter")
    assert affinity.preferred([7] * 40, None, ["a", "b"], adapter=3).reason == "least_loaded"
    affinity.forget("b")
    assert affinity.preferred([7] * 40, None, ["a", "b"], adapter=2).reason == "least_loaded"


def test_the_tables_keep_only_the_most_recent_entries():
    affinity = PrefixAffinity(block_size=16, capacity=4)
    affinity.record(SYSTEM, None, "a")  # four blocks fill the table
    affinity.record([9] * 16, None, "b")  # one more pushes out the oldest (the first block)
    assert affinity.preferred(SYSTEM[:16], None, ["a", "b"]).replica is None
    assert affinity.preferred(SYSTEM, None, ["a", "b"]).replica == "a"
    with pytest.raises(ValueError, match="block_size"):
        PrefixAffinity(block_size=0)


@pytest.mark.parametrize("fields,words", [
    (dict(data_parallel_size=0), "data_parallel_size must be a positive integer"),
    (dict(data_parallel_size=4, max_replicas=2), "max_replicas (2) must be at least data_parallel_size (4)"),
    (dict(routing="random"), "routing must be one of prefix, least_loaded"),
    (dict(imbalance_limit=-1), "imbalance_limit must be >= 0"),
])
def test_a_bad_replica_config_names_the_field(fields, words):
    with pytest.raises(ValueError) as err:
        ReplicaConfig(**fields)
    assert words in str(err.value)


def test_replica_options_reserve_chips_and_scale_as_asked():
    server = ServerConfig(model_name="m", drain_timeout_s=12.0, max_waiting_requests=50)
    one_chip = replica_deployment_options({}, server, ReplicaConfig(data_parallel_size=3))
    assert one_chip["num_replicas"] == 3 and one_chip["ray_actor_options"]["resources"] == {"TPU": 1}
    assert "placement_group_bundles" not in one_chip and one_chip["graceful_shutdown_timeout_s"] == 12.0
    four = replica_deployment_options({"tensor_parallel_size": 4, "block_size": 32}, server,
                                      ReplicaConfig(data_parallel_size=2, max_replicas=6, routing="least_loaded"))
    assert four["placement_group_bundles"] == [{"TPU": 1}] * 4 and four["placement_group_strategy"] == "PACK"
    assert "resources" not in four["ray_actor_options"]  # the replica itself holds no chip; its workers do
    assert four["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 16}
    assert "num_replicas" not in four
    kwargs = four["request_router_config"].request_router_kwargs
    assert kwargs == {"block_size": 32, "imbalance_limit": 8, "affinity": False}


def test_metrics_label_each_replicas_figures():
    text = ServerMetrics().render({"r1": EngineStats(num_running=3, prefix_cache_hits=64),
                                   "r2": EngineStats(num_running=1)}).decode()
    assert 'tpu_executor:num_requests_running{replica="r1"} 3.0' in text
    assert 'tpu_executor:num_requests_running{replica="r2"} 1.0' in text
    assert 'tpu_executor:prefix_cache_hits_total{replica="r1"} 64.0' in text
    single = ServerMetrics().render({"": EngineStats(num_running=2)}).decode()
    assert "tpu_executor:num_requests_running 2.0" in single and "replica=" not in single


def test_a_replicas_request_times_keep_their_durations_on_the_local_clock():
    moved = in_local_time(RequestMetrics(1000.0, 1000.5, 1002.0), arrival_time=7.0)
    assert (moved.arrival_time, moved.first_scheduled_time, moved.first_token_time) == (7.0, 7.5, 9.0)
    assert in_local_time(RequestMetrics(1000.0), 7.0).first_token_time is None


def test_the_rayservice_example_builds_the_application():
    """docs/serving.md's RayService: its import path is ``app_builder`` and its args are flags
    the serve command takes."""
    import importlib
    import pathlib
    import re

    import yaml
    from ray.serve import Application

    text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text()
    service = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    application = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    module, name = application["import_path"].split(":")
    app = getattr(importlib.import_module(module), name)(application["args"])
    assert isinstance(app, Application)
