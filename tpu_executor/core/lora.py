"""Multi-LoRA's request and adapter config (pure Python): which adapter a request runs with,
and what a PEFT adapter's ``adapter_config.json`` says (the engine's options: ``LoRAConfig``
in ``core/config.py``).

An adapter is a PEFT LoRA checkpoint: ``adapter_config.json`` and
``adapter_model.safetensors``. A linear layer ``W`` it targets computes
``x @ W + scale * (x @ A^T) @ B^T`` with ``A [r, in]``, ``B [out, r]`` and ``scale`` PEFT's:
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA, ``r`` and ``lora_alpha`` per
module where ``rank_pattern`` / ``alpha_pattern`` name it.
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (their Hugging Face names); anything else is refused.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(cfg: Mapping) -> Dict[str, Tuple[int, int]]:
    """(in, out) features of each projection an adapter may target, from a model's (text)
    config as a mapping."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inner = cfg["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}


def module_path(projection: str) -> str:
    """Where ``projection`` sits in a decoder layer (``self_attn.q_proj``, ``mlp.up_proj``)."""
    return f"self_attn.{projection}" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else f"mlp.{projection}"


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: the adapter a request runs with. ``lora_int_id`` (at least 1)
    identifies it in the engine; two requests with the same id share its slot."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def _pattern_value(patterns: Mapping[str, int], module: str, default):
    """PEFT's per-module override: the value of the first pattern naming ``module`` (the
    pattern is a regular expression matched against the module name's end)."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT LoRA ``adapter_config.json`` that inference needs."""

    r: int
    lora_alpha: float
    target_modules: Tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def rank_of(self, module: str) -> int:
        """The rank of the adapter on ``module`` (its dotted name in the checkpoint)."""
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scale_of(self, module: str) -> float:
        """PEFT's scaling of ``module``'s update: alpha / r, or alpha / sqrt(r) (rsLoRA)."""
        rank = self.rank_of(module)
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @classmethod
    def read(cls, path: str) -> "AdapterConfig":
        """The adapter config at ``path`` (a directory), refused with a message that names what
        this engine does not serve (DoRA, ``modules_to_save``, trained biases, other PEFT types)."""
        file = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(file):
            raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}: not a PEFT adapter directory")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON ({err})") from err
        return cls.parse(raw, path)

    @classmethod
    def parse(cls, raw: Mapping, path: str = "") -> "AdapterConfig":
        """``raw`` (the config's JSON object), checked."""
        where = f"LoRA adapter {path!r}"
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where} is a {raw.get('peft_type')} adapter; only LoRA adapters are served")
        if raw.get("use_dora"):
            raise ValueError(f"{where} uses DoRA (use_dora), which this engine does not serve")
        if raw.get("modules_to_save"):
            raise ValueError(f"{where} saves whole modules ({raw['modules_to_save']}): modules_to_save is not "
                             "served, only LoRA updates of the projections")
        if raw.get("bias", "none") != "none":
            raise ValueError(f"{where} trains biases (bias={raw['bias']!r}); only bias='none' is served")
        if raw.get("fan_in_fan_out"):
            raise ValueError(f"{where} stores fan_in_fan_out weights (Conv1D layers), which no model here has")
        targets = raw.get("target_modules")
        if isinstance(targets, str):  # PEFT: a regular expression over module names
            targets = tuple(t for t in TARGETS if re.fullmatch(targets, t) or re.search(rf"(^|\.){t}$", targets))
        r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        return cls(r=r, lora_alpha=float(alpha), target_modules=tuple(targets or ()),
                   use_rslora=bool(raw.get("use_rslora", False)), rank_pattern=dict(raw.get("rank_pattern") or {}),
                   alpha_pattern=dict(raw.get("alpha_pattern") or {}))

    def max_rank(self) -> int:
        """The largest rank of any module (``rank_pattern`` may raise it above ``r``)."""
        return max([self.r, *map(int, self.rank_pattern.values())])


