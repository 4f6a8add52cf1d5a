"""PEFT LoRA adapters: read from disk, checked against the base model, written into slots.

``read_adapter`` reads an adapter directory once (the host keeps it: ``max_cpu_loras``);
``adapter_updates`` matches each of its tensor pairs with the layer it updates (by the
checkpoint names the base model loads from, so packed QKV and gate/up find their shard) and
checks every shape against that layer, so an adapter trained for another model is refused by
its shapes (``base_model_name_or_path`` is often a hub name that says nothing here);
``write_adapter`` puts one into a device slot of every layer.
"""
from __future__ import annotations

import collections
import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tpu_executor.core.lora import (
    TARGETS,
    WEIGHTS_FILE,
    AdapterConfig,
    LoRARequest,
    keep_recent,
    module_path,
    projection_shapes,
)
from tpu_executor.core.step import LoRAFailure, completed_future
from tpu_executor.models.layers.lora import LoRASlots

logger = logging.getLogger(__name__)

# PEFT's names: base_model.model.<module>.lora_A.weight (or lora_B; an adapter name may sit
# before .weight in older exports).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")
_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
                           r"(?P<projection>q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")


@dataclass(frozen=True)
class Adapter:
    """An adapter read from disk: its config and, per target module, (A ``[r, in]``, B ``[out, r]``)."""

    path: str
    config: AdapterConfig
    modules: Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Update:
    """One projection's adapter as a layer takes it."""

    module: str  # its name in the checkpoint
    layer: LoRASlots
    shard_id: object
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float


