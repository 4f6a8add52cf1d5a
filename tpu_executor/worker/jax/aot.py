"""Executables compiled ahead of time (``tpu-executor compile``), found again by the machine
that runs them, and the one key every compile cache of an engine is found by.

A job is one engine's bucket plan compiled for one slice. It lies in ``CACHE_DIR/aot/<key>/``:
``manifest.json`` (what the key was made of, the KV-cache blocks and context length the
compile fixed, and the sha256 of every file of the job), ``programs/`` (the traced programs)
and ``executables/`` (JAX's serialized executables). Both are pickle-based: only files the
manifest names are read, each checked against its sha256 before it is unpickled.

The key (``job_parts``, ``job_key``) is computed identically on the compiling machine and on
the TPU host, and it also names the JAX path's persistent cache (``CACHE_DIR/<key>/``) and the
torch_xla path's: it is made of what the executables depend on: the model config's content,
the draft model's or EAGLE-3 head's config content (never a path: another checkpoint at the
same path is another key), the engine options that shape the graphs, the JAX path's kernel
sources, this package's sources, the library versions, and the target (platform, chip kind
and count, the compiler's flags: ``XLA_FLAGS`` but its dump options, and on a TPU libtpu's
version and ``LIBTPU_INIT_ARGS``). Nothing only the compiling machine has (its C compiler, its
cores) is part of it. A start that finds no job of its key logs one line naming what differs
from the nearest job in the directory and compiles as usual.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional

logger = logging.getLogger(__name__)

AOT_FOLDER = "aot"
MANIFEST = "manifest.json"
FOLDERS = ("programs", "executables")  # a job's pickled records, each file checked by its sha256


def model_config_text(checkpoint: str) -> str:
    """The checkpoint's config.json as canonical JSON (its content, not its bytes)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.dumps(json.load(f), sort_keys=True)


def engine_parts(config) -> Dict[str, object]:
    """The engine options that shape the compiled graphs (not where caches lie, nor how many
    threads compile)."""
    compile_config, scheduler = config.compile, config.scheduler
    return {"dtype": config.model.dtype, "quantization": config.model.quantization,
            "max_model_len": config.max_model_len, "block_size": config.cache.block_size,
            "num_blocks": config.cache.num_blocks, "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": scheduler.enable_chunked_prefill,
            "async_scheduling": scheduler.async_scheduling,
            "prefill_buckets": compile_config.prefill_buckets, "decode_buckets": compile_config.decode_buckets,
            "decode_context_buckets": compile_config.decode_context_buckets,
            "max_logprobs": compile_config.max_logprobs, "max_prefill_seqs": compile_config.max_prefill_seqs,
            "speculative": speculative_fields(config.speculative),
            "lora": (config.lora.max_loras, config.lora.max_lora_rank) if config.lora.enable_lora else None}


def speculative_fields(speculative) -> Optional[Dict[str, object]]:
    """The speculative config's fields but the draft checkpoint's path (its config's content is
    a part of its own: ``draft_config``)."""
    if speculative is None:
        return None
    return {name: value for name, value in sorted(asdict(speculative).items()) if name != "model"}


def cache_parts(config, target: Mapping[str, str], kernels_fingerprint: str) -> Dict[str, str]:
    """Everything an engine's compile caches are keyed by, by name (the miss line names the
    ones that differ); ``target``: the devices' description (``JaxRuntime.target``)."""
    import importlib.metadata

    from tpu_executor.worker.jax.runtime import LIBRARIES, source_fingerprint

    speculative = config.speculative
    draft = speculative.model if speculative is not None else None
    parts = {"model_config": model_config_text(config.model.model),
             "draft_config": model_config_text(draft) if draft is not None else "",
             **{name: repr(value) for name, value in engine_parts(config).items()},
             "kernels": kernels_fingerprint, "sources": source_fingerprint(),
             **{name: importlib.metadata.version(name) for name in LIBRARIES}}
    parts.update(target)
    return parts


def job_parts(config, runtime, kernels_fingerprint: str) -> Dict[str, str]:
    """``cache_parts`` of the JAX path on ``runtime``'s devices: an ahead-of-time job's, and
    its persistent cache's."""
    return cache_parts(config, runtime.target, kernels_fingerprint)


