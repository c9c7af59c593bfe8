"""parallel=fsdp: FSDP2 under torchrun with 2 CPU processes (gloo) equals one process, resumes exactly
after a kill, and a rank that dies stops the other with one line instead of a hang."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import runtime
import train
from conftest import ROOT, TINY, TORCHRUN, defaults, read_log, run_train

SDPO = ["config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--teacher=ema", "--density=0.5",
        "--learning_rate=1e-2", "--max_iters=4", "--save_interval=1", "--device=cpu"]
LOGGED = ("loss", "grad_norm", "reward", "resp_len", "div", "distill_frac", "entropy")


def torchrun(nproc, script, *args, timeout=300, check=True):
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def weights(out_dir, name="model.safetensors"):
    return load_file(os.path.join(out_dir, "ckpt", name))


def iteration_rows(out_dir):
    return [{k: r.get(k) for k in ("iter", *LOGGED)} for r in read_log(out_dir) if "loss" in r]


@pytest.fixture(scope="module")
def fsdp_sdpo(toy_data, tmp_path_factory):
    """An SDPO run with the EMA teacher, 4 iterations on 2 FSDP ranks, a checkpoint after each."""
    out = tmp_path_factory.mktemp("fsdp_sdpo")
    torchrun(2, "train.py", *SDPO, "--parallel=fsdp", f"--out_dir={out}")
    return out


@pytest.mark.ranks
def test_fsdp_sft_equals_one_process(toy_data, tmp_path):
    """SFT samples nothing: 2 FSDP ranks over the same global batch are the one-process run (loss,
    gradient norm, weights; float tolerance), and ckpt/ is the same clean HF folder, which loads."""
    args = ["config/toy_base.py", *TINY, "--stages=toy/add+toy/sort+toy/context:2,toy/context:1", "--batch_prompts=8",
            "--eval_sets=toy/add", "--learning_rate=1e-2", "--eval_max_prompts=2", "--device=cpu"]
    torchrun(2, "train.py", *args, "--parallel=fsdp", f"--out_dir={tmp_path / 'fsdp'}")
    run_train(*args, f"--out_dir={tmp_path / 'one'}", env={"OMP_NUM_THREADS": "1"})
    fsdp, one = iteration_rows(tmp_path / "fsdp"), iteration_rows(tmp_path / "one")
    assert [r["iter"] for r in fsdp] == [1, 2, 3]
    for a, b in zip(fsdp, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    got, want = weights(tmp_path / "fsdp"), weights(tmp_path / "one")
    assert set(got) == set(want)  # the same HF folder (tied weights as save_pretrained writes them)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    snapshot = load_file(os.path.join(tmp_path / "fsdp", "stage1_toy_add_toy_sort_toy_context", "model.safetensors"))
    assert set(snapshot) == set(want)
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "ckpt")
    torch.testing.assert_close(loaded.state_dict()["model.norm.weight"], got["model.norm.weight"])


@pytest.mark.ranks
def test_fsdp_grpo_and_sdpo_steps_equal_one_process_on_the_same_global_batch(toy_data, tmp_path):
    """tests/parallel/fsdp_steps.py: 3 steps of GRPO (KL to a sharded initial model) and of SDPO (EMA
    teacher, sharded, updated on its shards) on 2 FSDP ranks, each training its share of a global batch,
    against one process training all of it: the same loss, gradient norm, weights and teacher. Both copies
    are made from the sharded student (never whole); teacher_init mixes in alike. Rank 1 has fewer
    micro-batches and keeps step by lockstep; one generate call costs one all-gather per group."""
    out = tmp_path / "steps.json"
    torchrun(2, "tests/parallel/fsdp_steps.py", str(out))
    result = json.loads(out.read_text())
    for algo in ("grpo", "sdpo"):
        r = result[algo]
        assert r["sharded"]
        assert r["loss"] == pytest.approx(r["one_loss"], rel=1e-4, abs=1e-9)  # fp32 sums in another order
        assert r["grad_norm"] == pytest.approx(r["one_grad_norm"], rel=1e-4)
        assert r["weights_max_diff"] < 1e-4 < r["moved"]  # the weights moved, and moved alike
        assert all(rank1 < rank0 for rank0, rank1 in r["passes"])  # lockstep padded rank 1's passes
    assert result["sdpo"]["teacher_max_diff"] < 1e-5
    assert result["teacher_init"]["max_diff"] < 1e-6 < result["teacher_init"]["moved"]  # teacher_init, mixed shard by shard
    assert "differs from the loaded model" in result["refused_copy"] and "\n" not in result["refused_copy"]
    gathers = result["all_gathers"]
    assert gathers["gathered"] == gathers["twice"] == gathers["groups"] == 3  # 2 blocks + the root, once for 8 decode steps
    assert gathers["per_step"] > 2 * gathers["groups"]  # (what each decode step would cost without it)
    assert gathers["gathered_tokens"] == gathers["twice_tokens"] == gathers["per_step_tokens"] == [8, 8, 8, 8]
    mp = result["mixed_precision_and_collapse"]
    assert mp["gathered_dtypes"] == ["torch.bfloat16"] and mp["shard_dtypes"] == ["torch.float32"]
    assert len(mp["collapse"]) == 2 and all("not finite" in (m or "") for m in mp["collapse"])  # rank 1's inf stops both


@pytest.mark.ranks
def test_fsdp_sdpo_run_equals_the_ddp_run(fsdp_sdpo, tmp_path):
    """The same run through train.py with parallel=ddp (each rank samples with its own seed, so the
    reference is DDP, not one process): the same log lines, student and EMA teacher."""
    torchrun(2, "train.py", *SDPO, "--parallel=ddp", f"--out_dir={tmp_path}")
    fsdp, ddp = iteration_rows(fsdp_sdpo), iteration_rows(tmp_path)
    assert len(fsdp) == 4 and fsdp[-1]["div"] > 0
    for a, b in zip(fsdp, ddp):
        for key in LOGGED:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (a["iter"], key)
    for name in ("model.safetensors", "trainer/teacher.safetensors"):
        got, want = weights(fsdp_sdpo, name), weights(tmp_path, name)
        for k in set(got) & set(want):
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
    assert {k for k in load_file(os.path.join(fsdp_sdpo, "ckpt", "model.safetensors"))} == set(weights(tmp_path))
    evals = [[r for r in read_log(d) if "eval_tag" in r] for d in (fsdp_sdpo, tmp_path)]  # student and EMA teacher scored
    assert len(evals[0]) == 2 and any("teacher_mean" in k for k in evals[0][0])
    assert [{k: v for k, v in r.items() if k.startswith("eval/")} for r in evals[0]] == [
        {k: v for k, v in r.items() if k.startswith("eval/")} for r in evals[1]]


@pytest.mark.ranks
def test_fsdp_resume_after_a_kill_continues_exactly(fsdp_sdpo, tmp_path):
    """Killed (SIGKILL, every rank) after its second checkpoint, resumed with init_from=resume on the same
    2 ranks: the log and the weights are the uninterrupted run's, exactly. Another world size is refused."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", *SDPO,
           "--parallel=fsdp", f"--out_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    state = tmp_path / "ckpt" / "trainer" / "state.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(state.read_text())["iter"] >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max((r["iter"] for r in read_log(tmp_path) if "loss" in r), default=0)
    assert 2 <= killed_at < 4, killed_at  # killed mid-run
    torchrun(2, "train.py", *SDPO, "--parallel=fsdp", f"--out_dir={tmp_path}", "--init_from=resume")
    assert iteration_rows(tmp_path) == iteration_rows(fsdp_sdpo)  # exactly
    for name in ("model.safetensors", "trainer/teacher.safetensors", "trainer/optimizer.safetensors"):
        got, want = weights(tmp_path, name), weights(fsdp_sdpo, name)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    saved = checkpoint.read_state(str(tmp_path / "ckpt"))
    with pytest.raises(train.UserError, match="written by 2 rank"):
        checkpoint.check_same_run(saved, 4, saved["data"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ranks
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_a_rank_killed_mid_run_stops_the_other_with_one_line(toy_data, tmp_path, parallel):
    """Two ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_*), rank 1 killed once training
    runs: rank 0 exits non-zero within a minute, its last line one error naming the lost rank, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "train.py", *SDPO, "--max_iters=500", "--save_interval=0", f"--parallel={parallel}",
           f"--out_dir={tmp_path}"]
    ranks = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (tmp_path / "log.jsonl").exists() or sum(
                "loss" in r for r in read_log(tmp_path)) < 1:
            assert ranks[0].poll() is None and time.time() < deadline, "the run did not start training"
            time.sleep(0.1)
        ranks[1].kill()
        out, err = ranks[0].communicate(timeout=60)
    finally:
        for p in ranks:
            p.kill()
    lines = [line for line in err.strip().splitlines() if line.strip() and "Warning" not in line and "warn(" not in line]
    assert ranks[0].returncode != 0
    assert lines[-1].startswith("error: rank 0 of 2: another rank stopped"), err[-2000:]
    assert "Traceback" not in err


def test_a_rank_leaves_with_its_exit_hooks_run_its_output_flushed_and_its_exit_code():
    """runtime.leave, how a torchrun rank of train.py ends (past gloo's race with the interpreter's
    shutdown): the atexit hooks (wandb's, the code sandbox's teardown) run first, the buffered output is
    written, and the process exits with the code given."""
    script = "import atexit, runtime; atexit.register(print, 'hook ran'); print('work done', end=''); runtime.leave(3)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "work donehook ran\n", proc.stderr[-2000:]


def test_fsdp_is_refused_in_one_line_where_it_cannot_run():
    with pytest.raises(train.UserError, match="parallel=fsdp shards the models over torchrun's ranks"):
        runtime.Dist("cpu", "fsdp")  # one process
    for kind in ("live", "trust_region"):
        with pytest.raises(train.UserError, match=f"teacher={kind} reads the sharded student"):
            train.check_config(dict(defaults(), algo="sdpo", teacher=kind, parallel="fsdp"))
    with pytest.raises(train.UserError, match="parallel='zero3' is not one of ddp, fsdp"):
        train.check_config(dict(defaults(), parallel="zero3"))
    train.check_config(dict(defaults(), algo="sdpo", teacher="ema", parallel="fsdp"))


def test_fsdp_loads_models_on_the_cpu_for_shard_model_to_move_a_group_at_a_time():
    """Under parallel=fsdp train.py loads the student, a resumed run's initial model and teacher_init on the
    CPU (runtime.load_device); fully_shard moves each group to the mesh's device as it shards it. Under ddp
    (or one process) a model is loaded straight onto its device."""
    gpu = torch.device("cuda", 1)
    assert runtime.load_device(gpu, "fsdp") == torch.device("cpu")
    assert runtime.load_device(gpu, "ddp") == gpu
    assert runtime.load_device(torch.device("cpu"), "ddp") == torch.device("cpu")


def test_memory_estimate_gives_one_fsdp_rank_its_share(capsys):
    """tests/bench/memory_estimate.py --parallel=fsdp --world_size=8: the fp32 state is 1/8 of one DDP rank's,
    the bf16 student / teacher gathered in their phases; Qwen3-4B SDPO (config/sdpo_math.py) then fits an
    80 GB GPU, where a DDP rank does not, and so does Qwen3-8B at micro_batch_size=4."""
    from tests.bench import memory_estimate

    def estimate(*argv):
        memory_estimate.main(list(argv))
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ddp = estimate("--world_size=8", "--gpu_gb=80")
    fsdp = estimate("--world_size=8", "--gpu_gb=80", "--parallel=fsdp")
    assert fsdp["state_gb"] == pytest.approx(ddp["state_gb"] / 8, abs=0.1)
    assert fsdp["rows_gb"]["fsdp_gathered_copies"] == pytest.approx(2 * fsdp["params"] / 1e9, abs=0.01)  # the EMA teacher
    root = 151936 * 2560 + 2560  # Qwen3-4B's embedding (= its tied head) + final norm: its largest FSDP group
    # at load (from the CPU, a group at a time): that group whole in fp32 beside the shards of student and teacher
    assert fsdp["rows_gb"]["fsdp_load"] == pytest.approx((4 * root + 4 * fsdp["params"] * 2 / 8) / 1e9, abs=0.01)
    assert ddp["needs_gb"] > 80 > fsdp["needs_gb"]
    big = estimate("--world_size=8", "--gpu_gb=80", "--parallel=fsdp", "--model=qwen3-8b", "--micro_batch_size=4")
    assert big["needs_gb"] < 80 < estimate("--world_size=8", "--gpu_gb=80", "--parallel=fsdp", "--model=qwen3-8b")["needs_gb"]
