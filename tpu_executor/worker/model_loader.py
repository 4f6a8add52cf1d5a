"""Checkpoint loading: config.json, safetensors shards, strict tensor-name checking.

Every failure names the file and what to do: a missing config or weight file, a corrupt
safetensors file, a tensor the model does not have, a tensor the checkpoint lacks, or a shape
that does not match.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

from tpu_executor.models import model_class_for
from tpu_executor.models.layers.linear import weight_loader
from tpu_executor.models.layers.parallel import TensorParallelGroup
from tpu_executor.models.layers.quantized import QuantizedWeight, finish_quantized, prepare_quantized
from tpu_executor.worker.checkpoint_formats import (
    CheckpointScheme,
    UnsupportedQuantization,
    checkpoint_scheme,
    quantized_weights,
    read_quantized,
)

# Checkpoint tensors that carry no weights of ours (recomputed or tied).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says which file and why."""


def load_hf_config(path: str):
    """The transformers config of the checkpoint at ``path``; for a multimodal checkpoint, its
    text config (what the engine serves), carrying the checkpoint's ``architectures``."""
    from transformers import AutoConfig

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{config_file} is missing: {path!r} is not a Hugging Face checkpoint")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config_file} cannot be read: {err}") from err
    text = config.get_text_config()
    if text is not config:
        text.architectures = config.architectures
    return text


def checkpoint_limit(hf_config) -> int:
    """The context length the checkpoint was trained for."""
    return int(getattr(hf_config, "max_position_embeddings", 2048))


def safetensors_files(path: str) -> List[str]:
    """The weight files listed by the index, or every *.safetensors file."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(f"weight files listed in {index_file} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {path!r}")
    return files


def iterate_tensors(files: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the shards; corrupt files raise CheckpointError."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():
                    yield name, shard.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"weight file {file} is corrupt or unreadable: {err}") from err


def tensor_names(files: List[str]) -> List[str]:
    """The names of the shards' tensors (read from their headers); corrupt files raise CheckpointError."""
    from safetensors import SafetensorError, safe_open

    names = []
    for file in files:
        try:
            with safe_open(file, framework="pt") as shard:
                names.extend(shard.keys())
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"weight file {file} is corrupt or unreadable: {err}") from err
    return names


def load_weights(model: torch.nn.Module, tensors: Iterable[Tuple[str, object]]) -> None:
    """Load the checkpoint's ``tensors`` into ``model``: every parameter (every shard of a
    packed one) must come from it exactly once.

    Each parameter's own ``weight_loader`` takes its (tensor-parallel) shard of the checkpoint
    tensor in its layout; a ``QuantizedWeight`` goes to the levels of a layer built for it.
    """
    expected = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    loaded, unexpected = set(), []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight") or \
                model.skips_checkpoint_tensor(name):
            continue
        param_name, shard_id = model.checkpoint_target(name)
        param_name += "_q" if isinstance(tensor, QuantizedWeight) else ""
        param = expected.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        try:
            weight_loader(param)(param, tensor, shard_id)
        except ValueError as err:
            raise CheckpointError(f"tensor {name}: {err}") from err
        loaded.add((param_name, shard_id))
    wanted = {(n, s) for n, p in expected.items() for s in getattr(p, "shard_ids", (None,))}
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in wanted - loaded)
    if unexpected or missing:
        raise CheckpointError(f"checkpoint does not match the model: missing {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}")


def quantize(model: torch.nn.Module, scheme: str) -> int:
    """Turn every quantizable layer (linears, experts) to ``scheme``'s weights (``int8``,
    ``int4``); returns how many."""
    layers = [m for m in model.modules() if getattr(m, "quantizable", False)]
    for layer in layers:
        layer.quantize(scheme)
    return len(layers)


def pack_for_cpu(model: torch.nn.Module) -> int:
    """Reorder the fp32 matmul weights of a model on the CPU into oneDNN's layout (the native
    path; see ``models/layers/cpu_matmul.py``); returns how many layers changed."""
    return sum(module.pack_for_cpu() for module in model.modules() if hasattr(module, "pack_for_cpu"))


def use_xla_cpu_forms(model: torch.nn.Module) -> int:
    """Give the small linears of a model bound for XLA's CPU backend the dot form it runs
    fastest (see ``models/layers/cpu_matmul.py``); returns how many layers changed."""
    return sum(module.use_xla_cpu_form() for module in model.modules() if hasattr(module, "use_xla_cpu_form"))


