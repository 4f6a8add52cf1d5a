"""Thin wrapper: ``python -m scripts.prepare_default_model`` converts the default model
(SmolLM2-135M-Instruct) once and prints its directory (``tpu_executor/tools/default_model.py``)."""
from tpu_executor.tools.default_model import main

if __name__ == "__main__":
    main()