def keep_recent(table: "collections.OrderedDict", key, value, capacity: int) -> None:
    """``table[key] = value`` as the most recent entry, the oldest dropped past ``capacity``
    (the adapters held read, here and in each worker)."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > capacity:
        table.popitem(last=False)


class AdapterSlots:
    """The scheduler's view of the device's adapter slots (1 to ``max_loras``; slot 0 is the
    base model): which adapter each holds and how many running requests use it. A request
    pins its adapter's slot while it runs; a slot nobody uses is given to another adapter,
    the one used longest ago first. The slots given out since the last ``take_loads`` are
    what the workers must write before the step runs; the adapters of ``take_reads`` what they
    start reading from disk, so that no step waits on a read."""

    def __init__(self, max_loras: int, max_cpu_loras: Optional[int] = None):
        self.holders: List[Optional[LoRARequest]] = [None] * (max_loras + 1)
        self.users = [0] * (max_loras + 1)
        self._last_used = [0] * (max_loras + 1)
        self._clock = 0
        self._loads: List[Tuple[int, LoRARequest]] = []
        # The adapters the workers hold read on the host (or are reading), the latest last: as
        # the workers' own ``max_cpu_loras`` cache (a difference only costs a read in a step).
        self._read: "collections.OrderedDict[int, LoRARequest]" = collections.OrderedDict()
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._reads: List[LoRARequest] = []

    def is_read(self, lora: LoRARequest) -> bool:
        """Whether the workers hold ``lora`` read, in a slot or on the host since an earlier
        step. If not, they are asked to start reading it (``take_reads``) and a request for it
        can run from the next step: the read overlaps the steps in between."""
        if self.slot_of(lora.lora_int_id) is not None or self._read.get(lora.lora_int_id) == lora:
            return True
        if lora not in self._reads:
            self._reads.append(lora)
        return False

    def take_reads(self) -> Tuple[LoRARequest, ...]:
        """Adapters asked for since the last call, for the workers to read in the background
        (from now on the workers hold them read)."""
        reads, self._reads = tuple(self._reads), []
        for lora in reads:
            keep_recent(self._read, lora.lora_int_id, lora, self.max_cpu_loras)
        return reads

    def slot_of(self, lora_int_id: int) -> Optional[int]:
        """The slot holding adapter ``lora_int_id``, or None."""
        for slot, holder in enumerate(self.holders):
            if holder is not None and holder.lora_int_id == lora_int_id:
                return slot
        return None

    def acquire(self, lora: LoRARequest) -> Optional[int]:
        """A slot holding ``lora`` for one more running request, or None when every slot is
        in use by other adapters."""
        slot = self.slot_of(lora.lora_int_id)
        if slot is None:
            idle = [s for s in range(1, len(self.holders)) if self.users[s] == 0]
            if not idle:
                return None
            # An empty slot first, then the one used longest ago.
            slot = min(idle, key=lambda s: (self.holders[s] is not None, self._last_used[s]))
            self.holders[slot] = lora
            self._loads.append((slot, lora))
            keep_recent(self._read, lora.lora_int_id, lora, self.max_cpu_loras)
        self.users[slot] += 1
        self._touch(slot)
        return slot

    def release(self, slot: int) -> None:
        """One running request of ``slot``'s adapter stopped (finished or preempted)."""
        if slot:
            self.users[slot] -= 1
            self._touch(slot)

    def forget(self, lora_int_id: int) -> bool:
        """Drop adapter ``lora_int_id`` from its slot (unloaded); False when a running request
        still uses it."""
        slot = self.slot_of(lora_int_id)
        if slot is not None and self.users[slot]:
            return False
        if slot is not None:
            self.holders[slot] = None
        self._read.pop(lora_int_id, None)
        return True

    @property
    def slots_in_use(self) -> int:
        """Slots whose adapter a running request uses."""
        return sum(1 for users in self.users[1:] if users)

    def take_loads(self) -> Tuple[Tuple[int, LoRARequest], ...]:
        """(slot, adapter) given out since the last call, for the workers to write."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock
