"""Config: configurator.py (config files, --key=value, --help) and train.py's check_config. Every bad
value is one clear line and a non-zero exit, before any work; knobs that would silently do nothing in
the references (lasgroup/SDPO, TRL's experimental SDPO, SDPO-CL) are refused too."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, cli_cfg, defaults, run_train, run_train_here, tiny_cfg

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


def test_the_help_of_every_knob_with_choices_names_exactly_those_choices():
    # the help lines are hand-written comments: a new teacher kind (teacher.KINDS) or any other choice must reach them
    import re
    import configurator
    helps = configurator.config_keys(vars(train), train.__file__)
    for key, choices in train.CHOICES.items():
        named = set(re.findall(r"'([\w.-]+)'", helps[key]))
        assert named == set(choices), f"--{key}'s help names {sorted(named)}, CHOICES has {sorted(choices)}"


def test_help_after_a_config_file_shows_the_values_it_and_the_overrides_give(capsys):
    """`python train.py config/sdpo_toy.py --density=0.5 --help`: each key with the value this run would
    use; the keys changed from the default are marked *, with the default beside them."""
    from configurator import configure
    with pytest.raises(SystemExit) as e:
        configure(dict(vars(train)), ["config/sdpo_toy.py", "--help", "--density=0.5"], train.__file__)
    assert e.value.code == 0
    lines = {l.split("=")[0].strip(): l for l in capsys.readouterr().out.splitlines() if "--" in l[:4]}
    run = configure(dict(vars(train)), ["config/sdpo_toy.py", "--density=0.5"], train.__file__)
    for key, line in lines.items():
        name = key.lstrip("*").strip()[2:]
        assert line.split("=", 1)[1].split()[0] == repr(run[name]).split()[0], line  # the run's value
        assert key.startswith("*") == (run[name] != defaults()[name]), line
        if key.startswith("*"):
            assert line.endswith(f"(default {defaults()[name]!r})"), line
    assert lines["*--density"].split("=", 1)[1].split()[0] == "0.5" and lines["*--algo"].split()[2] == "'sdpo'"
    assert "--overwrite" in lines and "*--out_dir" in lines  # unchanged: no mark; the config's out_dir: marked
    assert len(lines) == len(defaults())


def test_help_into_a_reader_that_stops_early_exits_quietly():
    """`python eval.py --help | head`: the pipe is closed before the help is written; one exit 0, no
    BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "eval.py", "--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the script has imported torch and printed anything
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and "Error" not in err, err[-2000:]


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


def test_int_accepted_for_float_words_are_strings_and_true_false_are_bools():
    from configurator import configure
    scope = {"lr": 0.1, "name": "x", "flag": False}
    src = os.path.join(ROOT, "tests", "_cfg_src.py")
    with open(src, "w") as f:
        f.write("lr = 0.1  # learning rate\nname = 'x'  # a name\nflag = False  # a flag\n")
    try:
        cfg = configure(scope, ["--lr=1", "--name=out/run1", "--flag=True"], src)
        lower = [configure(scope, [f"--flag={word}"], src)["flag"] for word in ("true", "false", "TRUE")]
    finally:
        os.remove(src)
    assert cfg == {"lr": 1.0, "name": "out/run1", "flag": True} and type(cfg["lr"]) is float
    assert lower == [True, False, True]  # a bool as the shell spells it
    assert scope == {"lr": 0.1, "name": "x", "flag": False}  # the script's globals stay its defaults


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
                       ("min_lr", 1.0), ("gen_batch_size", -8), ("warmup_iters", -1), ("clip_low", -0.2),
                       ("beta1", 1.5), ("beta2", 1.0), ("beta2", -0.1)):  # AdamW's own check came after out_dir
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


def config_file_error(tmp_path, text, name="cfg.py"):
    """The one-line message configure() exits with for a config file holding `text`; and its path."""
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    message = configure_error(str(path))
    assert message.startswith("error: ") and len(message.splitlines()) == 1, message
    assert "Traceback" not in message and "<string>" not in message, message
    return message, str(path)


def test_syntax_error_in_a_config_file_names_file_and_line(tmp_path):
    message, path = config_file_error(tmp_path, "density = 0.5\n\nalpha = = 1\n")
    assert message.startswith(f"error: {path}:3: invalid syntax"), message
    message, path = config_file_error(tmp_path, "density = (0.5\n")
    assert message.startswith(f"error: {path}:1: "), message
    message, path = config_file_error(tmp_path, b"density = 0.5\x00\n")  # null bytes: no line to name
    assert path in message


def test_syntax_error_through_the_command_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("density = 0.5\nalpha = = 1\n")
    proc = run_train_here(str(bad))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"error: {bad}:2: invalid syntax"), proc.stderr


