"""The installed package as a user's script meets it: import names of its own, and a core that
imports without torch."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.common import hf_greedy

CORE_WITHOUT_TORCH = textwrap.dedent("""
    import importlib, pkgutil, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torch_xla", "jax", "numpy", "ray"):
                raise ImportError(f"{name} is blocked in this test")

    sys.meta_path.insert(0, NoTorch())
    import tpu_executor.core
    for module in pkgutil.iter_modules(tpu_executor.core.__path__):
        importlib.import_module("tpu_executor.core." + module.name)
    from tpu_executor import SamplingParams, RequestOutputKind
    params = SamplingParams(temperature=0.5, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers"))
    print(params.max_tokens, heavy)
""")


def test_the_core_imports_without_torch(tmp_path):
    result = subprocess.run([sys.executable, "-c", CORE_WITHOUT_TORCH], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["3", "[]"], result.stdout


SCRIPT_BESIDE_JUNK = textwrap.dedent("""
    import json, sys
    from tpu_executor import LLM, SamplingParams
    from tpu_executor.models import model_class_for
    import tpu_executor.kernels

    llm = LLM(sys.argv[1], device="cpu", max_model_len=96, prefill_buckets=(96,), decode_buckets=(4,),
              decode_context_buckets=(96,), num_blocks=64, show_progress=False)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False)
    print(json.dumps(outs[0].outputs[0].token_ids))
""")


def test_a_script_beside_models_and_pallas_kernels_folders_runs(checkpoints, tmp_path):
    """People keep checkpoints in a ``models/`` folder: it must not shadow the engine's modules."""
    for folder, junk in (("models", "raise ImportError('a user folder, not the engine')\n"),
                         ("pallas_kernels", "REGISTRY = None\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text(junk)
    (tmp_path / "run.py").write_text(SCRIPT_BESIDE_JUNK)
    result = subprocess.run([sys.executable, "run.py", checkpoints["llama"]], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    expected, _ = hf_greedy(checkpoints["llama"], [[5, 6, 7, 8]], 8)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected[0]
