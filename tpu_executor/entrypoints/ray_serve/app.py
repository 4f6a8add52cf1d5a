"""The Ray Serve application of ``tpu-executor serve --data-parallel-size N``: the engine
replicas' deployment, the OpenAI ingress in front of them, and running it until SIGTERM (the
serve command builds it from its flags, ``serve.app_builder`` for ``serve run`` / a KubeRay
``RayService``).
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any, Dict, Optional

import ray
from prometheus_client.core import CounterMetricFamily
from ray import serve
from ray.serve.config import RequestRouterConfig

from tpu_executor.engine.protocols import ServedModel
from tpu_executor.entrypoints.openai.config import ReplicaConfig, ServerConfig
from tpu_executor.entrypoints.openai.metrics import PREFIX
from tpu_executor.entrypoints.ray_serve import routing
from tpu_executor.entrypoints.ray_serve.replicas import BOARD_NAMESPACE, EngineReplica, ReplicaPool, board_name
from tpu_executor.executor import WorkerMaker

# Seconds between Serve's health checks of a replica: a dead engine is replaced this soon.
HEALTH_CHECK_PERIOD_S = 2.0


class RoutingCollector:
    """The router's decisions in this process, by reason (session, prefix, adapter, least_loaded)."""

    def collect(self):
        family = CounterMetricFamily(PREFIX + "routed_requests", "Requests routed to a replica, by reason.",
                                     labels=["reason"])
        for reason, count in sorted(routing.DECISIONS.items()):
            family.add_metric([reason], count)
        yield family


class OpenAIIngress:
    """The HTTP ingress: the single-engine server's app over a ``ReplicaPool``."""

    async def __init__(self, replicas, model_path: str, server: ServerConfig, wanted: int, app_name: str):
        from transformers import AutoTokenizer

        from tpu_executor.engine.validation import RequestChecks

        config, vocab_size = await replicas.describe.remote()  # waits for a replica to have warmed up
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        served = ServedModel(model_path, config.max_model_len, vocab_size)
        checks = RequestChecks(config, self.tokenizer, vocab_size)
        self.pool = ReplicaPool(replicas, served, checks, app_name, wanted, server.max_waiting_requests)
        self.server = server

    def __serve_build_asgi_app__(self):
        from tpu_executor.entrypoints.openai.api_server import build_app

        # Not ``self.app``: Serve's ingress wrapper has a read-only property of that name.
        self.http_app = build_app(self.pool, self.tokenizer, self.server, collectors=[RoutingCollector()])
        return self.http_app

    def drain(self) -> None:
        """Turn every new request away with 503 from now on (in-flight ones run on): the first
        step of a shutdown, before Serve's own deletion starts draining the replicas."""
        self.http_app.state.draining = True


def replica_deployment_options(engine_options: Dict[str, Any], server: ServerConfig,
                               replicas: ReplicaConfig) -> Dict[str, Any]:
    """Serve options of the replicas' deployment: chips as placement-group bundles (a replica
    of one chip holds it itself), health checks, the router, the replica count or autoscaler."""
    from tpu_executor.core.config import CacheConfig

    chips = engine_options.get("tensor_parallel_size", 1)
    options: Dict[str, Any] = dict(
        ray_actor_options={"num_cpus": 0, **({"resources": {"TPU": 1}} if chips == 1 else {})},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=60,
        graceful_shutdown_timeout_s=server.drain_timeout_s, max_ongoing_requests=server.max_waiting_requests,
        # Requests no replica can take wait at the ingress up to this many, then get 503.
        max_queued_requests=server.max_waiting_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=routing.PrefixAwareRouter,
            request_router_kwargs={"block_size": engine_options.get("block_size", CacheConfig.block_size),
                                   "imbalance_limit": replicas.imbalance_limit,
                                   "affinity": replicas.routing == "prefix"}))
    if chips > 1:
        # PACK keeps a replica's chips on one host whenever one host has them all.
        options.update(placement_group_bundles=[{"TPU": 1}] * chips, placement_group_strategy="PACK")
    if replicas.autoscales:
        options["autoscaling_config"] = {"min_replicas": replicas.data_parallel_size,
                                         "max_replicas": replicas.max_replicas,
                                         "target_ongoing_requests": replicas.target_ongoing_requests}
    else:
        options["num_replicas"] = replicas.data_parallel_size
    return options


def build_application(model_path: str, engine_options: Dict[str, Any], server: ServerConfig,
                      replicas: ReplicaConfig, worker_class: Optional[WorkerMaker] = None):
    """The Serve application: ``replicas.data_parallel_size`` engines behind one ingress.
    ``worker_class`` swaps in a ``Worker`` maker in every replica (the benchmark's held device)."""
    engine_options = {k: v for k, v in engine_options.items() if k != "ray_address"}  # replicas are on the cluster
    replica_class = serve.deployment(name="EngineReplica")(EngineReplica)
    replica_app = replica_class.options(**replica_deployment_options(engine_options, server, replicas)).bind(
        model_path, engine_options, server, worker_class)
    ingress_class = serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0},
                                     max_ongoing_requests=100_000,
                                     graceful_shutdown_timeout_s=server.drain_timeout_s)(serve.ingress()(OpenAIIngress))
    return ingress_class.bind(replica_app, model_path, server, replicas.data_parallel_size, replicas.app_name)


def run_replicated(app, server: ServerConfig, replicas: ReplicaConfig, ray_address: Optional[str],
                   chips_per_replica: int) -> None:
    """``tpu-executor serve --data-parallel-size N``: start the application on the Ray cluster,
    serve until SIGTERM or Ctrl-C, then drain every replica and give the chips back."""
    ray.init(address=ray_address, log_to_driver=False)
    check_chips(replicas.data_parallel_size, chips_per_replica)
    serve.start(http_options={"host": server.host, "port": server.port})
    start = time.perf_counter()
    serve.run(app, name=replicas.app_name, route_prefix="/", blocking=False)
    print(f"{replicas.data_parallel_size} replicas ready in {time.perf_counter() - start:.1f} s; serving "
          f"{server.model_name!r} on http://{server.host}:{server.port}/v1", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    print("draining the replicas", flush=True)
    serve.get_app_handle(replicas.app_name).drain.remote().result(timeout_s=30)
    shutdown(replicas.app_name)


def check_chips(replicas: int, chips_per_replica: int) -> None:
    """Fail with what to change unless the cluster has the chips for ``replicas`` engines."""
    needed, held = replicas * chips_per_replica, int(ray.cluster_resources().get("TPU", 0))
    if held < needed:
        raise SystemExit(f"{replicas} replicas of {chips_per_replica} chips need {needed} TPU chips but the Ray "
                         f"cluster has {held}: lower --data-parallel-size or --tensor-parallel-size, or join more "
                         "TPU hosts (without TPUs, `ray start --head --resources='{\"TPU\": 4}'` simulates 4)")


def shutdown(app_name: str) -> None:
    """Drain and delete the application (each replica finishes or aborts its requests within
    its graceful shutdown timeout), drop its stats board, stop Serve."""
    serve.delete(app_name)
    try:
        ray.kill(ray.get_actor(board_name(app_name), namespace=BOARD_NAMESPACE))
    except ValueError:
        pass  # never created
    serve.shutdown()
