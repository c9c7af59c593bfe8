"""Measurements of the code itself, run by hand; tests/test_bench.py runs the first four at tiny sizes
(that they still work, never their figures) and tests/test_rewards_real.py asserts agreement.py's rates:

    bench_loss.py       the fused chunked loss vs the naive one (speed, peak memory, gradient agreement)
    bench_step.py       one GRPO vs one SDPO iteration, and the rollout vs HF generate
    memory_estimate.py  the GPU memory a full-scale config needs (arithmetic, no GPU)
    agreement.py        the answer checkers vs the real benchmarks' references (tests/test_rewards_real.py)
    gpu_check.py        one command for a GPU machine: correctness, a short toy run, speed

Run them as scripts, from any folder: `python tests/bench/<name>.py` (usage in each docstring).
They import each other as `from tests.bench import bench_loss`: tests/ has no __init__.py (pytest
imports conftest.py as a top-level module), so with the repo root on sys.path (each script's one
insert) `tests` is a namespace package and this folder a package in it.
"""