def _weights_file(path: str) -> str:
    """The adapter's weight file; ValueError when it has none."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    return file


def _load_weights(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of the adapter's weight file; ValueError when it is missing or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = _weights_file(path)
    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} cannot be read ({err})") from err


def read_adapter(path: str) -> Adapter:
    """The adapter in directory ``path``; a missing, corrupt or incomplete file, or a scale or
    weight that is not finite, raises ValueError naming it."""
    config = AdapterConfig.read(path)
    tensors = _load_weights(path)
    halves: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A or B weight")
        halves.setdefault(match["module"], {})[match["which"]] = tensor
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_{''.join(pair)} but not both A and B")
        if pair["A"].dim() != 2 or pair["B"].dim() != 2:
            raise ValueError(f"LoRA adapter {path!r}: {module}'s A and B must be matrices")
    if not halves:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    check_finite(path, tensors)
    return Adapter(path, config, {module: (pair["A"], pair["B"]) for module, pair in halves.items()})


def check_finite(path: str, tensors: Dict[str, torch.Tensor]) -> None:
    """ValueError naming the first module whose weights hold a value that is not finite: one
    such value in a slot would turn its requests' outputs to NaN. (``AdapterConfig.parse``
    refuses a scale that is not finite.)"""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            match = _TENSOR.match(name)
            module = f"{match['module']}'s lora_{match['which']}" if match else name
            raise ValueError(f"LoRA adapter {path!r}: {module} holds values that are not finite (NaN or infinity)")


def check_adapter(path: str, model_config: Dict, max_rank: int) -> AdapterConfig:
    """Check the adapter at ``path`` against the base model's config (a mapping) before any
    request runs with it: a target this engine does not serve, a layer the model lacks, a rank
    above ``max_rank``, a shape that does not match the base, or a scale or weight that is not
    finite raises ValueError naming it. (Each worker reads and checks it again when it writes
    it into a slot: the file may change in between, or differ on another host.)"""
    config = AdapterConfig.read(path)
    tensors = _load_weights(path)
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    expected = projection_shapes(model_config)
    experts = (model_config.get("num_local_experts") or model_config.get("num_experts") or 1) > 1
    halves: Dict[str, str] = {}
    for name, shape in shapes.items():
        match = _TENSOR.match(name)
        layer = _LAYER_MODULE.fullmatch(match["module"]) if match else None
        if (layer is None or int(layer["layer"]) >= model_config["num_hidden_layers"]
                or module_path(layer["projection"]) != f"{layer['block']}.{layer['projection']}"):
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA weight of a decoder layer's "
                             f"projection ({', '.join(TARGETS)}) of this model")
        projection = layer["projection"]
        if experts and layer["block"] == "mlp":
            raise ValueError(f"LoRA adapter {path!r}: {match['module']}: adapters on a mixture of experts' MLP "
                             "are not served")
        rank = config.rank_of(match["module"])
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: {match['module']} has rank {rank}, above max_lora_rank "
                             f"{max_rank}")
        in_features, out_features = expected[projection]
        want = (rank, in_features) if match["which"] == "A" else (out_features, rank)
        if shape != want:
            raise ValueError(f"LoRA adapter {path!r}: {name} has shape {shape}, the base model needs {want}: "
                             "the adapter was trained for another model")
        halves[match["module"]] = halves.get(match["module"], "") + match["which"]
    incomplete = sorted(module for module, which in halves.items() if sorted(which) != ["A", "B"])
    if incomplete:
        raise ValueError(f"LoRA adapter {path!r}: {incomplete[0]} has lora_A or lora_B, not both")
    if not halves:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    check_finite(path, tensors)
    return config


def adapter_updates(model: torch.nn.Module, adapter: Adapter, max_rank: int) -> List[Update]:
    """Every layer update of ``adapter`` on ``model`` (whose layers serve adapters), checked:
    a target this engine does not serve, a module the model lacks, a rank above ``max_rank``
    or a shape that does not match the base layer raises ValueError naming it."""
    updates = []
    for module, (lora_a, lora_b) in sorted(adapter.modules.items()):
        where = f"LoRA adapter {adapter.path!r}: {module}"
        projection = module.rsplit(".", 1)[-1]
        if projection not in TARGETS:
            raise ValueError(f"{where}: adapters on {projection} are not served (only {', '.join(TARGETS)})")
        rank = adapter.config.rank_of(module)
        if lora_a.shape[0] != rank:
            raise ValueError(f"{where}: lora_A has rank {lora_a.shape[0]}, the config says {rank}")
        if rank > max_rank:
            raise ValueError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
        layer, shard_id = _layer_of(model, module, where)
        updates.append(Update(module, layer, shard_id, lora_a, lora_b, adapter.config.scale_of(module)))
    return updates


def _layer_of(model: torch.nn.Module, module: str, where: str) -> Tuple[LoRASlots, object]:
    """The layer (and packed shard) that checkpoint module ``module`` loads into."""
    param_name, shard_id = model.checkpoint_target(f"{module}.weight")
    try:
        layer = model.get_submodule(param_name.rsplit(".", 1)[0])
    except AttributeError:
        raise ValueError(f"{where}: the model has no such module (an adapter for another architecture)") from None
    if not isinstance(layer, LoRASlots):
        raise ValueError(f"{where}: adapters on this layer (a mixture of experts' weights) are not served")
    if "lora_a" not in layer._buffers:
        raise ValueError(f"{where}: the engine serves no adapters (enable_lora)")
    return layer, shard_id


def write_adapter(model: torch.nn.Module, slot: int, updates: List[Update]) -> None:
    """Make ``slot`` of every layer hold the adapter of ``updates`` (zero where it has none);
    on an error the slot is left zero (ValueError naming the module when a layer refuses it)."""
    clear_slot(model, slot)
    for update in updates:
        try:
            update.layer.set_lora(slot, update.shard_id, update.lora_a, update.lora_b, update.scale)
        except Exception as err:
            clear_slot(model, slot)
            if isinstance(err, ValueError):
                raise ValueError(f"{update.module}: {err}") from err
            raise


def clear_slot(model: torch.nn.Module, slot: int) -> None:
    """Zero ``slot`` in every layer that serves adapters."""
    for layer in lora_layers(model):
        layer.clear_lora(slot)


def lora_layers(model: torch.nn.Module) -> List[LoRASlots]:
    """The layers with adapter slots."""
    return [m for m in model.modules() if isinstance(m, LoRASlots) and "lora_a" in m._buffers]


def enable_lora(model: torch.nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
    """Give the projections adapters may target (attention's and the dense MLP's) their slots."""
    for name, layer in model.named_modules():
        if isinstance(layer, LoRASlots) and _servable(name):
            layer.enable_lora(num_slots, max_rank, dtype)


def _servable(name: str) -> bool:
    """The attention projections and a dense MLP's (not a router, not the LM head)."""
    return name.endswith(("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))


def failure_message(lora: LoRARequest, err: Exception) -> str:
    """What a request of ``lora`` is told when its adapter could not be loaded: the adapter's
    name and the reason, without its directory on the server (the reason names the path the
    adapter was loaded from; the server's log keeps it)."""
    reason = str(err)
    paths = {lora.lora_path, os.path.abspath(lora.lora_path), os.path.realpath(lora.lora_path)} if lora.lora_path \
        else set()
    for path in sorted(paths, key=len, reverse=True):
        reason = reason.replace(f"LoRA adapter {path!r}: ", "").replace(repr(path), repr(lora.lora_name))
        reason = reason.replace(path.rstrip(os.sep) + os.sep, "")  # a file in it: its name only
    return f"LoRA adapter {lora.lora_name!r} could not be loaded: {reason}"


class AdapterStore:
    """A worker's adapters: read from disk once and kept on the host (the ``max_cpu_loras``
    used last), written into the model's slots as the scheduler hands the slots out. Reads the
    scheduler asks for ahead (``read_ahead``) run on a thread of their own while steps run."""

    def __init__(self, model: torch.nn.Module, max_rank: int, max_cpu_loras: int,
                 push: Callable[[LoRASlots], None]):
        self.model, self.max_rank, self.max_cpu_loras = model, max_rank, max_cpu_loras
        self.push = push  # replaces a layer's device buffers by its host slots
        # lora_int_id -> the adapter read, or its read under way
        self._read: "collections.OrderedDict[int, Tuple[str, Future]]" = collections.OrderedDict()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")

    def read_ahead(self, loras: Sequence[LoRARequest]) -> None:
        """Start reading each of ``loras`` not read yet (a later ``write`` takes it)."""
        for lora in loras:
            if self._held(lora) is None:
                future = self._reader.submit(read_adapter, lora.lora_path)
                keep_recent(self._read, lora.lora_int_id, (lora.lora_path, future), self.max_cpu_loras)

    def write(self, loads: Sequence[Tuple[int, Optional[LoRARequest]]]) -> List[LoRAFailure]:
        """Put each (slot, adapter) of ``loads`` in place (a slot given twice holds the last;
        ``None`` empties it), then the layers' device buffers. A slot is zeroed before its
        adapter is read, so an adapter that cannot be read or written leaves it empty, never
        holding the adapter before it; such adapters are returned, each as a ``LoRAFailure``
        (and forgotten: a later load reads the file again)."""
        failures = []
        for slot, lora in dict(loads).items():
            clear_slot(self.model, slot)
            if lora is None:
                continue
            try:
                write_adapter(self.model, slot, adapter_updates(self.model, self._adapter(lora), self.max_rank))
            except Exception as err:  # noqa: BLE001 - fails this adapter's requests, not the step
                logger.warning("LoRA adapter %r (lora_int_id %d, %s) not loaded into slot %d: %s", lora.lora_name,
                               lora.lora_int_id, lora.lora_path, slot, err)
                self._read.pop(lora.lora_int_id, None)
                failures.append(LoRAFailure(slot, lora.lora_int_id, failure_message(lora, err)))
        if loads:
            for layer in lora_layers(self.model):
                if layer.lora_buffers_on_device:
                    self.push(layer)
        return failures

    def _adapter(self, lora: LoRARequest) -> Adapter:
        """``lora`` read (waiting for its read ahead if still under way)."""
        held = self._held(lora) or completed_future(lambda: read_adapter(lora.lora_path))
        keep_recent(self._read, lora.lora_int_id, (lora.lora_path, held), self.max_cpu_loras)
        return held.result()

    def _held(self, lora: LoRARequest) -> Optional[Future]:
        path, held = self._read.get(lora.lora_int_id, (None, None))
        return held if path == lora.lora_path else None