def test_exception_in_a_config_file_names_file_line_and_type(tmp_path):
    message, path = config_file_error(tmp_path, "density = 0.5\n\nalpha = 1 / 0\n")
    assert message == f"error: {path}:3: ZeroDivisionError: division by zero"
    message, path = config_file_error(tmp_path, "density = undefined_name\n")
    assert message == f"error: {path}:1: NameError: name 'undefined_name' is not defined"
    # raised inside a function the file defines: the deepest line in the file, the raise itself
    message, path = config_file_error(tmp_path, "def f():\n    raise ValueError('bad\\nvalue')\n\ndensity = f()\n")
    assert message == f"error: {path}:2: ValueError: bad value"
    message, path = config_file_error(tmp_path, "import no_such_module_xyz\n")
    assert message.startswith(f"error: {path}:1: ModuleNotFoundError: ") and "no_such_module_xyz" in message


def test_exception_in_a_config_file_through_the_command_line(tmp_path):
    bad = tmp_path / "raises.py"
    bad.write_text("density = 0.5\nalpha = density / 0\n")
    proc = run_train_here(str(bad))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {bad}:2: ZeroDivisionError: float division by zero", proc.stderr


def test_config_file_may_import_and_define_helpers(tmp_path):
    from configurator import configure
    good = tmp_path / "good.py"
    good.write_text("import math\nfrom os import path\nlearning_rate = 1e-3 * math.sqrt(2)\n"
                    "def half(x):\n    return x / 2\nclass Helper:\n    pass\n_domains = ['toy/add', 'toy/sub']\n"
                    "stages = '+'.join(_domains) + ':10'\nalpha = half(math.pi) / 10\n")
    cfg = configure(dict(vars(train)), [str(good)], train.__file__)
    assert cfg["learning_rate"] == pytest.approx(1e-3 * 2 ** 0.5)
    assert cfg["alpha"] == pytest.approx(3.141592653589793 / 20)
    assert cfg["stages"] == "toy/add+toy/sub:10"
    assert not {"math", "path", "half", "Helper", "_domains"} & set(cfg)


def test_config_file_unknown_plain_name_is_still_refused(tmp_path):
    for text, key in (("import math\ndensiti = 0.5\n", "densiti"), ("from math import pi\n", "pi"),
                      ("name = 'x'\n", "name"), ("flag = True\n", "flag")):
        message, path = config_file_error(tmp_path, text)
        assert f"unknown config key '{key}'" in message and path in message, message
    # a known key is type-checked whatever its value, a module included
    message, _ = config_file_error(tmp_path, "import math as density\n")
    assert "density" in message and "float" in message, message


def test_non_finite_floats_are_refused_on_the_command_line():
    for arg, key in (("--learning_rate=1e400", "learning_rate"), ("--density=nan", "density"),
                     ("--density=inf", "density"), ("--density=-inf", "density"), ("--alpha=+inf", "alpha"),
                     ("--alpha=Infinity", "alpha"), ("--alpha=-infinity", "alpha"), ("--alpha=NaN", "alpha"),
                     ("--density=-1e400", "density"), ("--learning_rate=1" + "0" * 400, "learning_rate")):
        message = configure_error(arg)
        assert len(message.splitlines()) == 1 and f"{key}=" in message and "finite number" in message, (arg, message)


def test_non_finite_float_through_the_command_line():
    proc = run_train_here("--learning_rate=1e400")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "learning_rate" in proc.stderr and "finite number" in proc.stderr


def test_non_finite_floats_in_a_config_file_are_refused(tmp_path):
    for text in ("density = float('nan')\n", "density = 1e400\n", "density = -float('inf')\n", "density = 'nan'\n",
                 "import math\ndensity = math.inf\n", "density = 10**400\n"):  # an int too large for a float
        message, path = config_file_error(tmp_path, text)
        assert path in message and "density=" in message and "finite number" in message, (text, message)


def test_string_and_int_keys_keep_their_words():
    """The finite check is for float keys only: 'nan' is a fine out_dir, and an int key still says int."""
    from configurator import configure
    cfg = configure(dict(vars(train)), ["--out_dir=nan", "--init_from=inf"], train.__file__)
    assert cfg["out_dir"] == "nan" and cfg["init_from"] == "inf"
    assert "should be int" in configure_error("--max_iters=inf")


