"""torchrun with 2 CPU processes (gloo): ranks stay identical and match one process."""
import os
import subprocess

import pytest
import torch

from conftest import ROOT, TINY, TORCHRUN, read_log, run_train


def torchrun(nproc, *args):
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "train.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def weights(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "ckpt", "model.safetensors"))


@pytest.mark.ranks
def test_two_ranks_equal_one_process_sft(toy_data, tmp_path):
    """SFT has no sampling, so a 2-rank step over the same global batch is the 1-process step:
    each rank's loss is divided by the global token count and gradients are summed."""
    args = ["config/toy_base.py", *TINY, "--stages=toy/add+toy/sort+toy/context:2,toy/context:1", "--batch_prompts=8",
            "--learning_rate=1e-2", "--eval_max_prompts=2", "--device=cpu"]
    torchrun(2, *args, f"--out_dir={tmp_path / 'two'}")
    run_train(*args, f"--out_dir={tmp_path / 'one'}")
    sums = [r["rank_param_sums"] for r in read_log(tmp_path / "two") if "rank_param_sums" in r]
    assert sums and all(len(s) == 2 and s[0] == s[1] for s in sums)  # identical on both ranks
    two, one = weights(tmp_path / "two"), weights(tmp_path / "one")
    for k in one:  # fp32 all-reduce sums in another order: float tolerance
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)
    losses = lambda d: [r["loss"] for r in read_log(d) if "loss" in r]  # noqa: E731
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)


@pytest.mark.ranks
def test_steps_without_signal_move_no_weight_on_two_ranks_as_in_one_process(toy_data, tmp_path):
    """A random model earns reward 0: no group has a signal, no rank runs a backward, and AdamW must skip
    the step (no weight decay, no moments, no step count) as it does in one process; zero gradients in its
    place decayed the weights. And an eval set smaller than the ranks leaves one rank an empty share."""
    args = ["config/sdpo_toy.py", *TINY, "--algo=grpo", "--init_from=scratch", "--max_iters=2", "--learning_rate=1e-2",
            "--weight_decay=0.1", "--eval_max_prompts=1", "--device=cpu"]
    torchrun(2, *args, f"--out_dir={tmp_path / 'two'}")
    run_train(*args, f"--out_dir={tmp_path / 'one'}")
    assert all(r["reward"] == 0 for d in ("one", "two") for r in read_log(tmp_path / d) if "reward" in r)
    two, one = weights(tmp_path / "two"), weights(tmp_path / "one")
    assert all(torch.equal(two[k], one[k]) for k in one)
    from safetensors.torch import load_file
    state = load_file(os.path.join(tmp_path / "two", "ckpt", "trainer", "optimizer.safetensors"))
    assert [k for k in state if not k.startswith("rng.")] == []
    evals = [r for r in read_log(tmp_path / "two") if "eval_tag" in r]
    assert evals and all("eval/toy/sort/mean@2" in r for r in evals)


@pytest.mark.ranks
def test_two_ranks_sdpo_stay_in_sync(toy_data, tmp_path):
    """Sampling streams differ per rank (train.stream_seed), so SDPO is not bit-equal to one process;
    the ranks' weights (and EMA teachers) must still be identical after every step."""
    torchrun(2, "config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--max_iters=3",
             "--save_interval=1", "--learning_rate=1e-2", "--device=cpu", f"--out_dir={tmp_path}")
    sums = [r["rank_param_sums"] for r in read_log(tmp_path) if "rank_param_sums" in r]
    assert len(sums) >= 3 and all(s[0] == s[1] for s in sums)
    rows = [r for r in read_log(tmp_path) if "loss" in r]
    assert len(rows) == 3 and all(r["peer_frac"] == 1.0 for r in rows)
