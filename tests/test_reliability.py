"""Reliability, class by class: no run ever loses data, the collapse guard keeps a good model,
resume means the same run, and every bad input is one line before any work."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, read_log, run_train

import checkpoint
import metrics
import train


# a tiny SFT run, the same whether it runs as `python train.py *RUN` or in-process as train.main(cli_cfg())
RUN = ["config/toy_base.py", *TINY, "--stages=", "--eval_sets=", "--dataset=toy/add", "--max_iters=2", "--device=cpu",
       f"--data_dir={os.path.join(ROOT, 'data')}", f"--tokenizer_path={os.path.join(ROOT, 'data', 'toy', 'tokenizer')}"]


def cli_cfg(*args):
    """The config `python train.py *RUN *args` runs with."""
    from configurator import configure
    return configure(dict(vars(train)), [*RUN, *args], train.__file__)


def tiny_cfg(toy_data, out, **overrides):
    """A tiny run for train.main(), in-process (seconds, no interpreter start)."""
    return dict(cli_cfg(), out_dir=str(out), **overrides)


def one_line_error(proc):
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def listing(folder):
    """Every file under folder with its bytes' hash: 'nothing changed' means equal listings (the lock
    files aside: .lock names the pid of the last run that held it)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            if f in (".lock", ".ckpt.lock"):
                continue
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hash(fh.read())
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, toy_data):
    """A finished 2-iteration SFT run (its folder is copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train.main(tiny_cfg(toy_data, out))
    return out


def copy_of(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ----------------------------------------------------------------------------- 1. nothing is deleted by mistake
@pytest.mark.parametrize("bad", ["--dataset=toy/nonexist", "--wandb_log=True", "--init_from=no/such-model-here",
                                 "--max_new_tokens=4000", "--math_checker=math_verify"])
def test_a_bad_input_into_a_finished_run_changes_nothing(finished_run, tmp_path, bad, monkeypatch):
    """Even with --overwrite=True: every input is checked before anything in out_dir is touched.
    The first case through the command line (one line, exit 1), the others in this process."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # absent, whatever this machine has installed
    monkeypatch.setitem(sys.modules, "math_verify", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = copy_of(finished_run, tmp_path)
    before = listing(out)
    if bad == "--dataset=toy/nonexist":
        one_line_error(run_train(*RUN, f"--out_dir={out}", "--overwrite=True", bad, check=False))
    else:
        with pytest.raises(train.UserError) as e:
            train.main(cli_cfg(f"--out_dir={out}", "--overwrite=True", bad))
        assert "\n" not in str(e.value)
    assert listing(out) == before


def test_a_second_run_into_the_same_out_dir_stops_and_a_killed_runs_lock_blocks_nothing(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, checkpoint\nwith checkpoint.locked(sys.argv[1]):\n"
                               "    print('held', flush=True); time.sleep(600)", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = (*RUN, f"--out_dir={out}", "--init_from=resume", "--max_iters=3")
        assert f"in use by another run (pid {holder.pid})" in one_line_error(run_train(*args, check=False))
    finally:
        holder.kill()  # kill -9: its .lock file stays, its lock goes with it
        holder.wait()
    assert (out / ".lock").read_text() == str(holder.pid)
    run_train(*args)
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2, 3]


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


# ----------------------------------------------------------------------------- 2. the collapse guard keeps a good model
def faked_evals(monkeypatch, accs, lengths=None):
    """train.score_and_log_eval_sets runs as usual, then reports accs[k] (a mean@n per set) at its k-th call."""
    real, calls = train.score_and_log_eval_sets, iter(accs)

    def fake_eval(run, cfg, ddp, tag):
        row, real_lengths = real(run, cfg, ddp, tag)
        faked = next(calls)
        return {name: faked[name] if isinstance(faked, dict) else faked for name in row}, lengths or real_lengths
    monkeypatch.setattr(train, "score_and_log_eval_sets", fake_eval)


def saved_iter(ckpt):
    with open(ckpt / "trainer" / "state.json") as f:
        return json.load(f)["iter"]


def test_the_guard_keeps_the_checkpoint_that_passed_it_and_names_it_truthfully(toy_data, tmp_path, monkeypatch):
    """Evals at every iteration: good (0.5) at iteration 1, then dead twice: the run stops at
    iteration 3 and names ckpt_good at iteration 1 (ckpt/ holds iteration 2, already bad)."""
    faked_evals(monkeypatch, [0.5, 0.5, 0.0, 0.0])  # start, 1, 2, 3
    cfg = tiny_cfg(toy_data, tmp_path / "run", max_iters=6, eval_interval=1, collapse_patience=2)
    with pytest.raises(train.UserError) as e:
        train.main(cfg)
    msg = str(e.value)
    assert "stopped after 3 iterations" in msg and "ckpt_good (iteration 1, eval toy/add 0.500)" in msg
    assert saved_iter(tmp_path / "run" / "ckpt_good") == 1 and saved_iter(tmp_path / "run" / "ckpt") == 2


def test_a_collapse_of_any_eval_set_stops_the_run_not_only_of_the_one_trained(toy_data, tmp_path, monkeypatch):
    """Training add while sort falls from 0.6 to 0.2 (below half its best, not zero): the run stops
    and ckpt_good is the last model before the fall, whatever add does."""
    faked_evals(monkeypatch, [{"toy/add": 0.1, "toy/sort": 0.6}, {"toy/add": 0.2, "toy/sort": 0.6},
                              {"toy/add": 0.3, "toy/sort": 0.2}, {"toy/add": 0.4, "toy/sort": 0.2}])
    cfg = tiny_cfg(toy_data, tmp_path / "run", max_iters=6, eval_interval=1, collapse_patience=2,
                   eval_sets="toy/add,toy/sort")
    with pytest.raises(train.UserError) as e:
        train.main(cfg)
    assert "stopped after 3 iterations: toy/sort fell to 0.200 from its best 0.600 (2 evals in a row)" in str(e.value)
    assert "ckpt_good (iteration 1, eval toy/add 0.200, toy/sort 0.600)" in str(e.value)
    assert saved_iter(tmp_path / "run" / "ckpt_good") == 1


def test_a_run_whose_guard_never_passed_keeps_its_initial_model_as_good(toy_data, tmp_path, monkeypatch):
    faked_evals(monkeypatch, [0.5, 0.1, 0.1])  # start, 1, 2: below half the initial model's 0.5 from the first eval
    cfg = tiny_cfg(toy_data, tmp_path / "run", max_iters=6, eval_interval=1, collapse_patience=2)
    with pytest.raises(train.UserError, match=r"stopped after 2 iterations: .*ckpt_good \(the initial model, eval "
                                              r"toy/add 0.500\)$"):
        train.main(cfg)
    good, ckpt = tmp_path / "run" / "ckpt_good", tmp_path / "run" / "ckpt"
    assert saved_iter(good) == 0 and saved_iter(ckpt) == 1
    from safetensors.torch import load_file
    torch.manual_seed(cfg["seed"])  # as setup() does: the same initial model
    initial = train.load_model(cfg["init_from"], torch.device("cpu"), scratch=cfg)[0]
    kept = load_file(good / "model.safetensors")
    assert all(torch.equal(kept[k], v) for k, v in initial.state_dict().items() if k in kept)


def test_the_guard_judges_every_set_against_its_own_best():
    patience1, patience2 = ({"collapse_patience": p, "stop_on_collapse": True} for p in (1, 2))
    off = {"collapse_patience": 1, "stop_on_collapse": False}
    guard = metrics.Guard(best={"a": 0.4, "b": 0.5})
    long = {"a": 5.0, "b": 5.0}
    assert metrics.check_eval(guard, {"a": 0.3, "b": 0.5}, long, patience2)  # 0.3 >= half of 0.4
    assert not metrics.check_eval(guard, {"a": 0.4, "b": 0.2}, long, patience2)  # b below half: one bad eval
    with pytest.raises(metrics.Collapse, match=r"b fell to 0.000 from its best 0.500 \(2 evals in a row\)"):
        metrics.check_eval(guard, {"a": 0.4, "b": 0.0}, long, patience2)
    never = metrics.Guard(best={"a": 0.0})
    for _ in range(3):  # zero from the start (a scratch model) is not a collapse: nothing was lost
        assert metrics.check_eval(never, {"a": 0.0}, {"a": 5.0}, patience1)
    empty = metrics.Guard(best={})
    assert not metrics.check_eval(empty, {"a": 0.3}, {"a": 1.0}, patience2)  # accurate but empty: counts
    assert metrics.check_eval(empty, {"a": 0.3}, {"a": 9.0}, patience2) and empty.bad_evals == 0  # recovered
    for _ in range(3):  # stop_on_collapse=False: counted, never raised
        assert not metrics.check_eval(empty, {"a": 0.3}, {"a": 1.0}, off)
    assert empty.bad_evals == 3 and empty.best == {"a": 0.3}


def test_in_a_continual_run_an_earlier_domain_may_be_forgotten_but_not_zeroed():
    """Forgetting an earlier stage's domain is what a continual run measures: only the current
    stage's sets are held to half their best; an earlier one is a collapse only at zero."""
    patience1 = {"collapse_patience": 1, "stop_on_collapse": True}
    guard = metrics.Guard(best={"add": 0.6, "mul": 0.4})
    long = {"add": 5.0, "mul": 5.0}
    assert metrics.check_eval(guard, {"add": 0.1, "mul": 0.4}, long, patience1, trained={"mul"})  # add forgotten
    with pytest.raises(metrics.Collapse, match="mul fell to 0.100"):  # the domain being trained halved
        metrics.check_eval(guard, {"add": 0.6, "mul": 0.1}, long, patience1, trained={"mul"})
    with pytest.raises(metrics.Collapse, match="add fell to 0.000"):  # an earlier domain wiped out
        metrics.check_eval(metrics.Guard(best={"add": 0.6, "mul": 0.4}), {"add": 0.0, "mul": 0.4}, long, patience1,
                           trained={"mul"})
    assert train.metrics.trained_sets([("add", 3), ("mul+sub", 3)], "mul+sub") == {"mul", "sub"}
    assert train.metrics.trained_sets([("add", 3)], "add") is None  # one stage: every set held to half its best


def test_a_loss_that_runs_away_at_the_first_steps_stops_the_run_keeping_the_initial_model(toy_data, tmp_path):
    """SFT at lr 10 diverges from its second step; no running median exists yet, so the absolute
    bound (10 × ln vocab) stops it, and ckpt_good is the initial model, not the diverged one."""
    cfg = tiny_cfg(toy_data, tmp_path / "run", max_iters=8, learning_rate=10.0, warmup_iters=0, save_interval=1)
    with pytest.raises(train.UserError) as e:
        train.main(cfg)
    msg = str(e.value)
    assert "before a running median exists): diverging" in msg and "ckpt_good (the initial model" in msg
    assert saved_iter(tmp_path / "run" / "ckpt_good") == 0
    losses = [r["loss"] for r in read_log(tmp_path / "run") if "loss" in r]
    assert len(losses) < 8 and max(losses) < 10 * torch.log(torch.tensor(99.0)).item()  # nothing diverged got logged


def test_the_loss_guard_bounds_the_first_steps_and_then_follows_the_median():
    guard, log_vocab = metrics.Guard(best={}), 4.0
    metrics.check_loss(guard, 3.0, log_vocab=log_vocab, stop=True)
    with pytest.raises(metrics.Collapse, match="above 40 .*before a running median"):
        metrics.check_loss(guard, 41.0, log_vocab=log_vocab, stop=True)
    metrics.check_loss(guard, 41.0, log_vocab=log_vocab, stop=False)  # off: counted, not raised
    for loss in [0.0] * 25:  # GRPO steps without signal: a median of 0 is no hair trigger
        metrics.check_loss(guard, loss, log_vocab=log_vocab, stop=True)
    assert len(guard.losses) == metrics.MEDIAN_OVER
    metrics.check_loss(guard, 3.9, log_vocab=log_vocab, stop=True)
    with pytest.raises(metrics.Collapse, match="running median"):
        metrics.check_loss(guard, 4.1, log_vocab=log_vocab, stop=True)
    for bad in (float("nan"), float("inf")):  # a non-finite loss always stops
        with pytest.raises(metrics.Collapse, match="loss is"):
            metrics.check_loss(guard, bad, log_vocab=log_vocab, stop=False)


def test_a_patience_of_zero_is_refused_at_the_config_check(tmp_path):
    with pytest.raises(train.UserError, match="^collapse_patience=0 must be positive$"):
        train.main(cli_cfg(f"--out_dir={tmp_path / 'run'}", "--collapse_patience=0"))
    assert not (tmp_path / "run").exists()


def test_the_collapse_message_names_the_good_checkpoint():
    msg = metrics.collapse_message("out/x/ckpt", 7, {"iter": 5, "acc": {"toy/add": 0.5}}, "loss is nan")
    assert msg == ("training stopped after 7 iterations: loss is nan. The last checkpoint that passed the collapse guard: "
                   "out/x/ckpt_good (iteration 5, eval toy/add 0.500)")
    assert metrics.collapse_message("out/x/ckpt", 7, {"iter": 0, "acc": {"toy/add": 0.1}}, "e").endswith(
        "out/x/ckpt_good (the initial model, eval toy/add 0.100)")


def test_a_runaway_loss_stops_the_run_before_it_overwrites_the_checkpoint(toy_data, tmp_path, monkeypatch):
    real, calls = train.loss_backward, []

    def exploding(*args, **kwargs):
        metrics = real(*args, **kwargs)
        calls.append(1)
        return dict(metrics, loss=metrics["loss"] * (1000 if len(calls) == 13 else 1))
    monkeypatch.setattr(train, "loss_backward", exploding)
    with pytest.raises(train.UserError, match="after 12 iterations: loss .* is above .* running median"):
        train.main(tiny_cfg(toy_data, tmp_path / "run", max_iters=20, save_interval=4))
    assert saved_iter(tmp_path / "run" / "ckpt") == 12


def test_non_finite_weights_stop_the_run_with_the_guards_message(toy_data, tmp_path):
    """lr=1e30: the step overflows; the run stops before sampling from inf weights."""
    proc = run_train(*RUN, "--learning_rate=1e30", "--warmup_iters=0", "--max_iters=3", f"--out_dir={tmp_path / 'run'}",
                     check=False)
    line = one_line_error(proc)
    assert "weights are not finite" in line and "collapse guard" in line


# ----------------------------------------------------------------------------- 3. resume means the same run
@pytest.mark.parametrize("change,key", [("--algo=grpo", "algo"), ("--n_embd=64", "n_embd"), ("--learning_rate=0.5", "learning_rate"),
                                        ("--stages=toy/sub:5", "stages")])
def test_resume_refuses_a_changed_run_naming_the_key(finished_run, tmp_path, change, key):
    out = copy_of(finished_run, tmp_path)
    before = listing(out)
    if key == "algo":  # once through the command line: one line, exit 1
        assert "algo was" in one_line_error(run_train(*RUN, f"--out_dir={out}", "--init_from=resume", change, check=False))
    else:
        with pytest.raises(train.UserError, match=f"{key} (was|were)"):
            train.main(cli_cfg(f"--out_dir={out}", "--init_from=resume", change))
    assert listing(out) == before


def test_resume_can_extend_a_finished_run_and_redoes_nothing(finished_run, tmp_path, toy_data):
    """max_iters 2 -> 4 on a finished run trains iterations 3 and 4; the log keeps one record per
    iteration (records after the checkpoint -- here fakes -- are dropped); the accuracy matrix
    has one row for the (reopened) stage; an extra stage can follow, its rows as wide as the others."""
    out = copy_of(finished_run, tmp_path)
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps({"iter": 3, "loss": -1.0}) + "\n" + '{"iter": 4, "lo')  # after the checkpoint, half-written
    train.main(tiny_cfg(toy_data, out, init_from="resume", max_iters=4))
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2, 3, 4]
    assert all(r["loss"] != -1.0 for r in read_log(out) if "loss" in r)
    with open(out / "accuracy_matrix.json") as f:
        assert json.load(f)["stages"] == ["toy/add"]
    train.main(tiny_cfg(toy_data, out, init_from="resume", stages="toy/add:4,toy/sub:1"))
    with open(out / "accuracy_matrix.json") as f:
        matrix = json.load(f)
    assert matrix["stages"] == ["toy/add", "toy/sub"] and matrix["eval_sets"] == ["toy/add"]
    assert [len(row) for row in matrix["rows"]] == [1, 1]  # the added stage's set is no new (ragged) column