def test_config_file_that_is_a_directory_or_unreadable(tmp_path, monkeypatch):
    import configurator
    message = configure_error(str(tmp_path))
    assert len(message.splitlines()) == 1 and str(tmp_path) in message and "directory" in message, message
    assert "not found" in configure_error(str(tmp_path / "missing.py"))
    locked = tmp_path / "locked.py"
    locked.write_text("density = 0.5\n")
    real_open = open

    def no_permission(path, *args, **kwargs):  # chmod 000 does not stop root, so refuse the read here
        if str(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(configurator, "open", no_permission, raising=False)
    message = configure_error(str(locked))
    assert message == f"error: config file {locked} cannot be read: Permission denied"
    message, path = config_file_error(tmp_path, b"\xff\xfe density = 1\n")  # not text at all
    assert message.startswith(f"error: {path}:1: "), message


def test_a_config_file_that_exits_or_is_interrupted_is_one_line_and_a_failure(tmp_path):
    """sys.exit(0) in a config file once ended the run with rc 0 having run nothing."""
    message, path = config_file_error(tmp_path, "density = 0.5\nimport sys\nsys.exit(0)\n")
    assert message.startswith(f"error: {path}:3: the config file exits (sys.exit(0))"), message
    message, path = config_file_error(tmp_path, "raise KeyboardInterrupt\n")
    assert message == f"error: {path}:1: KeyboardInterrupt"
    bad = tmp_path / "exits.py"
    bad.write_text("import sys\nsys.exit(0)\n")
    proc = run_train_here(str(bad))
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr


def test_a_typod_key_holding_a_list_is_refused_not_taken_as_a_helper(tmp_path):
    for text, key, hint in (("eval_set = ['toy/add', 'toy/sub']\n", "eval_set", "did you mean eval_sets?"),
                            ("stage = ('toy/add:10',)\n", "stage", "did you mean stages?"),
                            ("datasets = None\n", "datasets", "did you mean dataset?")):
        message, path = config_file_error(tmp_path, text)
        assert f"unknown config key '{key}' ({hint}" in message and f"_{key}" in message, message


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 63, -1])
def test_a_seed_outside_0_to_2_62_is_one_line_in_every_entry_point(seed):
    import eval as ev
    import sample
    with pytest.raises(train.UserError, match=rf"seed={seed} must be an integer in \[0, 2\*\*62\]"):
        train.check_config(dict(defaults(), seed=seed))
    with pytest.raises(train.UserError, match=f"seed={seed}"):
        ev.main({k: getattr(ev, k) for k in ("n", "batch_prompts", "drift_prompts")} | {"seed": seed})
    with pytest.raises(train.UserError, match=f"seed={seed}"):
        sample.main({"seed": seed})
    if seed == 2 ** 64:  # once through the command line
        proc = run_train_here(f"--seed={seed}")
        assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    train.check_config(dict(defaults(), seed=2 ** 62))


@pytest.mark.parametrize("key,template,expect", [
    ("reprompt_template", "{prompt}{solutoin}{feedback}", "unknown field {solutoin}"),
    ("reprompt_template", "{prompt}{solution}{feedback} {", "Single '{' encountered"),
    ("solution_template", "Correct: {}", "a positional field {} needs a name"),
    ("feedback_template", "Feedback: {feedback", "expected '}' before end of string"),
    ("solution_template", "{solution} }", "Single '}' encountered"),
])
def test_every_template_is_tried_at_check_time(key, template, expect):
    """A bad template once failed mid-run, after the lock, at the first teacher prompt."""
    with pytest.raises(train.UserError) as e:
        train.check_config(dict(defaults(), **{key: template}))
    assert str(e.value).startswith(f"{key}=") and expect in str(e.value) and "{{ and }}" in str(e.value), str(e.value)
    train.check_config(dict(defaults(), **{key: template.replace("{", "{{").replace("}", "}}")}))  # escaped: fine


@pytest.mark.parametrize("args,expect", [
    (["--algo=sdpo", "--kl_coef=0.1"], "kl_coef acts through the GRPO term"),
    (["--algo=sdpo", "--distill=token", "--alpha=0.5"], "distill=token estimates the reverse KL (alpha=1)"),
    (["--algo=sdpo", "--teacher=live", "--teacher_init=some/model"], "teacher_init sets the starting weights"),
    (["--algo=grpo", "--teacher_init=some/model"], "teacher_init sets the starting weights"),
    (["--algo=sdpo", "--teacher=live", "--teacher_stage_reset=initial"], "teacher_stage_reset=initial reloads a teacher's own"),
    (["--algo=sdpo", "--teacher=trust_region", "--teacher_stage_reset=student"], "teacher=trust_region has none"),
    (["--algo=grpo", "--teacher_stage_reset=student"], "it needs algo=sdpo with teacher=frozen or ema"),
    (["--algo=sdpo", "--teacher=frozen", "--teacher_stage_reset=initial"], "the frozen teacher is the initial model already"),
])
def test_knobs_that_would_do_nothing_are_refused_in_one_line(args, expect):
    if args[1] == "--kl_coef=0.1":  # once through the command line: one line, exit 1
        proc = run_train_here("config/sdpo_toy.py", *TINY, "--init_from=scratch", *args)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert expect in proc.stderr
    from configurator import configure
    with pytest.raises(train.UserError, match=expect.replace("(", r"\(").replace(")", r"\)")) as e:
        train.check_config(configure(dict(vars(train)), ["config/sdpo_toy.py", *args], train.__file__))
    assert "\n" not in str(e.value)
    train.check_config(dict(defaults(), algo="sdpo", kl_coef=0.1, grpo_mix=0.5))  # with a GRPO term, KL acts
    for teacher, reset, init in (("frozen", "student", ""), ("ema", "initial", ""), ("frozen", "initial", "some/model")):
        train.check_config(dict(defaults(), algo="sdpo", teacher=teacher, teacher_stage_reset=reset, teacher_init=init))


