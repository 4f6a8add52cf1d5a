"""Log-probs of the prompt's own tokens (``prompt_logprobs``, and completions' ``echo`` with
``logprobs``), computed on the device from the hidden states a prefill call already made.

Position ``p`` of a prompt gives the log-prob of token ``p + 1``; a chunk's positions say which
prompt token each one's log-prob is owed for (``PrefillWork.prompt_logprob_targets``). The
positions that owe one are gathered from the packed row in fixed groups (at most
``PROMPT_LOGPROB_ROWS``), each through the LM head and a log-softmax in one compiled graph per
prefill token bucket, so a long prompt never holds more than a group's rows of
vocabulary-wide logits at once.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, NamedTuple, Sequence, Tuple

import numpy as np
import torch

from tpu_executor.core.step import PrefillWork, PromptLogprobs


class Owed(NamedTuple):
    """The positions of one packed prefill row that owe a prompt log-prob."""

    rows: np.ndarray  # index in the packed row
    targets: np.ndarray  # the prompt token whose log-prob it gives
    owners: List[Tuple[str, int]]  # (request, that token's index in its prompt)


def owed_positions(pack: Sequence[PrefillWork]) -> Owed:
    rows, targets, owners = [], [], []
    offset = 0
    for item in pack:
        for i, target in enumerate(item.prompt_logprob_targets or ()):
            if target >= 0:
                rows.append(offset + i)
                targets.append(target)
                owners.append((item.request_id, item.start_pos + i + 1))
        offset += len(item.token_ids)
    return Owed(np.array(rows, dtype=np.int64), np.array(targets, dtype=np.int64), owners)


def groups(owed: Owed, width: int) -> Iterator[Tuple[Dict[str, torch.Tensor], List[Tuple[str, int]]]]:
    """The owed positions in groups of ``width`` (padding rows read row 0 for token 0), with
    their owners."""
    for start in range(0, len(owed.owners), width):
        tensors = padding_group(width)
        part = slice(start, start + width)
        count = len(owed.owners[part])
        tensors["rows"][:count] = torch.from_numpy(owed.rows[part])
        tensors["targets"][:count] = torch.from_numpy(owed.targets[part])
        yield tensors, owed.owners[part]


def padding_group(width: int) -> Dict[str, torch.Tensor]:
    """A group of ``width`` padding rows (warm-up runs one)."""
    return {"rows": torch.zeros(width, dtype=torch.int64), "targets": torch.zeros(width, dtype=torch.int64)}


def prompt_logprobs_step(model, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                         num_logprobs: int) -> Tuple[torch.Tensor, ...]:
    """(each target's log-prob and rank, the top ``num_logprobs`` ids and log-probs) of
    ``rows`` of ``hidden`` (runs compiled)."""
    logprobs = torch.log_softmax(model.compute_logits(hidden.index_select(0, rows)), dim=-1)
    target = logprobs.gather(1, targets[:, None])
    rank = (logprobs > target).sum(dim=-1) + 1
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    return target.squeeze(1), rank, top_ids, top_logprobs


def read_back(launched: Sequence[Tuple[Tuple[torch.Tensor, ...], List[Tuple[str, int]]]]) -> Tuple[PromptLogprobs, ...]:
    """The launched groups' results, per request (waits for the device)."""
    by_request: Dict[str, Tuple[list, list, list, list]] = {}
    for outputs, owners in launched:
        values, ranks, ids, lps = (tensor.cpu().tolist() for tensor in outputs)
        for row, (request_id, position) in enumerate(owners):
            columns = by_request.setdefault(request_id, ([], [], [], []))
            for column, value in zip(columns, (position, values[row], ranks[row], dict(zip(ids[row], lps[row])))):
                column.append(value)
    return tuple(PromptLogprobs(r, *(tuple(c) for c in columns)) for r, columns in by_request.items())
