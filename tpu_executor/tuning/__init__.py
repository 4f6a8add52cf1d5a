"""Bucket tuning (``tpu-executor tune``): traces, null-device replay, bucket schemes, the TPU
roofline and kernel lowering checks, measurements on this machine, and the plot."""