# ----------------------------------------------------------------------------- 4. every bad input is one line
def write_jsonl(path, lines):
    os.makedirs(path.parent, exist_ok=True)
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines))


GOOD = {"kind": "math", "messages": [{"role": "user", "content": "1+1"}], "answer": "2", "solution": "\\boxed{2}"}


@pytest.mark.parametrize("line,needs_solution,expect", [
    ({**GOOD, "kind": "poetry"}, False, "kind='poetry' has no answer checker"),
    ({**GOOD, "messages": "1+1"}, False, "messages must be a non-empty list"),
    ({**GOOD, "messages": [{"role": "user"}]}, False, "messages must be a non-empty list"),
    ({**GOOD, "answer": ""}, False, "answer is missing or empty"),
    ({**GOOD, "answer": None}, False, "answer is missing or empty"),
    ({k: v for k, v in GOOD.items() if k != "solution"}, True, "algo=sft needs a 'solution'"),
    (b"\xff\xfe not utf-8\n", False, "not UTF-8 text"),
    (b"{not json\n", False, "not valid JSON"),
])
def test_a_bad_record_is_one_line_naming_file_line_and_fix(tmp_path, line, needs_solution, expect):
    write_jsonl(tmp_path / "bad" / "train.jsonl", [GOOD, line])
    with pytest.raises(train.UserError) as e:
        train.load_tasks("bad", "train", str(tmp_path), need_solution=needs_solution)
    assert f"train.jsonl:2: {expect}" in str(e.value) and "\n" not in str(e.value)
    write_jsonl(tmp_path / "empty" / "train.jsonl", [])
    with pytest.raises(train.UserError, match="has no tasks"):
        train.load_tasks("empty", "train", str(tmp_path))