@pytest.mark.parametrize("overrides,expect", [
    (dict(algo="sdpo", teacher="frozen", teacher_rate=0.1), "teacher_rate=0.1 does nothing in this run: it is the rate of teacher=ema"),
    (dict(algo="sdpo", teacher="live", teacher_rate=0.1), "not live"),
    (dict(algo="sdpo", teacher_init_alpha=0.5), "teacher_init_alpha=0.5 does nothing in this run: it weighs teacher_init"),
    (dict(algo="sdpo", density_select="last"), "density_select='last' does nothing in this run: at density=1"),
    (dict(algo="sdpo", distill="full", topk=20), "topk=20 does nothing in this run: distill=full does not use it"),
    (dict(algo="sdpo", topk=5000), "topk=5000 is not below the vocabulary (1000 tokens): distill=topk is distill=full"),
    (dict(min_lr=1e-7), "min_lr=1e-07 does nothing in this run: it is where decay_lr's cosine ends"),
    (dict(lora_alpha=16.0), "lora_alpha=16.0 does nothing in this run: it scales LoRA's adapters, and lora_rank=0"),
    (dict(lora_targets="q_proj"), "lora_targets='q_proj' does nothing in this run"),
    (dict(algo="grpo", density=0.5), "density=0.5 does nothing in this run: it is an SDPO setting (algo=grpo)"),
    (dict(algo="sft", max_reprompt_len=100), "max_reprompt_len=100 does nothing in this run: it is an SDPO setting (algo=sft)"),
])
def test_a_setting_that_does_nothing_in_this_run_gets_a_note(overrides, expect):
    base = defaults()
    notes = train.unused_settings(dict(base, **overrides), base, vocab=1000)
    assert len(notes) == 1 and notes[0].startswith("note: ") and expect in notes[0], notes


@pytest.mark.parametrize("overrides", [
    dict(algo="sdpo", teacher="ema", teacher_rate=0.1), dict(algo="sdpo", teacher="trust_region", teacher_rate=0.1),
    dict(algo="sdpo", teacher_init="some/model", teacher_init_alpha=0.5), dict(algo="sdpo", density=0.5, density_select="last"),
    dict(algo="sdpo", topk=999), dict(decay_lr=True, min_lr=1e-7), dict(lora_rank=8, lora_alpha=16.0),
    dict(algo="sdpo", density=0.5, teacher="frozen"),  # defaults, and settings that act, say nothing
])
def test_settings_that_act_get_no_note(overrides):
    base = defaults()
    assert train.unused_settings(dict(base, **overrides), base, vocab=1000) == []


def test_a_run_says_which_of_its_settings_do_nothing(toy_data, tmp_path, capsys):
    """The notes reach a run's console, before its first iteration."""
    train.main(tiny_cfg(toy_data, tmp_path / "run", algo="grpo", max_iters=1, min_lr=1e-6))
    out = capsys.readouterr().out
    assert "note: min_lr=1e-06 does nothing in this run" in out
    assert "note: topk=10 does nothing in this run: it is an SDPO setting (algo=grpo)" in out  # TINY sets topk


def test_a_patience_of_zero_is_refused_at_the_config_check(tmp_path):
    with pytest.raises(train.UserError, match="^collapse_patience=0 must be positive$"):
        train.main(cli_cfg(f"--out_dir={tmp_path / 'run'}", "--collapse_patience=0"))
    assert not (tmp_path / "run").exists()


def test_dtype_float16_is_refused_in_one_line(tmp_path):
    """fp16 without loss scaling flushes the per-token gradients (~1e-9) to zero in the fused loss."""
    proc = run_train_here("config/grpo_toy.py", "--dtype=float16", f"--out_dir={tmp_path / 'out'}")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "dtype=float16" in proc.stderr and "bfloat16" in proc.stderr and not (tmp_path / "out").exists()