def quantizable_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantizable layers' weights (INT8 weights and their scales once quantized;
    biases excluded): what ``quantization`` shrinks."""
    return sum(p.numel() * p.element_size() for m in model.modules() if getattr(m, "quantizable", False)
               for name, p in m.named_parameters(recurse=False) if name != "bias")


def load_model(path: str, dtype: torch.dtype, tp: Optional[TensorParallelGroup] = None,
               quantization: Optional[str] = None) -> torch.nn.Module:
    """Build the model named by the checkpoint's config for one rank of ``tp``, load its
    shard of the weights (on the CPU) and quantize them when asked. A published quantized
    checkpoint (its config's ``quantization_config``) loads into layers built for its format."""
    hf_config = load_hf_config(path)
    model_class = model_class_for(getattr(hf_config, "architectures", None))
    files = safetensors_files(path)
    scheme = published_scheme(hf_config, path, quantization)
    with torch.device("cpu"):
        model = model_class(hf_config, tp)
    if scheme is None:
        load_weights(model, iterate_tensors(files))
        model = model.to(dtype).eval()
        if quantization is not None:
            quantize(model, quantization)
        return model
    model = model.to(dtype).eval()  # before the staging parameters: their scales stay fp32
    names = tensor_names(files)
    layers = prepare_published(model, scheme, quantized_weights(scheme, names))
    try:
        load_weights(model, read_quantized(scheme, iterate_tensors(files), names))
        for module, name in layers:
            finish_quantized(module, name)
    except ValueError as err:
        raise CheckpointError(f"{path!r} ({scheme.method}, {scheme.format}): {err}") from err
    return model


def published_scheme(hf_config, path: str, quantization: Optional[str]) -> Optional[CheckpointScheme]:
    """The quantization a checkpoint was published in (None: none), refused when it is a
    format we do not load or when ``quantization`` asks to quantize it again."""
    try:
        scheme = checkpoint_scheme(hf_config)
    except UnsupportedQuantization as err:
        raise CheckpointError(f"{path!r}: {err}") from err
    if scheme is not None and quantization is not None:
        raise CheckpointError(f"{path!r} is already quantized ({scheme.method}, {scheme.layout.bits}-bit); "
                              f"leave quantization unset (it asked for {quantization!r})")
    return scheme


def prepare_published(model: torch.nn.Module, scheme: CheckpointScheme,
                      weights: Optional[set] = None) -> List[Tuple[torch.nn.Module, str]]:
    """Build the layers whose weights the checkpoint quantized (``weights``: their checkpoint
    names; None: every quantizable layer) for ``scheme``'s tensors; returns (layer, parameter)."""
    targets = {model.checkpoint_target(name)[0] for name in weights} if weights is not None else \
        {f"{m}.{p}" for m, layer in model.named_modules() if getattr(layer, "quantizable", False)
         for p, _ in layer.named_parameters(recurse=False) if p != "bias"}
    layers = []
    for target in sorted(targets):
        module_name, _, param = target.rpartition(".")
        module = model.get_submodule(module_name)
        if not getattr(module, "quantizable", False):
            raise CheckpointError(f"the checkpoint quantized {target}, which this engine keeps unquantized")
        try:
            prepare_quantized(module, param, scheme.layout)
        except ValueError as err:
            raise CheckpointError(f"{target}: {err}") from err
        layers.append((module, param))
    return layers


def load_eagle3_head(path: str, target: torch.nn.Module, dtype: torch.dtype,
                     tp: Optional[TensorParallelGroup] = None) -> torch.nn.Module:
    """The EAGLE-3 head at ``path`` for one rank of ``tp`` over the loaded ``target`` (whose
    embedding it shares unless it carries one), refused where its shapes do not fit the target."""
    head, files = _eagle3_head(path, target, tp, torch.device("cpu"))
    load_weights(head, iterate_tensors(files))
    return head.to(dtype).eval()


def build_eagle3_head_shapes(path: str, target: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The EAGLE-3 head at ``path`` over ``target`` as ``build_model_shapes`` builds a model:
    its own parameters on the meta device (no weights read), checked against the target."""
    head, _ = _eagle3_head(path, target, None, torch.device("meta"))
    return head.to(dtype).eval()


def _eagle3_head(path: str, target: torch.nn.Module, tp: Optional[TensorParallelGroup], device: torch.device):
    """(the head built on ``device`` from its config, its weight files), refused where its
    config or shapes do not fit the target."""
    from tpu_executor.models.eagle3 import ARCHITECTURE, Eagle3Head

    hf_config = load_hf_config(path)
    if ARCHITECTURE not in (getattr(hf_config, "architectures", None) or ()):
        raise CheckpointError(f"{path!r} is not an EAGLE-3 head: its config.json names architectures "
                              f"{hf_config.architectures}, not [{ARCHITECTURE!r}]")
    target_hidden = target.config.hidden_size
    head_input = getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size
    files = safetensors_files(path)
    own_embedding = any("embed_tokens" in name for name in tensor_names(files))
    if head_input != target_hidden or (hf_config.hidden_size != target_hidden and not own_embedding):
        raise CheckpointError(f"the EAGLE-3 head {path!r} takes hidden states of size {head_input} and "
                              f"embeddings of size {hf_config.hidden_size}, but the target's hidden size is "
                              f"{target_hidden}: it was trained for another model")
    with device:
        return Eagle3Head(hf_config, target, tp, own_embedding), files


def build_model_shapes(path: str, dtype: torch.dtype, quantization: Optional[str] = None) -> torch.nn.Module:
    """The model named by the checkpoint's config, its parameters on the meta device (shapes
    and dtypes, no memory, no weight files read), quantized when asked: what compiling for
    another machine needs, for a model of any size."""
    hf_config = load_hf_config(path)
    model_class = model_class_for(getattr(hf_config, "architectures", None))
    scheme = published_scheme(hf_config, path, quantization)
    with torch.device("meta"):
        model = model_class(hf_config, None)
    model = model.to(dtype).eval()
    if scheme is not None:
        files = glob.glob(os.path.join(path, "*.safetensors"))
        weights = quantized_weights(scheme, tensor_names(files)) if files else None
        for module, name in prepare_published(model, scheme, weights):
            finish_quantized(module, name)
    elif quantization is not None:
        quantize(model, quantization)
    return model
