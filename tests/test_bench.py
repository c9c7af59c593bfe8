"""The benchmark scripts still run end to end (tiny sizes; their figures are not checked here:
speed is never asserted in a test)."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def run_script(*args):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_step_runs_and_reports_every_phase(toy_data):
    out = run_script("tests/bench_step.py", "--init_from=scratch", "--iters=2", "--gen_runs=1", "--batch_prompts=2",
                     "--group_size=4", "--max_new_tokens=6")
    assert out["settings"]["iters"] == 2 and out["settings"]["init_from"] == "scratch"
    # a scratch model never succeeds, so the bench sets success_threshold 0: every response has a peer
    assert out["sdpo_teacher_seqs"] == 8 and out["sdpo_phases"]["teacher"] > 0
    assert 1 <= out["sdpo_teacher_unique_prompts"] <= out["sdpo_teacher_unique_pairs"] <= 8
    assert out["grpo_phases"]["teacher"] < out["sdpo_phases"]["teacher"]
    assert out["sdpo_over_grpo"] > 0 and out["rollout_speedup"] > 0 and out["rollout_tokens"] > 0


def test_bench_loss_runs_and_fused_matches_naive():
    out = run_script("tests/bench_loss.py", "--size", "256", "32", "2048", "--runs=1")
    assert out["size"] == [256, 32, 2048] and out["other_sizes"] == []
    assert out["naive_s"] > 0 and out["fused_s"] > 0 and out["naive_peak_mb"] > 0
    assert out["max_abs_grad_diff"] < 1e-5


def test_memory_estimate_counts_the_published_sizes():
    """Qwen3-4B / 8B parameter counts built on the meta device (no download), and the state they imply."""
    for model, params in (("qwen3-4b", 4.02e9), ("qwen3-8b", 8.19e9)):
        out = run_script("tests/memory_estimate.py", f"--model={model}")
        assert abs(out["params"] - params) / params < 0.005
        assert out["state_gb"] == round(out["params"] * (4 + 4 + 8 + 4) / 1e9, 1)  # weights, grads, AdamW, EMA teacher
        assert out["peak_gb"] > out["state_gb"]
