"""The run folder under races and odd states: one holder of out_dir's lock at a time, a lock that
dies with its process, eval.py that never overwrites what it did not write and reads a checkpoint
consistently while a run saves one."""
import multiprocessing
import os
import signal
import time

import pytest

import checkpoint
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