def test_long_prompts_are_left_out_quickly_and_a_context_too_small_is_one_line(toy_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(os.path.join(toy_data, "toy", "tokenizer"), data / "toy" / "tokenizer")
    huge = {**GOOD, "messages": [{"role": "user", "content": "1" * 1_000_000}]}
    write_jsonl(data / "long" / "train.jsonl", [GOOD, huge, GOOD])
    write_jsonl(data / "long" / "test.jsonl", [GOOD])
    common = ("config/toy_base.py", *TINY, "--stages=", "--eval_sets=", "--dataset=long", f"--data_dir={data}", "--device=cpu",
              f"--tokenizer_path={data / 'toy' / 'tokenizer'}")
    proc = run_train(*common, f"--out_dir={tmp_path / 'a'}", "--max_iters=1")
    assert "long: left out 1 of 3 prompts longer than 120 tokens" in proc.stdout
    line = one_line_error(run_train(*common, f"--out_dir={tmp_path / 'b'}", "--block_size=4", check=False))
    assert "exceeds the model's context of 4 tokens" in line and not (tmp_path / "b").exists()


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


@pytest.mark.parametrize("args,expect", [
    (["--device=tpu"], "device='tpu' is not supported"),
    (["--device=cuda"], "no CUDA GPU"),
    (["--out_dir="], "out_dir='' is empty"),
    (["--out_dir=README.md"], "is a file"),
])
def test_devices_and_paths_are_one_line(toy_data, args, expect):
    if args == ["--device=cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if args == ["--device=tpu"]:  # once through the command line: one line, exit 1
        assert expect in one_line_error(run_train("config/grpo_toy.py", *TINY, "--init_from=scratch", *args, check=False))
        return
    with pytest.raises(train.UserError, match=expect.replace("(", r"\(")) as e:
        train.main(cli_cfg(*args))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args,expect", [
    (["--max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
    (["--num_samples=0"], "num_samples=0 must be >= 1"),
    (["--prompt_file=EMPTY"], "holds no prompts"),
])
def test_sample_py_bad_input_is_one_line(toy_data, tmp_path, args, expect):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    args = [a.replace("EMPTY", str(empty)) for a in args]
    if args == ["--max_new_tokens=0"]:  # once through the command line: one line, exit 1
        proc = subprocess.run([sys.executable, "sample.py", "--init_from=no/model", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert expect in one_line_error(proc)
        return
    import sample
    from configurator import configure
    with pytest.raises(train.UserError, match=expect):
        sample.main(configure(dict(vars(sample)), ["--init_from=no/model", *args], sample.__file__))


def test_sample_py_greedy_at_temperature_zero(finished_run, capsys):
    import sample as sample_py
    from configurator import configure

    def sample(seed):
        sample_py.main(configure(dict(vars(sample_py)), [f"--init_from={finished_run / 'ckpt'}", "--temperature=0",
                                                         "--num_samples=2", "--max_new_tokens=6", f"--seed={seed}",
                                                         "--device=cpu"], sample_py.__file__))
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("-->")]
    first = sample(1)
    assert len(first) == 2 and first[0] == first[1] and sample(2) == first  # greedy: no randomness
