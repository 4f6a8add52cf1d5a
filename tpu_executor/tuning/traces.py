"""Request-length traces: read from common public formats, or drawn from a named synthetic
distribution (seeded).

Files (the format is told by the extension and the column names):

* ``.jsonl``: one object per line with ``prompt_len``/``output_len``, or Mooncake's
  ``input_length``/``output_length`` (arrival: ``timestamp`` in ms), or ``arrival_s``;
* ``.csv``: ``prompt_len``/``output_len``, the Azure LLM inference trace
  (``ContextTokens``/``GeneratedTokens``, arrival ``TIMESTAMP``), or BurstGPT (``Request
  tokens``/``Response tokens``, arrival ``Timestamp`` in s; rows with 0 response tokens are
  failed requests and are skipped);
* ``.json``: ShareGPT-style conversations (the first human turn is the prompt, the next turn
  the output), tokenized with the model's tokenizer.

A row that cannot be read fails with its file and line number.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Dict, Iterable, List, Optional, Tuple


@dataclass(frozen=True)
class TraceRequest:
    """One request's lengths in tokens, and its arrival in seconds from the trace's start."""

    prompt_len: int
    output_len: int
    arrival_s: Optional[float] = None


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


# (prompt column, output column, arrival column, arrival unit) per known layout.
_COLUMNS = (("prompt_len", "output_len", "arrival_s", "s"),
            ("input_length", "output_length", "timestamp", "ms"),      # Mooncake
            ("ContextTokens", "GeneratedTokens", "TIMESTAMP", "date"),  # Azure LLM inference
            ("Request tokens", "Response tokens", "Timestamp", "s"))    # BurstGPT


@dataclass(frozen=True)
class Synthetic:
    """Lognormal prompt and output lengths with the given medians and log-space sigmas."""

    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float


# Medians follow from the published means (mean = median * exp(sigma^2 / 2)); the sigmas are
# our choice of a long right tail, not published figures.
SYNTHETIC: Dict[str, Synthetic] = {
    # ShareGPT as in the vLLM paper (Kwon et al., 2023): mean prompt 161, mean output 338 tokens.
    "sharegpt-like": Synthetic(161 / math.exp(0.5), 1.0, 338 / math.exp(0.32), 0.8),
    # LMSYS-Chat-1M (Zheng et al., 2023): mean prompt 69.5, mean response 214.5 tokens.
    "chat": Synthetic(69.5 / math.exp(0.5), 1.0, 214.5 / math.exp(0.32), 0.8),
    # Azure coding trace (Splitwise, Patel et al., 2024): median prompt 1500, median output 13.
    "long-prompt": Synthetic(1500, 0.6, 13, 1.0),
}


def synthetic_trace(name: str, num_requests: int, max_model_len: int, seed: int = 0) -> List[TraceRequest]:
    """``num_requests`` lengths drawn from ``SYNTHETIC[name]``, each fitting ``max_model_len``
    (prompt at most 3/4 of it, output the rest at most)."""
    if name not in SYNTHETIC:
        raise TraceError(f"unknown synthetic trace {name!r}; choose one of {sorted(SYNTHETIC)} or give a file")
    dist, rng = SYNTHETIC[name], random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = _clip(rng.lognormvariate(math.log(dist.prompt_median), dist.prompt_sigma), 3 * max_model_len // 4)
        output = _clip(rng.lognormvariate(math.log(dist.output_median), dist.output_sigma), max_model_len - prompt)
        requests.append(TraceRequest(prompt, output))
    return requests


def _clip(value: float, high: int) -> int:
    return max(1, min(high, int(round(value))))


def load_trace(source: str, tokenizer=None, num_requests: Optional[int] = None,
               max_model_len: Optional[int] = None, seed: int = 0) -> List[TraceRequest]:
    """The trace at ``source`` (a file, or a name in ``SYNTHETIC``), its first ``num_requests``
    requests. Requests longer than ``max_model_len`` in all are cut to fit (output first)."""
    if not os.path.exists(source):
        if source in SYNTHETIC:
            if max_model_len is None:
                raise TraceError("a synthetic trace needs max_model_len")
            return synthetic_trace(source, num_requests or 1000, max_model_len, seed)
        raise TraceError(f"trace {source!r} is neither a file nor one of {sorted(SYNTHETIC)}")
    readers: Dict[str, Callable[..., Iterable[TraceRequest]]] = {
        ".jsonl": _read_jsonl, ".csv": _read_csv, ".json": _read_sharegpt}
    reader = readers.get(os.path.splitext(source)[1].lower())
    if reader is None:
        raise TraceError(f"trace {source!r}: unknown extension; use .jsonl, .csv or .json (ShareGPT)")
    requests = []
    for request in reader(source, tokenizer):
        if num_requests is not None and len(requests) == num_requests:
            break
        requests.append(_fit(request, max_model_len))
    if not requests:
        raise TraceError(f"trace {source!r} holds no requests")
    return _from_first_arrival(requests)


def _fit(request: TraceRequest, max_model_len: Optional[int]) -> TraceRequest:
    if max_model_len is None or request.prompt_len + request.output_len <= max_model_len:
        return request
    prompt = min(request.prompt_len, max_model_len - 1)
    return TraceRequest(prompt, max(1, min(request.output_len, max_model_len - prompt)), request.arrival_s)


def _from_first_arrival(requests: List[TraceRequest]) -> List[TraceRequest]:
    if any(r.arrival_s is None for r in requests):
        return [TraceRequest(r.prompt_len, r.output_len) for r in requests]
    start = min(r.arrival_s for r in requests)
    return [TraceRequest(r.prompt_len, r.output_len, r.arrival_s - start) for r in requests]


def _row_request(row: Dict[str, object], where: str) -> Optional[TraceRequest]:
    """The request of one row (None: a failed request to skip); raises TraceError if unreadable."""
    for prompt_key, output_key, arrival_key, unit in _COLUMNS:
        if prompt_key in row and output_key in row:
            try:
                prompt, output = int(float(row[prompt_key])), int(float(row[output_key]))
                arrival = _arrival_seconds(row.get(arrival_key), unit)
            except (TypeError, ValueError) as err:
                raise TraceError(f"{where}: {prompt_key}/{output_key}/{arrival_key} unreadable: {err}") from None
            if prompt < 1 or output < 0:
                raise TraceError(f"{where}: {prompt_key} must be >= 1 and {output_key} >= 0, "
                                 f"got {prompt} and {output}")
            return TraceRequest(prompt, output, arrival) if output > 0 else None
    names = ", ".join(f"{p}/{o}" for p, o, _, _ in _COLUMNS)
    raise TraceError(f"{where}: no length columns; expected one of {names}, got {sorted(row)}")


def _arrival_seconds(value, unit: str) -> Optional[float]:
    if value in (None, ""):
        return None
    if unit == "date":
        return datetime.fromisoformat(str(value)[:26]).timestamp()
    return float(value) / (1000.0 if unit == "ms" else 1.0)


def _read_jsonl(path: str, _tokenizer) -> Iterable[TraceRequest]:
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise TraceError(f"{path}:{number}: not JSON: {err}") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            request = _row_request(row, f"{path}:{number}")
            if request is not None:
                yield request


def _read_csv(path: str, _tokenizer) -> Iterable[TraceRequest]:
    with open(path, newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), 2):  # line 1 is the header
            request = _row_request(row, f"{path}:{number}")
            if request is not None:
                yield request


def _read_sharegpt(path: str, tokenizer) -> Iterable[TraceRequest]:
    if tokenizer is None:
        raise TraceError(f"{path}: a ShareGPT trace is tokenized with the model's tokenizer; pass --model")
    with open(path) as handle:
        try:
            conversations = json.load(handle)
        except json.JSONDecodeError as err:
            raise TraceError(f"{path}: not JSON: {err}") from None
    if not isinstance(conversations, list):
        raise TraceError(f"{path}: expected a JSON list of conversations")
    for number, item in enumerate(conversations, 1):
        pair = _first_exchange(item, f"{path}: conversation {number}")
        if pair is not None:
            prompt, output = (len(tokenizer(text)["input_ids"]) for text in pair)
            if prompt >= 1 and output >= 1:
                yield TraceRequest(prompt, output)


def _first_exchange(item, where: str) -> Optional[Tuple[str, str]]:
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        raise TraceError(f"{where}: expected an object with a 'conversations' list")
    try:
        texts = [str(turn["value"]) for turn in turns[:2]]
    except (TypeError, KeyError):
        raise TraceError(f"{where}: each turn needs a 'value'") from None
    return (texts[0], texts[1]) if len(texts) == 2 else None
