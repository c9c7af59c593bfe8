"""The run folder: one holder of out_dir's lock, atomic checkpoints that a crash or a kill at any point
leaves recoverable, resume that continues exactly and refuses another run, a fresh run that never
destroys an earlier one, ckpt/ as a clean HF folder, full disks, and eval.py reading a run folder."""
import contextlib
import errno
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import huggingface_hub.constants
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import (ROOT, RUN, TINY, assert_resume_continues_exactly, cli_cfg, copy_of, defaults, listing, one_line_error,
                      read_log, run_train, run_train_here, tiny_cfg)

import checkpoint
import eval as ev
import models
import runtime
import train
from configurator import UserError


def _contend(out_dir, start, results, release):
    """One racer: wait for the start, try the lock, report, and (holding) keep it until told."""
    start.wait()
    try:
        with checkpoint.locked(out_dir):
            results.put(("held", os.getpid()))
            release.wait(30)
    except UserError as e:
        results.put(("refused", str(e)))
    except BaseException as e:  # noqa: BLE001  (anything else is what the test looks for)
        results.put(("crashed", repr(e)))


@pytest.mark.parametrize("before", ["no lock file", "an empty lock file", "a dead run's lock file"])
def test_racing_runs_get_exactly_one_holder_of_the_lock(tmp_path, before):
    """8 processes start at once, 20 times over: exactly one holds the lock (kept until every other
    has tried), the others are refused with one line, none crashes."""
    ctx = multiprocessing.get_context("fork")  # cheap starts: checkpoint (and torch) already imported
    for trial in range(20):
        out = tmp_path / f"t{trial}"
        out.mkdir()
        if before != "no lock file":
            (out / ".lock").write_text("" if before == "an empty lock file" else "999999999")
        start, release, results = ctx.Event(), ctx.Event(), ctx.Queue()
        racers = [ctx.Process(target=_contend, args=(str(out), start, results, release)) for _ in range(8)]
        for p in racers:
            p.start()
        start.set()
        outcomes = [results.get(timeout=60) for _ in racers]
        release.set()
        for p in racers:
            p.join(30)
        kinds = [kind for kind, _ in outcomes]
        assert kinds.count("held") == 1 and kinds.count("refused") == 7, (trial, outcomes)
        assert all("in use by another run" in msg and "\n" not in msg for kind, msg in outcomes if kind == "refused")


def _hold_forever(out_dir, ready):
    with checkpoint.locked(out_dir):
        ready.set()
        time.sleep(600)


def test_the_lock_dies_with_its_process_and_a_leftover_file_blocks_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(str(tmp_path), ready))
    holder.start()
    assert ready.wait(60)
    with pytest.raises(UserError, match=f"is in use by another run \\(pid {holder.pid}\\)"):
        with checkpoint.locked(str(tmp_path)):
            pass
    os.kill(holder.pid, signal.SIGKILL)  # kill -9: no cleanup runs
    holder.join(30)
    with checkpoint.locked(str(tmp_path)):  # taken at once: the kernel released it
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
    (tmp_path / ".lock").write_text(str(os.getppid()))  # a live pid (as after a pid reuse) in a lock nobody holds
    with checkpoint.locked(str(tmp_path)):
        pass


@pytest.mark.parametrize("odd", ["a directory", "a dangling symbolic link"])
def test_an_odd_lock_path_is_one_line(tmp_path, odd):
    if odd == "a directory":
        (tmp_path / ".lock").mkdir()
    else:
        (tmp_path / ".lock").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError) as e:
        with checkpoint.locked(str(tmp_path)):
            pass
    kind = "directory" if odd == "a directory" else "symbolic link"
    assert f"{tmp_path / '.lock'} is a {kind}, not a lock file" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_second_run_into_the_same_out_dir_stops_and_a_killed_runs_lock_blocks_nothing(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, checkpoint\nwith checkpoint.locked(sys.argv[1]):\n"
                               "    print('held', flush=True); time.sleep(600)", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = (*RUN, f"--out_dir={out}", "--init_from=resume", "--max_iters=3")
        assert f"in use by another run (pid {holder.pid})" in one_line_error(run_train_here(*args))
    finally:
        holder.kill()  # kill -9: its .lock file stays, its lock goes with it
        holder.wait()
    assert (out / ".lock").read_text() == str(holder.pid)
    run_train(*args)
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2, 3]


