"""configurator.py and the config checks: bad input is one clear line and a non-zero exit."""
import os
import subprocess
import sys

from conftest import ROOT, defaults, run_train

import pytest
import torch

import train


def test_help_lists_every_knob_with_a_description():
    out = run_train("--help").stdout
    for key in ("density", "alpha", "distill", "topk", "tail", "teacher", "teacher_rate", "is_clip", "grpo_mix",
                "success_threshold", "dont_reprompt_on_self_success", "remove_thinking", "use_feedback",
                "feedback_only_without_solution", "reprompt_template", "max_reprompt_len", "teacher_init",
                "teacher_init_alpha", "fused_loss", "loss_chunk", "stages", "eval_sets", "teacher_stage_reset",
                "reset_optimizer", "kl_coef", "clip_low", "clip_high", "loss_agg", "norm_adv_std", "init_from"):
        line = next((l for l in out.splitlines() if l.strip().startswith(f"--{key} ")), None)
        assert line is not None, f"--help does not list {key}"
        assert len(line.split("=", 1)[1].split(None, 1)) == 2, f"{key} has no description: {line!r}"
    assert len(defaults()) >= 60


def configure_error(*argv):
    """The one-line message configure() exits with for these arguments."""
    from configurator import configure
    with pytest.raises(SystemExit) as e:
        configure(dict(vars(train)), list(argv), train.__file__)
    return str(e.value)


def test_unknown_key_names_it():
    proc = run_train("--densty=0.5", check=False)  # once through the real command line
    assert proc.returncode != 0
    assert "densty" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "densty" in configure_error("--densty=0.5") and "density" in configure_error("--densty=0.5")


def test_type_mismatch_names_the_key():
    for arg, key in (("--max_iters=abc", "max_iters"), ("--density=high", "density"), ("--tail=1", "tail"),
                     ("--max_iters=1.5", "max_iters"), ("--out_dir", "out_dir")):
        assert key in configure_error(arg), arg


def test_int_accepted_for_float_and_words_are_strings():
    from configurator import configure
    scope = {"lr": 0.1, "name": "x", "flag": False}
    src = os.path.join(ROOT, "tests", "_cfg_src.py")
    with open(src, "w") as f:
        f.write("lr = 0.1  # learning rate\nname = 'x'  # a name\nflag = False  # a flag\n")
    try:
        cfg = configure(scope, ["--lr=1", "--name=out/run1", "--flag=True"], src)
    finally:
        os.remove(src)
    assert cfg == {"lr": 1.0, "name": "out/run1", "flag": True} and type(cfg["lr"]) is float


def test_config_file_with_unknown_key_or_wrong_type(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("densiti = 0.5\n")
    assert "densiti" in configure_error(str(bad))
    bad.write_text("density = 'half'\n")
    assert "density" in configure_error(str(bad))
    assert "not found" in configure_error(str(tmp_path / "missing.py"))


def test_out_of_range_values_are_refused():
    for key, value in (("density", 0.0), ("density", 1.5), ("alpha", -0.1), ("algo", "ppo"), ("teacher", "moving"),
                       ("group_size", 1), ("stages", "toy/add"), ("temperature", 0.0), ("topk", 0),
                       ("min_lr", 1.0), ("gen_batch_size", -8), ("warmup_iters", -1), ("clip_low", -0.2)):
        cfg = dict(defaults(), **{key: value})
        with pytest.raises(train.UserError, match=key):
            train.check_config(cfg)
    train.check_config(defaults())  # the defaults themselves are valid


@pytest.mark.parametrize("path", sorted(f"config/{f}" for f in os.listdir(os.path.join(ROOT, "config"))))
def test_every_shipped_config_file_is_valid(path):
    """Known keys with the defaults' types, values in range (the full-scale configs included)."""
    from configurator import configure
    cfg = configure(dict(vars(train)), [os.path.join(ROOT, path)], train.__file__)
    train.check_config(cfg)


def test_lr_schedule_warmup_then_constant_or_cosine():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    constant = [train.set_lr(opt, it, 1.0, 4, 20, False, 0.1) for it in range(20)]
    assert constant[:4] == [0.25, 0.5, 0.75, 1.0] and set(constant[4:]) == {1.0}
    cosine = [train.set_lr(opt, it, 1.0, 4, 20, True, 0.1) for it in range(20)]
    assert cosine[:4] == constant[:4] and cosine[3] == 1.0
    assert all(a > b for a, b in zip(cosine[3:], cosine[4:]))  # strictly decreasing after warmup
    assert cosine[-1] == pytest.approx(0.1) and opt.param_groups[0]["lr"] == cosine[-1]


def test_missing_data_names_the_prepare_command(tmp_path):
    proc = run_train(f"--data_dir={tmp_path}", "--dataset=toy/add", check=False)
    assert proc.returncode != 0
    assert "python " in proc.stderr and os.path.join("toy", "prepare.py") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_jsonl_reports_file_and_line(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "train.jsonl").write_text('{"kind": "math", "messages": [], "answer": "1"}\n{not json\n')
    try:
        train.load_tasks("bad", "train", str(tmp_path))
    except train.UserError as e:
        assert f"{d / 'train.jsonl'}:2:" in str(e)
    else:
        raise AssertionError("malformed JSONL was accepted")
    (d / "train.jsonl").write_text('{"kind": "math", "answer": "1"}\n')
    try:
        train.load_tasks("bad", "train", str(tmp_path))
    except train.UserError as e:
        assert ":1:" in str(e) and "messages" in str(e)
    else:
        raise AssertionError("a line without messages was accepted")


def test_resume_from_something_that_is_not_a_checkpoint(tmp_path, toy_data):
    (tmp_path / "ckpt").mkdir()
    proc = run_train(f"--out_dir={tmp_path}", "--init_from=resume", check=False)
    assert proc.returncode != 0 and "ckpt" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_missing_model_folder_is_one_clear_error():
    with pytest.raises(train.UserError, match="not found"):
        train.load_model("out/no_such_run/ckpt", defaults(), None, None)
