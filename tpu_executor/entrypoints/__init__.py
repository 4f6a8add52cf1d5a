"""What users call: the offline ``LLM`` and the ``tpu-executor`` command line."""