def test_a_fresh_run_into_an_earlier_run_refuses_unless_told_to_overwrite(toy_data, tmp_path):
    """Rerunning into the same out_dir must neither destroy the earlier run by default nor leave its
    stage snapshots and eval reports behind when told to replace it (eval.py would read them as
    this run's); other files always stay."""
    out = tmp_path / "run"
    (out / "stage7_toy_mul").mkdir(parents=True)
    (out / "log.jsonl").write_text(json.dumps({"iter": 999, "loss": 1.0}) + "\n")
    (out / "eval.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    args = ("config/grpo_toy.py", *TINY, "--init_from=scratch", f"--out_dir={out}", "--max_iters=2", "--device=cpu")
    proc = run_train_here(*args)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert "--init_from=resume" in proc.stderr and "--overwrite=True" in proc.stderr and "another --out_dir" in proc.stderr
    assert (out / "log.jsonl").read_text().startswith('{"iter": 999') and (out / "stage7_toy_mul").exists()
    proc = run_train(*args, "--overwrite=True")
    assert "removed the earlier run's" in proc.stdout
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2]
    assert not (out / "stage7_toy_mul").exists() and not (out / "eval.json").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "ckpt" / "model.safetensors").exists()


@pytest.mark.parametrize("bad", ["--dataset=toy/nonexist", "--wandb_log=True", "--init_from=no/such-model-here",
                                 "--max_new_tokens=4000", "--math_checker=math_verify"])
def test_a_bad_input_into_a_finished_run_changes_nothing(finished_run, tmp_path, bad, monkeypatch):
    """Even with --overwrite=True: every input is checked before anything in out_dir is touched.
    The first case through the command line (one line, exit 1), the others in this process."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # absent, whatever this machine has installed
    monkeypatch.setitem(sys.modules, "math_verify", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # for the subprocess; this process read it at import:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no 45 s of hub retries
    out = copy_of(finished_run, tmp_path)
    before = listing(out)
    if bad == "--dataset=toy/nonexist":
        one_line_error(run_train_here(*RUN, f"--out_dir={out}", "--overwrite=True", bad))
    else:
        with pytest.raises(train.UserError) as e:
            train.main(cli_cfg(f"--out_dir={out}", "--overwrite=True", bad))
        assert "\n" not in str(e.value)
    assert listing(out) == before


def sft_cfg(toy_data, out, **overrides):
    return dict(defaults(), algo="sft", dataset="toy/add", n_layer=1, n_head=2, n_embd=32, block_size=128,
                batch_prompts=4, micro_batch_size=8, max_iters=2, eval_interval=0, eval_max_prompts=2, eval_n=2,
                max_new_tokens=8, warmup_iters=1, learning_rate=1e-2, out_dir=str(out), device="cpu",
                data_dir=toy_data, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), **overrides)


def test_a_wandb_run_gets_every_logged_row_and_is_finished_when_training_ends(toy_data, tmp_path, monkeypatch):
    """wandb_log=True (a stand-in for the package): one wandb.init, each log.jsonl row logged at its
    iteration, and the run finished by train.py itself at the end (a torchrun rank leaves without the
    interpreter's exit hooks, runtime.leave, so wandb's own would never finish it)."""
    calls = []

    class Run:
        def log(self, record, step):
            calls.append(("log", step))

        def finish(self):
            calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: calls.append(("init",)) or Run()))
    train.main(sft_cfg(toy_data, tmp_path / "run", wandb_log=True))
    assert calls[0] == ("init",) and calls[-1] == ("finish",) and calls.count(("finish",)) == 1
    assert [c[1] for c in calls if c[0] == "log"] == [r["iter"] for r in read_log(tmp_path / "run")]


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])
def test_ckpt_is_a_clean_hf_folder_in_save_dtype_and_resumes_exactly(toy_data, tmp_path, save_dtype):
    cfg = sft_cfg(toy_data, tmp_path / "run", save_dtype=save_dtype)
    train.main(cfg)
    ckpt = tmp_path / "run" / "ckpt"
    top = {p.name for p in ckpt.iterdir()}
    assert "trainer" in top and {"config.json", "generation_config.json", "model.safetensors"} <= top
    assert all(not name.endswith(".safetensors") or name == "model.safetensors" for name in top)  # no teacher, no optimizer
    # exactly the keys transformers writes for this model, in save_dtype
    reference, _ = models.load_model("scratch", torch.device("cpu"), scratch=cfg)
    reference.save_pretrained(tmp_path / "plain")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f, safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert all(f.get_tensor(k).dtype == getattr(torch, save_dtype) for k in f.keys())
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert next(loaded.parameters()).dtype == getattr(torch, save_dtype)
    # resuming starts from the fp32 master weights, not from the (rounded) export
    with contextlib.ExitStack() as stack:
        run = train.setup(dict(cfg, init_from="resume", max_iters=3), runtime.Dist("cpu"), stack)
        with open(ckpt / "trainer" / "state.json") as f:
            assert json.load(f)["iter"] == run.state.iter == 2
        exported = dict(loaded.named_parameters())
        for name, p in run.model.named_parameters():
            assert p.dtype == torch.float32
            if save_dtype == "bfloat16":
                torch.testing.assert_close(p.bfloat16(), exported[name].detach())
        if save_dtype == "bfloat16":
            assert any(not torch.equal(p, exported[n].float()) for n, p in run.model.named_parameters())


@pytest.mark.parametrize("crash", ["between the renames", "before the first rename"])
def test_a_crash_during_a_checkpoint_leaves_one_that_the_next_start_finds(finished_run, tmp_path, toy_data, crash):
    out = copy_of(finished_run, tmp_path)
    ckpt = out / "ckpt"
    shutil.copytree(ckpt, out / "ckpt.tmp")  # the new checkpoint, complete
    if crash == "between the renames":  # ckpt -> ckpt.old done, ckpt.tmp -> ckpt not yet
        os.replace(ckpt, out / "ckpt.old")
    else:  # the new one half-written: no trainer/state.json yet
        os.remove(out / "ckpt.tmp" / "trainer" / "state.json")
    assert checkpoint.recover(str(ckpt)) == (None if crash != "between the renames" else
                                             f"recovered the checkpoint {ckpt} from ckpt.tmp (a crash between its renames)")
    assert checkpoint.complete(str(ckpt))
    train.main(tiny_cfg(toy_data, out, init_from="resume", max_iters=3))
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2, 3]
    assert not any(p.name.startswith("ckpt.") for p in out.iterdir())


def _crash_at(k, fn, *args):
    """Run fn(*args) in this (forked) process, killed with SIGKILL just before its (k+1)-th change
    to the disk: a rename, link, mkdir, unlink or rmdir."""
    calls = [0]

    def counted(real):
        def wrapper(*a, **kw):
            calls[0] += 1
            if calls[0] > k:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        return wrapper
    for name in ("replace", "link", "mkdir", "unlink", "rmdir"):
        setattr(os, name, counted(getattr(os, name)))
    fn(*args)


def test_a_kill_at_any_point_of_keep_as_good_leaves_a_ckpt_good_that_the_next_start_recovers(finished_run, tmp_path):
    ctx = multiprocessing.get_context("fork")
    for k in range(500):
        run = tmp_path / f"k{k}"
        shutil.copytree(finished_run, run)
        ckpt, good = run / "ckpt", run / "ckpt_good"
        state = json.loads((good / "trainer" / "state.json").read_text())
        (good / "trainer" / "state.json").unlink()  # the earlier ckpt_good: the same files, iteration 1
        (good / "trainer" / "state.json").write_text(json.dumps(dict(state, iter=1)))
        child = ctx.Process(target=_crash_at, args=(k, checkpoint.keep_as_good, str(ckpt), str(good)))
        child.start()
        child.join(60)
        with checkpoint.take_over(str(run), resume=True, overwrite=False):
            pass  # recovers ckpt/ and ckpt_good/
        assert checkpoint.read_state(str(good))["iter"] in (1, 2), k  # complete, every file sound: old or new
        if child.exitcode == 0:
            assert checkpoint.read_state(str(good))["iter"] == 2 and k > 5
            break
        assert child.exitcode == -signal.SIGKILL
    else:
        pytest.fail("keep_as_good never finished")


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_while_saving_is_one_line_and_loses_nothing(toy_data, tmp_path, monkeypatch, error):
    """The optimizer file of the second checkpoint fails to write: one line naming the folder, the
    space; ckpt/ still holds the first checkpoint (iteration 2), nothing half-written stays, and the
    run continues from it once the disk is back."""
    run, real, calls = tmp_path / "run", checkpoint.save_file, []

    def failing(tensors, path, *a, **kw):
        calls.append(path)
        if len(calls) == 3:  # iteration 0 (the initial model), iteration 2, then iteration 4
            raise OSError(error, os.strerror(error))
        return real(tensors, path, *a, **kw)
    monkeypatch.setattr(checkpoint, "save_file", failing)
    with pytest.raises(train.UserError) as e:
        train.main(tiny_cfg(toy_data, run, max_iters=6, save_interval=2))
    msg = str(e.value)
    assert f"cannot write {run / 'ckpt.tmp'} ({os.strerror(error)};" in msg and "MB free there, about" in msg
    assert f"{run / 'ckpt'} still holds the previous one" in msg and "\n" not in msg
    assert checkpoint.read_state(str(run / "ckpt"))["iter"] == 2 and not (run / "ckpt.tmp").exists()
    monkeypatch.setattr(checkpoint, "save_file", real)
    train.main(tiny_cfg(toy_data, run, max_iters=6, save_interval=2, init_from="resume"))
    assert [r["iter"] for r in read_log(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_while_logging_is_one_line(tmp_path, monkeypatch):
    import builtins
    import metrics
    real_open = builtins.open

    def full(path, mode="r", *a, **kw):
        if str(path).endswith("log.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *a, **kw)
    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(UserError, match=f"^cannot write {tmp_path / 'log.jsonl'} \\(No space left on device\\)"):
        metrics.RunLog(str(tmp_path), True, None, True).record({"iter": 1})


def test_checkpoint_files_get_the_umasks_mode_like_every_other_file(tmp_path, toy_data):
    """safetensors writes 0600; a checkpoint (and ckpt_good, a stage snapshot) is 0644 under umask 022."""
    old = os.umask(0o022)
    try:
        run = tmp_path / "run"
        train.main(tiny_cfg(toy_data, run, stages="toy/add:1,toy/sub:1"))
    finally:
        os.umask(old)
    folders = [run / "ckpt", run / "ckpt_good", run / "stage1_toy_add"]
    modes = {p.relative_to(run): oct(p.stat().st_mode & 0o777) for f in folders for p in f.rglob("*") if p.is_file()}
    assert any(str(p).endswith("optimizer.safetensors") for p in modes) and set(modes.values()) == {"0o644"}, modes


@pytest.mark.parametrize("teacher", ["ema", "frozen"])
def test_resume_continues_exactly(toy_data, tmp_path, teacher):
    """3 iterations, checkpoint, 3 more == 6 uninterrupted (SDPO: model, optimizer, teacher, RNG; one
    thread, conftest.assert_resume_continues_exactly). A frozen teacher is the initial model, which a
    resume rereads from base_init: the checkpoint keeps no copy of it; an EMA teacher's is kept."""
    common = ["config/sdpo_toy.py", *TINY, "--dataset=toy/add", "--init_from=scratch", "--success_threshold=0.0",
              f"--teacher={teacher}", "--density=0.5", "--learning_rate=1e-2", "--device=cpu"]
    assert_resume_continues_exactly(common, tmp_path)
    assert (tmp_path / "split" / "ckpt" / "trainer" / "teacher.safetensors").exists() == (teacher == "ema")


def test_a_resume_says_what_its_allowed_changes_do_to_the_run():
    """gen_batch_size may be lowered after an out-of-memory, but the rollouts then draw their random
    numbers in other chunks; a longer run under decay_lr recomputes its cosine (the rate jumps back up)."""
    cfg = dict(defaults(), decay_lr=True, learning_rate=1e-2, min_lr=0.0, warmup_iters=1)
    assert train.resume_notes(cfg, cfg, [("toy/add", 4)], [("toy/add", 4)], 2) == []
    notes = train.resume_notes(dict(cfg, gen_batch_size=8), dict(cfg, gen_batch_size=4), [("toy/add", 4)],
                               [("toy/add", 4)], 2)
    assert len(notes) == 1 and "gen_batch_size 8 -> 4" in notes[0] and "uninterrupted" in notes[0]
    notes = train.resume_notes(cfg, cfg, [("toy/add", 4)], [("toy/add", 4), ("toy/sub", 4)], 4)
    assert notes == ["note: decay_lr: the cosine now spans 8 iterations, not 4: the learning rate goes from 0 at "
                     "iteration 4 to 0.00389 at iteration 5 (a run planned at 8 decays smoothly)"]
    assert train.resume_notes(dict(cfg, decay_lr=False), dict(cfg, decay_lr=False), [("toy/add", 4)],
                              [("toy/add", 8)], 4) == []  # a constant rate: nothing recomputed


def test_resume_can_extend_a_finished_run_and_redoes_nothing(finished_run, tmp_path, toy_data, capsys):
    """max_iters 2 -> 4 on a finished run trains iterations 3 and 4; the log keeps one record per
    iteration (records after the checkpoint -- here fakes -- are dropped); the accuracy matrix
    has one row for the (reopened) stage; an extra stage can follow, its rows as wide as the others."""
    out = copy_of(finished_run, tmp_path)
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps({"iter": 3, "loss": -1.0}) + "\n" + '{"iter": 4, "lo')  # after the checkpoint, half-written
    train.main(tiny_cfg(toy_data, out, init_from="resume", max_iters=4))
    assert "at iteration 2 (stage 1/1, step 2)" in capsys.readouterr().out  # stages counted from 1, as the progress lines
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2, 3, 4]
    assert all(r["loss"] != -1.0 for r in read_log(out) if "loss" in r)
    with open(out / "accuracy_matrix.json") as f:
        assert json.load(f)["stages"] == ["toy/add"]
    train.main(tiny_cfg(toy_data, out, init_from="resume", stages="toy/add:4,toy/sub:1"))
    with open(out / "accuracy_matrix.json") as f:
        matrix = json.load(f)
    assert matrix["stages"] == ["toy/add", "toy/sub"] and matrix["eval_sets"] == ["toy/add"]
    assert [len(row) for row in matrix["rows"]] == [1, 1]  # the added stage's set is no new (ragged) column


def resumed(run, *args):
    return train.main(cli_cfg(f"--out_dir={run}", "--init_from=resume", *args))


def test_a_resume_drops_the_samples_after_its_checkpoint_as_it_does_log_rows(toy_data, tmp_path):
    run = tmp_path / "run"
    train.main(tiny_cfg(toy_data, run, algo="grpo"))  # 2 iterations: samples at the end of the stage
    fake = "from a run killed after its checkpoint"
    with open(run / "samples.jsonl", "a") as f:
        f.write(json.dumps({"iter": 3, "prompt": fake, "response": ""}) + "\n" + '{"iter": 4, "pro')
    train.main(tiny_cfg(toy_data, run, algo="grpo", init_from="resume", max_iters=3))
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {r["iter"] for r in rows} == {2, 3} and all(r["prompt"] != fake for r in rows)


@pytest.mark.parametrize("change,key", [("--algo=grpo", "algo"), ("--n_embd=64", "n_embd"), ("--learning_rate=0.5", "learning_rate"),
                                        ("--stages=toy/sub:5", "stages")])
def test_resume_refuses_a_changed_run_naming_the_key(finished_run, tmp_path, change, key):
    out = copy_of(finished_run, tmp_path)
    before = listing(out)
    if key == "algo":  # once through the command line: one line, exit 1
        assert "algo was" in one_line_error(run_train_here(*RUN, f"--out_dir={out}", "--init_from=resume", change))
    else:
        with pytest.raises(train.UserError, match=f"{key} (was|were)"):
            train.main(cli_cfg(f"--out_dir={out}", "--init_from=resume", change))
    assert listing(out) == before


@pytest.mark.parametrize("edit,expect", [
    (lambda s: s.pop("iter"), "iter is missing"),
    (lambda s: s.update(iter=-7), "iter is -7, not an int >= 0"),
    (lambda s: s.update(iter="3"), "iter is '3', not an int >= 0"),
    (lambda s: s.pop("guard"), "guard is missing"),
    (lambda s: s["guard"].update(best=[0.5]), "guard.best is [0.5], not a dict"),
    (lambda s: s.update(world=2), "written by 2 rank(s), this run has 1"),
])
def test_a_state_json_that_parses_but_is_not_this_runs_is_one_line_and_truncates_nothing(finished_run, tmp_path, edit,
                                                                                          expect):
    run = copy_of(finished_run, tmp_path)
    path = run / "ckpt" / "trainer" / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    with open(run / "log.jsonl", "a") as f:  # rows after the checkpoint: a resume would drop them, a refusal must not
        f.write(json.dumps({"iter": 3, "loss": 1.0}) + "\n")
    before = listing(run)
    with pytest.raises(train.UserError) as e:
        resumed(run, "--max_iters=3")
    assert expect in str(e.value) and "\n" not in str(e.value)
    assert listing(run) == before


def test_a_resume_on_other_data_is_refused_naming_the_file(finished_run, tmp_path):
    run, data = copy_of(finished_run, tmp_path), tmp_path / "data"
    shutil.copytree(os.path.join(ROOT, "data", "toy", "add"), data / "toy" / "add")
    lines = (data / "toy" / "add" / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "toy" / "add" / "train.jsonl").write_text("".join(lines[:-1]))  # one record fewer
    with pytest.raises(train.UserError, match=r"toy/add/train.jsonl in data_dir is not the file this run trained on"):
        resumed(run, "--max_iters=3", f"--data_dir={data}")
    (data / "toy" / "add" / "train.jsonl").write_text("".join(lines))  # the same data elsewhere: data_dir may move
    resumed(run, "--max_iters=3", f"--data_dir={data}")
    assert [r["iter"] for r in read_log(run) if "loss" in r] == [1, 2, 3]


def test_resume_from_something_that_is_not_a_checkpoint(tmp_path, toy_data):
    (tmp_path / "ckpt").mkdir()
    proc = run_train_here(f"--out_dir={tmp_path}", "--init_from=resume")
    assert proc.returncode != 0 and "ckpt" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    typo = tmp_path / "typo" / "run"  # a mistyped out_dir: one line, and no folder made for it
    proc = run_train_here(f"--out_dir={typo}", "--init_from=resume")
    assert proc.returncode != 0 and "not a nanoSDPO checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "typo").exists()


def test_a_resume_refuses_an_initial_model_that_changed_since_the_run_began(finished_run, tmp_path):
    """A run with kl_coef (or a frozen / trust-region teacher, an 'initial' reset) rereads its initial model
    from init_from on resume; trained further or replaced since, it would be another KL reference, silently."""
    base = copy_of(finished_run, tmp_path) / "ckpt"
    run = tmp_path / "grpo"
    grpo = [f"--out_dir={run}", "--algo=grpo", "--kl_coef=0.1", "--success_threshold=0.0"]
    train.main(cli_cfg(*grpo, f"--init_from={base}", "--max_iters=1"))
    train.main(cli_cfg(*grpo, "--init_from=resume", "--max_iters=2"))  # the same base: resumes
    weights = load_file(str(base / "model.safetensors"))
    name = next(iter(weights))
    save_file(dict(weights, **{name: weights[name] + 0.01}), str(base / "model.safetensors"))
    before = listing(run)
    with pytest.raises(train.UserError, match="holds other weights than when the run began") as e:
        train.main(cli_cfg(*grpo, "--init_from=resume", "--max_iters=3"))
    assert "\n" not in str(e.value) and str(base) in str(e.value)
    assert listing(run) == before


def test_a_fresh_run_from_a_checkpoint_inside_out_dir_cannot_overwrite_it(finished_run, tmp_path):
    """--overwrite=True would delete the model the run starts from, and its own checkpoints would take that
    path: a resume would reread them as the initial model."""
    out = copy_of(finished_run, tmp_path)
    before = listing(out)
    with pytest.raises(train.UserError, match="inside out_dir") as e:
        train.main(cli_cfg(f"--out_dir={out}", "--overwrite=True", f"--init_from={out / 'ckpt'}"))
    assert "\n" not in str(e.value) and listing(out) == before


def test_a_teacher_init_that_is_missing_or_another_model_changes_nothing(finished_run, tmp_path, monkeypatch):
    """teacher_init is loaded, and its shapes checked, before the run takes out_dir over (--overwrite=True
    once removed the earlier run first, then failed)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    other = tmp_path / "wider"
    models.load_model("scratch", "cpu", scratch=dict(cli_cfg(), n_embd=64))[0].save_pretrained(other)
    out = copy_of(finished_run, tmp_path)
    before = listing(out)
    for init, says in ((tmp_path / "no-such-model", "^teacher_init: model .*no-such-model not found"),
                       (other, "is not the student's architecture")):
        with pytest.raises(train.UserError, match=says) as e:
            train.main(cli_cfg(f"--out_dir={out}", "--overwrite=True", "--algo=sdpo", "--teacher=ema",
                               f"--teacher_init={init}"))
        assert "\n" not in str(e.value)
        assert listing(out) == before, init


def test_a_resume_after_a_crash_before_ckpt_good_was_linked_links_it(finished_run, tmp_path, capsys):
    """The guard passed ckpt/ (its guard.good is its own iteration) and the run died before ckpt_good/ became
    it: the collapse message would name an iteration ckpt_good/ does not hold. The next start links it."""
    out = copy_of(finished_run, tmp_path)
    good = out / "ckpt_good" / "trainer" / "state.json"
    state = json.loads(good.read_text())
    assert state["guard"]["good"]["iter"] == state["iter"] == 2
    good.unlink()  # a hard link of ckpt/'s: a file of its own, for an earlier checkpoint
    good.write_text(json.dumps(dict(state, iter=1)))
    resumed(out)
    assert json.loads(good.read_text())["iter"] == 2
    assert "at iteration 2 (every stage done)" in capsys.readouterr().out


def test_a_resume_on_another_device_type_reseeds_its_sampling_and_says_so(finished_run, tmp_path, capsys):
    """A CUDA generator's state (16 bytes) cannot drive a CPU generator (5056), nor the reverse: a run moved
    between a GPU and a CPU (device is resumable) reseeds with a note instead of a traceback."""
    out = copy_of(finished_run, tmp_path)
    path = str(out / "ckpt" / "trainer" / "optimizer.safetensors")
    tensors = load_file(path)
    save_file(dict(tensors, **{"rng.sampling.0": torch.zeros(16, dtype=torch.uint8)}), path)
    resumed(out, "--max_iters=3")
    assert "another device type" in capsys.readouterr().out
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2, 3]


def test_a_resume_from_the_first_checkpoint_does_not_score_the_initial_model_twice(toy_data, tmp_path, monkeypatch):
    """A run killed after its iteration-0 checkpoint: the resume keeps that checkpoint's start eval (one
    "start" record in log.jsonl, one wandb step) instead of scoring the initial model again."""
    out = tmp_path / "run"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(train, "optimizer_step", killed)
        with pytest.raises(KeyboardInterrupt):
            train.main(tiny_cfg(toy_data, out))
    assert checkpoint.read_state(str(out / "ckpt"))["iter"] == 0
    train.main(tiny_cfg(toy_data, out, init_from="resume"))
    assert [r["eval_tag"] for r in read_log(out) if "eval_tag" in r] == ["start", "end of stage 1"]
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2]


def test_eval_sets_may_be_listed_with_spaces_as_stages_may(toy_data, tmp_path):
    train.main(tiny_cfg(toy_data, tmp_path / "run", eval_sets="toy/add, toy/sub", max_iters=1))
    with open(tmp_path / "run" / "accuracy_matrix.json") as f:
        assert json.load(f)["eval_sets"] == ["toy/add", "toy/sub"]


@pytest.mark.parametrize("damage", ["truncated model", "truncated optimizer", "half-written state", "no teacher"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, toy_data, damage):
    out = tmp_path / "run"
    algo = "sdpo" if damage == "no teacher" else "sft"
    cfg = tiny_cfg(toy_data, out, algo=algo, **({"success_threshold": 0.0, "group_size": 2} if algo == "sdpo" else {}))
    train.main(cfg)
    ckpt = out / "ckpt"
    target = {"truncated model": ckpt / "model.safetensors", "truncated optimizer": ckpt / "trainer" / "optimizer.safetensors",
              "half-written state": ckpt / "trainer" / "state.json", "no teacher": ckpt / "trainer" / "teacher.safetensors"}[damage]
    if damage == "no teacher":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[:len(target.read_bytes()) // 2])
    with pytest.raises(train.UserError) as e:
        train.main(dict(cfg, init_from="resume", max_iters=3))
    assert str(target) in str(e.value) and "\n" not in str(e.value)


def eval_cfg(**overrides):
    """eval.py's defaults, at the smallest settings."""
    from configurator import configure
    cfg = configure(dict(vars(ev)), ["--n=1", "--k=1", "--max_prompts=2", "--drift_prompts=0", "--spectral_k=-1",
                                     "--base_model=none", "--stage_drift=False", "--device=cpu"], ev.__file__)
    return dict(cfg, **overrides)


def test_eval_out_never_overwrites_a_file_it_did_not_write(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    readme, config = tmp_path / "README.md", run / "ckpt" / "config.json"
    readme.write_text("# my notes\n")
    before = config.read_bytes()
    line = one_line_error(subprocess.run([sys.executable, "eval.py", f"--run_dir={run}", f"--out={readme}"], cwd=ROOT,
                                         capture_output=True, text=True, timeout=300))
    assert "give a path ending in .json" in line
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    (tmp_path / "other.md").write_text("# mine\n")  # beside an absent other.json: the markdown would be replaced
    (tmp_path / "pic_matrix.png").write_bytes(b"a picture")  # beside an absent pic.json: a plot would replace it
    for out in (config, tmp_path / "notes.json", tmp_path / "other.json", tmp_path / "pic.json"):
        with pytest.raises(train.UserError, match="exists and is not a report eval.py wrote"):
            ev.main(eval_cfg(run_dir=str(run), out=str(out)))
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}' and (tmp_path / "other.md").read_text() == "# mine\n"
    assert readme.read_text() == "# my notes\n" and config.read_bytes() == before
    ev.main(eval_cfg(run_dir=str(run)))  # its own report, written twice: the second overwrites the first
    ev.main(eval_cfg(run_dir=str(run)))
    with open(run / "eval.json") as f:
        assert json.load(f)["written_by"] == ev.REPORT_MARK
    assert (run / "eval.md").read_text().startswith("# eval: ")


def test_eval_waits_for_a_checkpoint_being_saved_and_reads_one_a_crash_left(finished_run, tmp_path):
    """train.py holds .ckpt.lock while ckpt/ is between its renames: eval.py's load waits for the
    save to end instead of taking the missing folder for a hub id; after a crash there (no lock
    held, no ckpt/) it loads the complete ckpt.old."""
    run = copy_of(finished_run, tmp_path)
    ckpt, old = run / "ckpt", run / "ckpt.old"
    loaded = []
    with checkpoint.writing(str(ckpt)):  # this test is the trainer now
        os.replace(ckpt, old)
        reader = threading.Thread(target=lambda: loaded.append(ev.load(str(ckpt), {}, torch.device("cpu"))))
        reader.start()
        reader.join(1.0)
        assert not loaded  # waiting on the lock (a read of the half-renamed folder would have failed by now)
        os.replace(old, ckpt)
    reader.join(120)
    assert loaded and loaded[0][0].config.num_hidden_layers == 1
    os.replace(ckpt, old)  # a crash between the renames: no ckpt/, nobody holds the lock
    model_, _ = ev.load(str(ckpt), {}, torch.device("cpu"))
    assert ev.read_run(str(run))["state"]["iter"] == 2


@pytest.mark.parametrize("damage", ["half-written matrix", "ragged matrix", "half-written state", "a list for state"])
def test_eval_reads_a_damaged_run_file_as_one_line(finished_run, tmp_path, damage):
    run = copy_of(finished_run, tmp_path)
    matrix, state = run / "accuracy_matrix.json", run / "ckpt" / "trainer" / "state.json"
    if damage == "half-written matrix":
        matrix.write_text(matrix.read_text()[:20])
    elif damage == "ragged matrix":
        m = json.loads(matrix.read_text())
        m["rows"].append([0.5, 0.5])  # a second stage with one set more than eval_sets
        m["stages"].append("toy/sub")
        matrix.write_text(json.dumps(m))
    elif damage == "half-written state":
        state.write_text(state.read_text()[:50])
    else:
        state.write_text("[1, 2]")
    target = matrix if "matrix" in damage else state
    with pytest.raises(train.UserError) as e:
        ev.main(eval_cfg(run_dir=str(run)))
    assert str(target) in str(e.value) and "\n" not in str(e.value)


def test_a_run_started_from_another_runs_checkpoint_says_which_iteration_it_holds(finished_run, tmp_path, capsys):
    """A checkpoint is written at every eval, iteration 0 included: a run started from a base that is still
    training (or stopped early) would otherwise start, silently, from a half-trained or random model."""
    train.main(tiny_cfg(None, tmp_path / "next", init_from=str(finished_run / "ckpt"), max_iters=1))
    assert f"init_from {finished_run / 'ckpt'}: iteration 2 of the 2 its run planned\n" in capsys.readouterr().out
    early = copy_of(finished_run / "ckpt", tmp_path)
    state = json.loads((early / "trainer" / "state.json").read_text())
    state.update(iter=0, config=dict(state["config"], stages="toy/add:1000,toy/context:150"))
    (early / "trainer" / "state.json").write_text(json.dumps(state))
    assert checkpoint.source_note(str(early)) == (f"init_from {early}: iteration 0 of the 1150 its run planned (that run "
                                                 "stopped early, or is still training)")
    assert checkpoint.source_note("Qwen/Qwen3-8B") is None and checkpoint.source_note(str(tmp_path / "next")) is None
