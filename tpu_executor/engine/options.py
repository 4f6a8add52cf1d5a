"""Engine options, declared once: every field of the option sections of ``core/config.py``.

``LLM(model, **options)`` and every ``tpu-executor`` subcommand take the same names (``--max-
model-len`` on the command line is ``max_model_len`` in Python); each option goes to the
config section that owns it, and the configs validate their values once.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from typing import Any, Dict, Iterable, List, Optional, Tuple

from tpu_executor.core.bucket_file import BUCKET_FIELDS, LIMIT_FIELDS, read_bucket_file
from tpu_executor.core.config import (
    OPTION_SECTIONS,
    CacheConfig,
    CompileConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_max_model_len,
)
from tpu_executor.core.speculative import SpeculativeConfig
from tpu_executor.models.layers.parallel import check_tensor_parallel
from tpu_executor.models.layers.rotary import check_rope
from tpu_executor.worker.model_loader import checkpoint_limit, load_hf_config

logger = logging.getLogger(__name__)

# The option that carries a whole SpeculativeConfig (a mapping, or JSON on the command line).
SPECULATIVE_OPTION = "speculative_config"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's ``--help``: the module docstring as written, and each option's default
    after its help, unless the help says it already or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})"


def option_fields() -> List[Tuple[type, dataclasses.Field]]:
    """(section, field) of every engine option, in command-line order (``model`` excluded:
    it is the one required argument)."""
    return [(section, f) for section in OPTION_SECTIONS for f in dataclasses.fields(section)
            if f.name != "model"]


def option_names() -> List[str]:
    """Every engine option's name: the config sections' fields, then ``speculative_config``
    (one option holding a whole config, as vLLM's)."""
    return [f.name for _, f in option_fields()] + [SPECULATIVE_OPTION]


def apply_bucket_file(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` with the buckets and limits of its ``bucket_config`` file filled in. Bucket
    lists given beside the file are an error (which should win is unclear); a limit given
    beside it wins, with a warning that the buckets were tuned for another value."""
    path = options.get("bucket_config")
    if path is None:
        return options
    merged = dict(options)
    for name, value in read_bucket_file(path).items():
        if name in BUCKET_FIELDS and name in options:
            raise ValueError(f"bucket_config {path!r} sets {name}; do not pass {name} as well")
        if name in options and options[name] != value:
            logger.warning("%s=%s differs from %s=%s that bucket_config %s was tuned for",
                           name, options[name], name, value, path)
        merged.setdefault(name, value)
    return merged


def build_engine_config(model: str, **options: Any) -> EngineConfig:
    """An EngineConfig from flat keyword options (each goes to the section that has the field).
    An impossible tensor-parallel split or an unsupported RoPE type fails here, before any
    worker starts."""
    options = apply_bucket_file(options)
    speculative = SpeculativeConfig.parse(options.pop(SPECULATIVE_OPTION, None))
    values: Dict[type, Dict[str, Any]] = {section: {} for section in OPTION_SECTIONS}
    for section, f in option_fields():
        if f.name in options:
            values[section][f.name] = options.pop(f.name)
    if options:
        raise ValueError(f"unknown engine options: {sorted(options)}")
    model_config = ModelConfig(model=model, **values[ModelConfig])
    parallel, compile_config = ParallelConfig(**values[ParallelConfig]), CompileConfig(**values[CompileConfig])
    hf_config = load_hf_config(model)
    check_tensor_parallel(hf_config, parallel.tensor_parallel_size)
    check_rope(hf_config)
    scheduler = SchedulerConfig(**values[SchedulerConfig])
    limit = resolve_max_model_len(checkpoint_limit(hf_config), model_config.max_model_len, scheduler)
    return EngineConfig(model=model_config, cache=CacheConfig(**values[CacheConfig]),
                        scheduler=scheduler, compile=compile_config,
                        device=DeviceConfig(**values[DeviceConfig]), max_model_len=limit, parallel=parallel,
                        speculative=speculative, lora=LoRAConfig(**values[LoRAConfig]))


def shown_default(value: Any) -> str:
    """An option's value as ``--help`` shows it (bucket lists as the flag takes them)."""
    return " ".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


def _argument_kwargs(section: type, f: dataclasses.Field, defaults: Dict[str, Any]) -> Dict[str, Any]:
    """argparse keywords for one option, from its type hint, help text and the default it
    takes in this subcommand (a ``None`` default in words, where it stands for something)."""
    hint = typing.get_type_hints(section)[f.name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    default = defaults.get(f.name, default)
    if default is None:
        none_means = f.metadata.get("none_means")
        shown = f" (default: {none_means})" if none_means else ""
    else:
        shown = f" (default: {shown_default(default)})"
    kwargs: Dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                              "help": f.metadata.get("help", "") + shown}
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint is bool or args == [bool]:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(hint) is tuple:
        kwargs.update(nargs="+", type=args[0], metavar=f.name.upper())
    else:
        kwargs["type"] = args[0] if args else hint
    return kwargs


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: Iterable[str] = (),
                         defaults: Optional[Dict[str, Any]] = None, why: Optional[str] = None) -> None:
    """Add every engine option (but ``exclude``) as ``--flag`` to ``parser``. ``defaults`` are
    this subcommand's own values for some options, ``why`` the reason (printed by ``--help``
    above the options); every other option takes the engine's default, and ``--help`` shows
    the value each one takes. Flags not given stay out of the parsed namespace."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - {f.name for _, f in option_fields()})
    if unknown:
        raise ValueError(f"unknown engine options in a subcommand's defaults: {unknown}")
    group = parser.add_argument_group("engine options", why)
    for section, f in option_fields():
        if f.name not in exclude:
            group.add_argument("--" + f.name.replace("_", "-"), **_argument_kwargs(section, f, defaults))
    if SPECULATIVE_OPTION not in exclude:
        group.add_argument("--speculative-config", dest=SPECULATIVE_OPTION, default=argparse.SUPPRESS,
                           metavar="JSON", help="speculative decoding, as vLLM's: e.g. '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                           "(default: none)")
    parser.set_defaults(engine_defaults=defaults)


def engine_options_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The engine options given in parsed ``args`` over the subcommand's own defaults (the
    configs turn bucket lists into tuples). A bucket file replaces the subcommand's buckets
    and limits: the user chose them by tuning."""
    values = vars(args)
    given = {name: values[name] for name in option_names() if name in values}
    defaults = dict(values.get("engine_defaults") or {})
    if given.get("bucket_config") is not None:
        defaults = {k: v for k, v in defaults.items() if k not in BUCKET_FIELDS + LIMIT_FIELDS}
    return {**defaults, **given}
