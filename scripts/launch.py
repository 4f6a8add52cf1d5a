"""Multi-host launch: join a running Ray cluster, check its TPU chips, run offline generation.

On a TPU VM pod slice (every host runs the same software and can read the checkpoint):

    ray start --head --port=6379                          # on host 0
    ray start --address=HOST0_IP:6379                     # on every other host
    python -m scripts.launch --ray-address auto --tensor-parallel-size 8 --model DIR   # on host 0

Ray detects each host's chips as the ``TPU`` resource. The engine puts one worker on each
chip, ranks contiguous per host with the driver's host first. ``--check-only`` prints the
cluster's chips per host and stops; other options go to ``tpu-executor generate``.
"""
from __future__ import annotations

import argparse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray-address", default="auto", help="the running cluster ('auto': this host's)")
    parser.add_argument("--tensor-parallel-size", type=int, required=True, help="chips to shard the model over")
    parser.add_argument("--check-only", action="store_true", help="check the cluster, do not load a model")
    return parser.parse_known_args(argv)


def describe_cluster() -> str:
    """One line per live host: its address and TPU chips."""
    import ray

    lines = [f"  {n['NodeManagerAddress']}: {int(n['Resources'].get('TPU', 0))} TPU chips"
             for n in ray.nodes() if n["Alive"]]
    return "\n".join(["Ray cluster:"] + lines)


def main(argv=None) -> None:
    args, generate_args = parse_args(argv)
    import ray

    from tpu_executor import cli
    from tpu_executor.executor.ray_executor import check_cluster

    ray.init(address=args.ray_address, ignore_reinit_error=True, log_to_driver=False)
    print(describe_cluster())
    check_cluster(args.tensor_parallel_size)
    print(f"tensor_parallel_size {args.tensor_parallel_size}: the cluster has the chips")
    if not args.check_only:
        cli.main(["generate"] + generate_args + ["--tensor-parallel-size", str(args.tensor_parallel_size),
                                                 "--ray-address", args.ray_address])


if __name__ == "__main__":
    main()
