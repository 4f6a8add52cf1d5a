"""Thin wrapper: ``python -m scripts.random_checkpoint DIR --arch gemma --size 100m`` writes a
random checkpoint (``tpu_executor/tools/random_checkpoint.py``)."""
from tpu_executor.tools.random_checkpoint import main

if __name__ == "__main__":
    main()