def job_key(parts: Dict[str, str]) -> str:
    """The folder name of ``parts``' caches."""
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class AotJob:
    """One compiled job in a cache directory; ``sha256``: per folder of ``FOLDERS``, each of
    its files' sha256 by name."""

    path: str
    parts: Dict[str, str]
    num_blocks: int
    max_model_len: int
    target: str
    sha256: Dict[str, Dict[str, str]] = field(default_factory=dict)

    @classmethod
    def create(cls, cache_dir: str, parts: Dict[str, str], num_blocks: int, max_model_len: int,
               target: str) -> "AotJob":
        """A new job's folder (an older one of the same key is replaced as it is written)."""
        job = cls(os.path.join(cache_dir, AOT_FOLDER, job_key(parts)), parts, num_blocks, max_model_len, target)
        os.makedirs(job.path, exist_ok=True)
        return job

    def write_manifest(self, runtime) -> None:
        """Written last (a job without its manifest is never found), with the sha256 of every
        program and executable ``runtime``'s compile kept in the job (``attach(writes=True)``)."""
        from tpu_executor.worker.jax.programs import write_atomically

        sha256 = {"programs": runtime.programs.digests, "executables": runtime.executables.digests}
        record = {"target": self.target, "num_blocks": self.num_blocks, "max_model_len": self.max_model_len,
                  "parts": self.parts, "sha256": sha256}
        write_atomically(self.path, MANIFEST, json.dumps(record, indent=1, sort_keys=True).encode())

    @classmethod
    def read(cls, path: str) -> Optional["AotJob"]:
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                record = json.load(f)
            sha256 = {folder: dict(record["sha256"][folder]) for folder in FOLDERS}
            return cls(path, record["parts"], int(record["num_blocks"]), int(record["max_model_len"]),
                       record["target"], sha256)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def find(cls, cache_dir: str, parts: Dict[str, str]) -> Optional["AotJob"]:
        """The job compiled for exactly ``parts``, or None (with a line saying why not)."""
        job = cls.read(os.path.join(cache_dir, AOT_FOLDER, job_key(parts)))
        if job is not None and job.parts == parts:
            return job
        others = [j for j in map(cls.read, _job_folders(cache_dir)) if j is not None]
        if others:
            nearest = min(others, key=lambda j: len(differences(j.parts, parts)))
            logger.warning("no executables compiled ahead of time for this engine in %s: %s; compiling here",
                           cache_dir, "; ".join(differences(nearest.parts, parts)))
        return None

    def attach(self, runtime, writes: bool = False) -> None:
        """Let ``runtime``'s compiled functions load this job's programs and executables, those
        the manifest names, checked against their sha256 (or, ``writes``: keep the ones they
        compile in it, noting their sha256 for the manifest)."""
        from tpu_executor.worker.jax.programs import ExecutableStore, ProgramStore

        programs, executables = (None, None) if writes else (self.sha256.get(f, {}) for f in FOLDERS)
        runtime.programs = ProgramStore(os.path.join(self.path, "programs"), expected=programs)
        runtime.executables = ExecutableStore(os.path.join(self.path, "executables"), writes=writes,
                                              expected=executables)


def has_jobs(cache_dir: str) -> bool:
    """Whether ``cache_dir`` holds any compiled job (a start looks for its own only then)."""
    return os.path.isdir(os.path.join(cache_dir, AOT_FOLDER))


def _job_folders(cache_dir: str) -> List[str]:
    root = os.path.join(cache_dir, AOT_FOLDER)
    return [os.path.join(root, name) for name in sorted(os.listdir(root))] if os.path.isdir(root) else []


def differences(compiled: Dict[str, str], here: Dict[str, str]) -> List[str]:
    """What differs between a compiled job's parts and this engine's, as short phrases."""
    def shown(value: Optional[str]) -> str:
        if value is None:
            return "absent"
        return value if len(value) <= 40 else value[:12] + "..."

    return [f"{name} differs (compiled: {shown(compiled.get(name))}, here: {shown(here.get(name))})"
            for name in sorted(set(compiled) | set(here)) if compiled.get(name) != here.get(name)]
