"""What a compile for a TPU slice found, per chip: each graph's figures as the compiler accounts
them, the job's report (its fit and verdict), and the error of a job that cannot fit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.tpu_slices import GIB, Target


class DoesNotFit(ValueError):
    """The job cannot fit the slice's HBM; the message says by how much and what to change."""


@dataclass(frozen=True)
class GraphFigures:
    """One compiled graph as the compiler accounts it, per chip; ``inputs``: its arguments that
    do not stay resident, ``resident``: the bytes that stay beside it (``TargetWorker.resident``)."""

    name: str
    function: str
    compile_seconds: float
    arguments: int
    outputs: int
    temp: int
    code: int
    alias: int
    flops: float
    bytes_accessed: float  # libtpu's count, every memory space
    pallas_kernels: Tuple[str, ...]
    providers: Tuple[Tuple[str, str], ...]  # (op, provider) of every op the graph calls
    inputs: int = 0
    resident: int = 0
    hbm_bytes: Optional[float] = None  # of bytes_accessed, the HBM traffic; None where the HLO was not read

    @property
    def peak(self) -> int:
        """Bytes live at once while it runs: what stays resident, its other inputs, its outputs
        not written in place, its scratch and its code."""
        return self.resident + self.inputs + self.outputs - self.alias + self.temp + self.code

    @classmethod
    def of(cls, record, resident, hlo_text: Optional[str] = None) -> "GraphFigures":
        """``record`` (``graphs.CompileRecord``) beside ``resident`` (``target.Resident``);
        with its compiled text, its HBM bytes too (``hlo_audit.hbm_bytes``)."""
        from tpu_executor.worker.jax.hlo_audit import hbm_bytes

        memory = record.compiled.memory_analysis()
        cost = record.compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
        kernels = record.program.kernels
        pallas = tuple(sorted({k.op for k in kernels if k.pallas}))
        accessed = float(cost.get("bytes accessed", 0.0))
        return cls(record.label, record.function, record.seconds, memory.argument_size_in_bytes,
                   memory.output_size_in_bytes, memory.temp_size_in_bytes, memory.generated_code_size_in_bytes,
                   memory.alias_size_in_bytes, float(cost.get("flops", 0.0)), accessed, pallas,
                   tuple(sorted({(k.op, k.provider) for k in kernels})),
                   sum(size for tensor, size in record.inputs if tensor not in resident.state_ids), resident.bytes,
                   None if hlo_text is None else hbm_bytes(accessed, hlo_text))


@dataclass
class CompileReport:
    """What ``compile_job`` found: the figures of every graph and the fit."""

    target: Target
    libtpu: str
    config: EngineConfig
    weight_bytes: int
    block_bytes: int
    usable_bytes: int
    num_blocks: int
    max_model_len: int
    draft_weight_bytes: int = 0  # the draft model's or EAGLE-3 head's share of weight_bytes
    resident_bytes: int = 0  # weights, KV caches and state at num_blocks (``TargetWorker.resident``)
    graphs: List[GraphFigures] = field(default_factory=list)
    kernel_warnings: List[str] = field(default_factory=list)
    weight_copies: List[str] = field(default_factory=list)  # ``weight_copies``
    resized: str = ""  # why the cache shrank below what the probes sized (``compile_fit``)
    compile_threads: int = 1  # graphs libtpu compiled at once
    job_path: Optional[str] = None

    @property
    def peak_graph(self) -> GraphFigures:
        return max(self.graphs, key=lambda g: g.peak)

    @property
    def peak_bytes(self) -> int:
        return self.peak_graph.peak if self.graphs else self.resident_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def verdict(self) -> str:
        if self.fits:
            return "fits"
        over = self.peak_bytes - self.usable_bytes
        return (f"does not fit: graph '{self.peak_graph.name}' needs {self.peak_bytes / GIB:.2f} GiB per chip "
                f"({self.resident_bytes / GIB:.2f} GiB of it resident), {over / GIB:.2f} GiB ({over} bytes) over the "
                f"{self.usable_bytes / GIB:.2f} GiB usable; " + remedies() + self._fewer_blocks(over))

    def _fewer_blocks(self, over: int) -> str:
        """``, or --num-blocks N``: a cache that leaves the graph room, where one is long enough."""
        blocks = self.num_blocks - -(-over // max(1, self.block_bytes))
        return f", or --num-blocks {blocks}" if blocks >= _min_blocks(self.config) else ""


def remedies() -> str:
    return ("lower --max-num-seqs or --max-model-len or the largest bucket, use more chips (a larger --target), "
            "or --quantization int8")


def _min_blocks(config: EngineConfig) -> int:
    """The fewest blocks a job may run with: one sequence of the context length the user set
    (a default one is lowered to what fits), plus the null block."""
    return config.max_blocks_per_seq + 1 if config.model.max_model_len is not None else 2


def state_holders(report: CompileReport) -> str:
    """Who keeps device state beside the KV cache, as messages name them."""
    return "the sampler's and the drafter's state" if report.draft_weight_bytes else "the sampler's state"
