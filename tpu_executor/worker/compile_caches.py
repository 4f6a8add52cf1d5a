"""The persistent compile caches a worker uses: on the JAX path the executables a
``tpu-executor compile`` job left (else JAX's persistent cache), on torch_xla (TPU) XLA's
persistent cache. Every cache is named by the one key builder of ``worker/jax/aot.py``.
"""
from __future__ import annotations

import logging
import os

from tpu_executor.core.config import EngineConfig
from tpu_executor.worker.distributed import RankPlacement

logger = logging.getLogger(__name__)


def use_jax_caches(config: EngineConfig, jax, cache_dir: str, kernels_fingerprint: str):
    """The AOT job compiled for this engine and ``jax``'s chips (attached to ``jax``) when
    ``cache_dir`` holds one, else None after pointing JAX's persistent cache at the directory
    of the same key."""
    from tpu_executor.worker.jax.aot import AotJob, has_jobs, job_key, job_parts

    parts = job_parts(config, jax, kernels_fingerprint)  # one key for both
    job = AotJob.find(cache_dir, parts) if has_jobs(cache_dir) else None
    if job is not None:
        job.attach(jax)
        logger.info("executables compiled ahead of time: %s", job.path)
        return job
    logger.info("JAX compile cache: %s", jax.use_compile_cache(cache_dir, job_key(parts)))
    return None


def init_xla_compile_cache(config: EngineConfig, placement: RankPlacement, kernels_fingerprint: str) -> None:
    """torch_xla's persistent cache, one directory per engine key and rank (once a process)."""
    import torch_xla
    import torch_xla.runtime as xr

    from tpu_executor.worker.jax.aot import cache_parts, job_key
    from tpu_executor.worker.jax.runtime import target_parts

    if config.compile.cache_dir is None:
        return
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        # One cache per process: a second engine in the same process shares the first's.
        logger.info("XLA compile cache already initialised in this process; keeping it")
        return
    # The JAX path's key builder, with torch_xla as the compiler.
    target = target_parts("tpu", f"torch_xla {torch_xla.__version__}", placement.world_size, "torch_xla")
    path = os.path.join(config.compile.cache_dir, job_key(cache_parts(config, target, kernels_fingerprint)),
                        f"rank{placement.rank}")
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=False)
