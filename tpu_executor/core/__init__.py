"""Pure-Python core shared by every device path: configs, requests, sampling parameters, the
scheduler, the KV-cache manager, the detokenizer, the wire types of one step and the bucket
plan. Nothing here imports torch or any other part of the project."""
