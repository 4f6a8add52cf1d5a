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
from typing import Dict, List, Mapping, Optional, Set, Tuple

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
    pattern is a regular expression matched against the module name's end; ``parse`` has
    compiled each one)."""
    for pattern, value in patterns.items():
        if _module_pattern(pattern).fullmatch(module):
            return value
    return default


def _module_pattern(pattern: str) -> "re.Pattern":
    return re.compile(rf"(.*\.)?({pattern})")


# PEFT writes a few kilobytes; anything far larger is not an adapter config.
MAX_CONFIG_BYTES = 1 << 20
# Far above any trained adapter's rank: bounds what scale_of divides by.
MAX_RANK = 1 << 16


def _shown(value) -> str:
    """``value`` for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rank(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANK:
        raise ValueError(f"{where} must be an integer in [1, {MAX_RANK}], got {_shown(value)}")
    return value


def _alpha(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {_shown(value)}")
    try:
        alpha = float(value)
    except OverflowError:  # an integer beyond float's range
        alpha = math.inf
    if not math.isfinite(alpha):
        raise ValueError(f"{where} must be a finite number, got {_shown(value)}")
    return alpha


def _patterns(raw: Mapping, key: str, value_of, where: str) -> Dict[str, object]:
    """``raw[key]`` (``rank_pattern`` or ``alpha_pattern``): regular expressions over module
    names, each compiled here, to values checked by ``value_of``."""
    patterns = raw.get(key)
    if patterns is None:
        return {}
    if not isinstance(patterns, dict):
        raise ValueError(f"{where}: {key} must be an object of module patterns, got {_shown(patterns)}")
    for pattern in patterns:
        try:
            re.compile(pattern)
            _module_pattern(pattern)
        except (re.error, TypeError) as err:
            raise ValueError(f"{where}: {key} key {_shown(pattern)} is not a valid regular expression "
                             f"({err})") from None
    return {pattern: value_of(value, f"{where}: {key}[{_shown(pattern)}]") for pattern, value in patterns.items()}


def _targets(targets, where: str) -> Tuple[str, ...]:
    """``target_modules``: module names, or (PEFT) one regular expression over them."""
    if targets is None:
        return ()
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as err:
            raise ValueError(f"{where}: target_modules {_shown(targets)} is not a valid regular expression "
                             f"({err})") from None
        return tuple(t for t in TARGETS if pattern.fullmatch(t) or re.search(rf"(^|\.){t}$", targets))
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}: target_modules must be a list of module names or a regular expression, "
                         f"got {_shown(targets)}")
    return tuple(targets)


def _refuse_unserved(raw: Mapping, where: str) -> None:
    """What PEFT can train but this engine does not serve."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where} is a {_shown(raw.get('peft_type'))} adapter (peft_type); only LoRA adapters "
                         "are served")
    if raw.get("use_dora"):
        raise ValueError(f"{where} uses DoRA (use_dora), which this engine does not serve")
    if raw.get("modules_to_save"):
        raise ValueError(f"{where} saves whole modules ({_shown(raw['modules_to_save'])}): modules_to_save is "
                         "not served, only LoRA updates of the projections")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where} trains biases (bias={_shown(raw['bias'])}); only bias='none' is served")
    if raw.get("fan_in_fan_out"):
        raise ValueError(f"{where} stores fan_in_fan_out weights (Conv1D layers), which no model here has")


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
        this engine does not serve (DoRA, ``modules_to_save``, trained biases, other PEFT types)
        or what in the file is not what PEFT writes."""
        file = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(file):
            raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}: not a PEFT adapter directory")
        try:
            with open(file, "rb") as f:
                text = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as err:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} cannot be read ({err})") from err
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes, not a PEFT "
                             "adapter config")
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as err:  # ValueError: not JSON, not UTF-8, too many digits
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON ({err})") from err
        return cls.parse(raw, path)

    @classmethod
    def parse(cls, raw: Mapping, path: str = "") -> "AdapterConfig":
        """``raw`` (the config's JSON value), checked: anything PEFT would not have written
        raises ValueError naming the key."""
        where = f"LoRA adapter {path!r}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
        _refuse_unserved(raw, where)
        r = _rank(raw.get("r"), f"{where}: r")
        use_rslora = raw.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ValueError(f"{where}: use_rslora must be true or false, got {_shown(use_rslora)}")
        return cls(r=r, lora_alpha=_alpha(raw.get("lora_alpha", r), f"{where}: lora_alpha"),
                   target_modules=_targets(raw.get("target_modules"), where), use_rslora=use_rslora,
                   rank_pattern=_patterns(raw, "rank_pattern", _rank, where),
                   alpha_pattern=_patterns(raw, "alpha_pattern", _alpha, where))

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
    start reading from disk, so that no step waits on a read.

    A slot whose write failed (``failed``) or whose adapter was unloaded (``forget``) is
    emptied: the workers are told to zero it (``(slot, None)`` among the loads) and the adapter
    counts as unread, so a later request for it reads it again from disk."""

    def __init__(self, max_loras: int, max_cpu_loras: Optional[int] = None):
        self.holders: List[Optional[LoRARequest]] = [None] * (max_loras + 1)
        self.users = [0] * (max_loras + 1)
        self._last_used = [0] * (max_loras + 1)
        self._clock = 0
        self._loads: List[Tuple[int, Optional[LoRARequest]]] = []
        # The adapters the workers hold read on the host (or are reading), the latest last: as
        # the workers' own ``max_cpu_loras`` cache (a difference only costs a read in a step).
        self._read: "collections.OrderedDict[int, LoRARequest]" = collections.OrderedDict()
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._reads: List[LoRARequest] = []
        # Slots whose adapter was unloaded while running requests still use it: emptied when
        # the last one leaves, and no new request joins them.
        self._unloading: Set[int] = set()

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
        """The slot holding adapter ``lora_int_id`` for new requests, or None."""
        for slot, holder in enumerate(self.holders):
            if holder is not None and holder.lora_int_id == lora_int_id and slot not in self._unloading:
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
            if not self.users[slot] and slot in self._unloading:
                self._empty(slot)

    def forget(self, lora_int_id: int) -> bool:
        """Unload adapter ``lora_int_id``: the workers zero its slot once no running request
        uses it (at the next step when none does; True then, False while requests still run
        with it); no new request joins it, and it is no longer counted as read."""
        self._read.pop(lora_int_id, None)
        slot = self.slot_of(lora_int_id)
        if slot is None:
            return True
        if self.users[slot]:
            self._unloading.add(slot)
            return False
        self._empty(slot)
        return True

    def failed(self, slot: int, lora_int_id: int) -> None:
        """The workers could not write adapter ``lora_int_id`` into ``slot`` (they left it
        empty, on at least one rank): the slot no longer holds it, every rank zeroes it, and a
        later request for it reads it again. The running requests of that slot are failed by
        the caller (their users count drops as they leave)."""
        self._read.pop(lora_int_id, None)
        holder = self.holders[slot]
        if holder is not None and holder.lora_int_id == lora_int_id:
            self._empty(slot)

    @property
    def slots_in_use(self) -> int:
        """Slots whose adapter a running request uses."""
        return sum(1 for users in self.users[1:] if users)

    def take_loads(self) -> Tuple[Tuple[int, Optional[LoRARequest]], ...]:
        """(slot, adapter) given out since the last call, for the workers to write, in order
        ((slot, None): zero the slot)."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def _empty(self, slot: int) -> None:
        self.holders[slot] = None
        self._unloading.discard(slot)
        self._loads.append((slot, None))

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock
