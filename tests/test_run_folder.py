"""The run folder under races and odd states: one holder of out_dir's lock at a time, a lock that
dies with its process, eval.py that never overwrites what it did not write and reads a checkpoint
consistently while a run saves one."""
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import ROOT
from test_reliability import one_line_error, tiny_cfg

import checkpoint
import eval as ev
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


# ----------------------------------------------------------------------------- eval.py on a run folder
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, toy_data):
    """A finished 2-iteration SFT run (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train.main(tiny_cfg(toy_data, out))
    return out


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


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
    for out in (config, tmp_path / "notes.json", tmp_path / "other.json"):
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
