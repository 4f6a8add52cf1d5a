"""Bucket files (pure Python): written by ``tpu-executor tune``, read by every engine through
its ``bucket_config`` option. A file holds the three bucket lists and the limits they were tuned
for, with a record of where they came from."""
from __future__ import annotations

import json
from typing import Any, Dict

BUCKET_FILE_FORMAT = "tpu_executor.buckets/1"
BUCKET_FIELDS = ("prefill_buckets", "decode_buckets", "decode_context_buckets")
# The limits the buckets were tuned for; they apply unless the user sets them.
LIMIT_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size")


def write_bucket_file(path: str, options: Dict[str, Any], tuned_for: Dict[str, Any]) -> None:
    """Write the bucket lists and limits in ``options`` (engine option names) to ``path``,
    with ``tuned_for`` (trace, scheme, figures) as a record of where they came from."""
    missing = [name for name in BUCKET_FIELDS + LIMIT_FIELDS if name not in options]
    if missing:
        raise ValueError(f"a bucket file needs {missing}")
    body = {"format": BUCKET_FILE_FORMAT, **{name: options[name] for name in BUCKET_FIELDS},
            "limits": {name: options[name] for name in LIMIT_FIELDS}, "tuned_for": tuned_for}
    with open(path, "w") as handle:
        json.dump(body, handle, indent=2)
        handle.write("\n")


def read_bucket_file(path: str) -> Dict[str, Any]:
    """The engine options a bucket file sets: its three bucket lists and its limits. A file
    that cannot be used fails with a message naming the file and what is wrong."""
    try:
        with open(path) as handle:
            body = json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"bucket_config {path!r} cannot be read: {err}") from None
    if not isinstance(body, dict) or body.get("format") != BUCKET_FILE_FORMAT:
        raise ValueError(f"bucket_config {path!r} is not a bucket file (expected \"format\": "
                         f"\"{BUCKET_FILE_FORMAT}\"; `tpu-executor tune --out` writes one)")
    limits = body.get("limits")
    missing = [name for name in BUCKET_FIELDS if not isinstance(body.get(name), list)]
    missing += [] if isinstance(limits, dict) else ["limits"]
    if missing:
        raise ValueError(f"bucket_config {path!r} lacks {missing}")
    options: Dict[str, Any] = {name: tuple(body[name]) for name in BUCKET_FIELDS}
    options.update({name: limits[name] for name in LIMIT_FIELDS if name in limits})
    return options
