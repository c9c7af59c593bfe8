"""SDPO as the references define it (lasgroup/SDPO, TRL's experimental SDPO, SDPO-CL): knobs that
would silently do nothing there are refused here in one line. (The normalisations are in
test_train.py, teacher_init and token selection in test_teacher.py.)"""
import pytest

from conftest import TINY, defaults, run_train

import train


@pytest.mark.parametrize("args,expect", [
    (["--algo=sdpo", "--kl_coef=0.1"], "kl_coef acts through the GRPO term"),
    (["--algo=sdpo", "--distill=token", "--alpha=0.5"], "distill=token estimates the reverse KL (alpha=1)"),
    (["--algo=sdpo", "--teacher=live", "--teacher_init=some/model"], "teacher_init sets the starting weights"),
    (["--algo=grpo", "--teacher_init=some/model"], "teacher_init sets the starting weights"),
])
def test_knobs_that_would_do_nothing_are_refused_in_one_line(args, expect):
    if args[1] == "--kl_coef=0.1":  # once through the command line: one line, exit 1
        proc = run_train("config/sdpo_toy.py", *TINY, "--init_from=scratch", *args, check=False)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert expect in proc.stderr
    from configurator import configure
    with pytest.raises(train.UserError, match=expect.replace("(", r"\(").replace(")", r"\)")) as e:
        train.check_config(configure(dict(vars(train)), ["config/sdpo_toy.py", *args], train.__file__))
    assert "\n" not in str(e.value)
    train.check_config(dict(defaults(), algo="sdpo", kl_coef=0.1, grpo_mix=0.5))  # with a GRPO term, KL acts
