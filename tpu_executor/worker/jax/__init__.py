"""The JAX path: the model traced through torchax into jitted programs (``graphs.py``, their
records in ``programs.py``), the device mesh and compile cache (``runtime.py``), compiling
ahead of time for a TPU that is not here (``target.py``, ``aot.py``)."""
