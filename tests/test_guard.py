"""The monitors: the collapse guard (every eval set against its own best, ckpt_good kept and named
truthfully), the runaway-loss guard, non-finite weights, and 'nothing is learning' said once."""
import json
import os

import pytest
import torch

from conftest import RUN, defaults, one_line_error, read_log, run_train, tiny_cfg

import metrics
import train


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


def test_the_collapse_message_names_the_good_checkpoint():
    msg = metrics.collapse_message("out/x/ckpt", 7, {"iter": 5, "acc": {"toy/add": 0.5}}, "loss is nan")
    assert msg == ("training stopped after 7 iterations: loss is nan. The last checkpoint that passed the collapse guard: "
                   "out/x/ckpt_good (iteration 5, eval toy/add 0.500)")
    assert metrics.collapse_message("out/x/ckpt", 7, {"iter": 0, "acc": {"toy/add": 0.1}}, "e").endswith(
        "out/x/ckpt_good (the initial model, eval toy/add 0.100)")


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


def test_collapse_guard_stops_on_nan_and_keeps_a_loadable_checkpoint(toy_data, tmp_path, monkeypatch):
    """A NaN loss at iteration 3 stops the run with one clear error; the checkpoint written
    after iteration 2 is still a valid HF folder that init_from=resume accepts."""
    cfg = dict(defaults(), algo="sft", dataset="toy/add", n_layer=1, n_head=2, n_embd=32, block_size=128,
               batch_prompts=4, micro_batch_size=8, max_iters=5, save_interval=1, eval_interval=0,
               eval_max_prompts=2, eval_n=2, max_new_tokens=8, out_dir=str(tmp_path), device="cpu",
               tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), data_dir=toy_data)
    real, calls = train.loss_backward, []

    def poisoned(*args, **kwargs):
        metrics = real(*args, **kwargs)
        calls.append(1)
        return dict(metrics, loss=float("nan")) if len(calls) == 3 else metrics

    monkeypatch.setattr(train, "loss_backward", poisoned)
    with pytest.raises(train.UserError, match="after 2 iterations: loss is nan"):
        train.main(cfg)
    with open(tmp_path / "ckpt" / "trainer" / "state.json") as f:
        assert json.load(f)["iter"] == 2
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    monkeypatch.setattr(train, "loss_backward", real)
    train.main(dict(cfg, init_from="resume"))  # and the run continues from it
    assert [r["iter"] for r in read_log(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5]


def test_non_finite_weights_stop_the_run_with_the_guards_message(toy_data, tmp_path):
    """lr=1e30: the step overflows; the run stops before sampling from inf weights."""
    proc = run_train(*RUN, "--learning_rate=1e30", "--warmup_iters=0", "--max_iters=3", f"--out_dir={tmp_path / 'run'}",
                     check=False)
    line = one_line_error(proc)
    assert "weights are not finite" in line and "collapse guard" in line


def test_nothing_is_learning_is_said_once_per_episode():
    counts, said = {}, []
    stuck = {"zero_signal_groups": 1.0, "peer_frac": 0.0, "truncated": 0.5}
    for _ in range(metrics.STUCK_ITERS + 3):
        said += metrics.stuck_warnings(stuck, counts, "sdpo")
    assert len(said) == 2 and "raise group_size" in said[0] and "success_threshold" in said[1]
    said = metrics.stuck_warnings({"zero_signal_groups": 0.5, "peer_frac": 0.3, "truncated": 1.0}, counts, "sdpo")
    assert counts["zero_signal_groups"] == 0 and not said  # a good iteration ends the episode
    for _ in range(metrics.STUCK_ITERS):
        said += metrics.stuck_warnings({"truncated": 1.0}, counts, "grpo")
    assert len(said) == 1 and "max_new_tokens" in said[0]
    counts, said = {}, []
    for _ in range(metrics.STUCK_ITERS):  # SDPO at grpo_mix=0: no GRPO term to lack a signal
        said += metrics.stuck_warnings(stuck, counts, "sdpo", grpo_in_loss=False)
    assert len(said) == 1 and "success_threshold" in said[0]


def test_the_console_line_shows_progress_the_distilled_share_and_cut_off_responses():
    record = dict(iter=4, loss=0.5, reward=0.25, acc=0.25, resp_len=21.9, distill_frac=0.31, truncated=0.59, div=0.02,
                  tokens=1000, iter_s=2.0, train_s=1.0)
    line = metrics.console_line("toy/sort", record, 60)
    assert line.startswith("toy/sort iter 4/60 | ") and "distill_frac 0.31" in line and "truncated 0.59" in line
    assert "truncated" not in metrics.console_line("toy/sort", dict(record, truncated=0.0), 60)
    for cut, shown in ((255 / 256, "0.996"), (4095 / 4096, ">0.999"), (1.0, "1 |")):  # 1 only when every one was
        assert f"truncated {shown}" in metrics.console_line("toy/sort", dict(record, truncated=cut), 60)
    sft = {k: record[k] for k in ("iter", "loss", "tokens", "iter_s", "train_s")}  # SFT logs no rollout signals
    assert metrics.console_line("toy/add", sft, 60).startswith("toy/add iter 4/60 | loss 0.5 | tok/s 500")


def test_with_save_interval_a_passing_periodic_eval_of_a_later_stage_is_saved_as_ckpt_good(toy_data, tmp_path, monkeypatch):
    """save_interval counts a stage's iterations, as eval_interval does, so their multiples meet in every
    stage: a second stage after a first of odd length once saved at iteration 4 (no eval) and evaluated at
    5 (no save), and ckpt_good moved only at stage ends."""
    faked_evals(monkeypatch, [0.5] * 10)
    real, saves = train.save_checkpoint, []

    def recording_save(run, cfg, ddp, passed=None):
        saves.append((run.state.iter, passed is not None))
        return real(run, cfg, ddp, passed=passed)
    monkeypatch.setattr(train, "save_checkpoint", recording_save)
    train.main(tiny_cfg(toy_data, tmp_path / "run", stages="toy/add:3,toy/mul:3", eval_interval=2, save_interval=2))
    assert saves == [(0, True), (2, True), (3, True), (5, True), (6, True)], saves
