#!/usr/bin/env bash
# CI on the GPU machine's versions: torch 2.11 and transformers 5.17, the floors requirements.txt states, in
# a second venv, and the test files whose behaviour depends on them: models, rollouts and KV caches, the
# loss, the train loop, LoRA, FSDP, and gpu_check's CPU mode (what the GPU machine will run). torch 2.11
# is PyPI's build (CUDA 13 and its nvidia-* libraries, a ~3.5 GB download; it runs without a GPU, and the
# CUDA tests skip). The static-cache tests compile the decode step with backend="eager" (dynamo traces it
# as on CUDA) and run under torch.use_deterministic_algorithms, where 5.17's caches failed (issue 21,
# items 1, 3). No `datasets`, as there: train.py imports it only to read a hub dataset.
#
#   bash .ci/old_versions.sh            # creates (or reuses) the venv, then runs the tests
#   OLD_VENV=/some/dir bash .ci/old_versions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${OLD_VENV:-${TMPDIR:-/tmp}/nanosdpo-old-versions}
pins=(torch==2.11.0 transformers==5.17.0)
if ! "$venv/bin/python" -c "import torch, transformers, pytest, peft, xdist
assert torch.__version__.split('+')[0] == '2.11.0' and transformers.__version__ == '5.17.0'" 2>/dev/null; then
    rm -rf "$venv"
    python -m venv "$venv"
    # torch first, pinned, so that the packages after it keep it
    "$venv/bin/python" -m pip install -q "${pins[0]}"
    "$venv/bin/python" -m pip install -q "${pins[1]}" tqdm numpy safetensors "pytest>=8.0" "pytest-xdist>=3.5" peft==0.21.2
fi
"$venv/bin/python" -c "import torch, transformers; print(f'old versions: torch {torch.__version__}, transformers {transformers.__version__}')"
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadfile \
    tests/test_models.py tests/test_rollout.py tests/test_loss.py tests/test_step.py tests/test_loss_weights.py \
    tests/test_teacher_context.py tests/test_teacher.py tests/test_train.py tests/test_lora.py tests/test_parallel.py \
    tests/test_run_folder.py::test_resume_continues_exactly \
    tests/test_run_folder.py::test_a_fresh_run_into_an_earlier_run_refuses_unless_told_to_overwrite \
    tests/test_guard.py::test_collapse_guard_stops_on_nan_and_keeps_a_loadable_checkpoint \
    tests/test_bench.py::test_gpu_check_runs_every_section_in_cpu_mode \
    tests/test_bench.py::test_the_device_session_script_brings_back_the_table_json_console_and_logs \
    tests/test_bench.py::test_gpu_check_killed_outright_keeps_the_table_and_json_of_the_sections_that_finished
