"""Inputs: data records checked against their kind, prompts and solutions fitted to the model's context
(train.py, the eval teacher, eval.py, sample.py), tokenizers and model folders, devices and paths, the
torchrun environment. Each bad input is one line naming the file:line or key and the fix."""
import json
import os
import shutil
import socket
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT, TINY, TORCHRUN, cli_cfg, defaults, one_line_error, run_train, run_train_here

import models
import runtime
import train
from configurator import UserError, config_keys


GOOD = {"id": "good", "kind": "math", "messages": [{"role": "user", "content": "1+1"}], "answer": "2",
        "solution": "\\boxed{2}"}


CPU = torch.device("cpu")


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"".join(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode() for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, toy_data):
    """An untrained 128-position toy model saved as an HF folder (model + the toy tokenizer)."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    cfg = dict(defaults(), n_layer=1, n_head=2, n_embd=32, block_size=128,
               tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"))
    model, tokenizer = models.load_model("scratch", CPU, scratch=cfg)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return models.load_model(str(tiny_model), CPU)


def recorder():
    said = []
    return said, types.SimpleNamespace(say=said.append)


def test_a_data_dir_without_the_set_is_one_line_naming_it(tmp_path):
    proc = run_train_here(f"--data_dir={tmp_path}", "--dataset=toy/add")
    assert proc.returncode != 0
    assert one_line_error(proc).endswith(f"and there is no {tmp_path / 'toy' / 'prepare.py'} to make it: check --data_dir "
                                         "and the set's name")


def test_malformed_jsonl_reports_file_and_line(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "train.jsonl").write_text('{"kind": "math", "messages": [{"role": "user", "content": "1+0"}], "answer": "1"}\n{not json\n')
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


TOOL_ANSWER = json.dumps([{"Action": "search", "Action_Input": "{\"q\": \"cats\"}"}])


@pytest.mark.parametrize("record,expect", [
    (dict(GOOD, kind="mcq", answer="lead"), "an mcq answer must be one option letter like 'B', not 'lead'"),
    (dict(GOOD, kind="tool", answer="search(q=cats)"), "a tool answer must be a JSON list of"),
    (dict(GOOD, kind="tool", answer='[{"Action": "search", "Action_Input": "{q: cats}"}]'),
     "call 1's Action_Input is not a JSON object"),
    (dict(GOOD, kind="tool", answer='[{"Action_Input": "{}"}]'), "call 1 has no \"Action\" name"),
    (dict(GOOD, messages=[{"role": "tool", "content": "x"}, {"role": "user", "content": "1+1"}]),
     "message role 'tool' is not one of system, user, assistant"),
    (dict(GOOD, messages=[{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]),
     "the last message must be the user's turn"),
])
def test_a_record_whose_answer_or_roles_cannot_work_is_refused_at_load(tmp_path, record, expect):
    write_jsonl(tmp_path / "bad" / "test.jsonl", [GOOD, dict(GOOD, kind="tool", answer=TOOL_ANSWER), record])
    with pytest.raises(UserError) as e:
        train.load_tasks("bad", "test", str(tmp_path))
    assert "test.jsonl:3: " in str(e.value) and expect in str(e.value) and "\n" not in str(e.value)


def test_the_prepare_scripts_check_answers_against_their_kind_too(capsys):
    from data.common import check_row
    row = {"id": "1", "domain": "x", "kind": "mcq", "answer": "lead", "messages": [{"role": "user", "content": "q"}]}
    with pytest.raises(SystemExit):
        check_row(row, "test line 1")
    assert "test line 1: an mcq answer must be one option letter" in capsys.readouterr().err
    check_row(dict(row, answer="B"), "test line 1")
    from data.checkers import CHECKS
    for change, expect in (({"kind": "maxdig"}, f"kind='maxdig' has no answer checker (one of {', '.join(CHECKS)})"),
                           ({"domain": 3}, "domain must be a string, not int")):  # the field that is wrong, by name
        with pytest.raises(SystemExit):
            check_row(dict(row, answer="B", **change), "test line 1")
        assert f"test line 1: {expect}" in capsys.readouterr().err


def test_data_dir_and_tokenizer_path_are_found_from_another_directory(toy_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data/ is not here: the repository's is used
    assert len(train.load_tasks("toy/add", "test", "data")) == 100
    model, _ = models.load_model("scratch", torch.device("cpu"), scratch=dict(defaults(), n_layer=1, n_embd=32, n_head=2))
    assert model.config.vocab_size == 99
    with pytest.raises(train.UserError) as e:
        train.load_tasks("toy/none", "test", "data")
    assert f"looked for {tmp_path / 'data/toy/none/test.jsonl'} or {os.path.join(ROOT, 'data/toy/none/test.jsonl')}" in str(e.value)


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
    line = one_line_error(run_train_here(*common, f"--out_dir={tmp_path / 'b'}", "--block_size=4"))
    assert "leaves no room for a prompt in the model's context of 4 tokens: lower --max_new_tokens" in line and not (tmp_path / "b").exists()


def test_sft_solutions_longer_than_the_context_are_left_out_and_counted(loaded):
    """A 1 MB solution once asked the allocator for a terabyte: now it is left out without being tokenized."""
    model, tokenizer = loaded
    said, log = recorder()
    sets = {"s": [GOOD, dict(GOOD, id="huge", solution="1" * 1_000_000), dict(GOOD, id="long", solution="1" * 200)]}
    train.fit_prompts(sets, {}, model, tokenizer, dict(defaults(), algo="sft", max_new_tokens=8), log)
    assert [t["id"] for t in sets["s"]] == ["good"]
    assert "s: left out 2 of 3 SFT tasks whose prompt + solution is longer than the model's 128-token context" in said
    with pytest.raises(UserError, match="all 1 SFT tasks are whose prompt \\+ solution is longer .*shorten the solutions"):
        train.fit_prompts({"s": [dict(GOOD, solution="1" * 200)]}, {}, model, tokenizer,
                          dict(defaults(), algo="sft", max_new_tokens=8), log)


def test_the_eval_teachers_prompts_are_fitted_like_the_training_teachers(loaded):
    """An SDPO eval scores the teacher reading each test prompt with its reference solution: a
    solution that makes that prompt too long for max_reprompt_len / the context is left out, counted."""
    model, tokenizer = loaded
    said, log = recorder()
    evals = {"e": [GOOD, dict(GOOD, id="long", solution="\\boxed{" + "1" * 150 + "}"), dict(GOOD, id="none", solution="")]}
    demos = train.fit_prompts({"s": [GOOD]}, evals, model, tokenizer, dict(defaults(), algo="sdpo", max_new_tokens=8), log)
    assert [t["id"] for t in demos["e"]] == ["good"] and len(evals["e"]) == 3  # the student still sees all three
    assert "Correct solution:\n\n\\boxed{2}" in demos["e"][0]["messages"][-1]["content"]
    assert "e (eval teacher prompts): left out 1 of 2 prompts longer than 120 tokens" in said
    demos = train.fit_prompts({"s": [GOOD]}, {"e": evals["e"][1:]}, model, tokenizer,
                              dict(defaults(), algo="sdpo", max_new_tokens=8), log)
    assert demos == {"e": []}  # none fits: no teacher score, and no error
    assert train.fit_prompts({"s": [GOOD]}, evals, model, tokenizer, dict(defaults(), max_new_tokens=8), log) == {}


def eval_cfg(**overrides):
    import eval as ev
    return dict({k: getattr(ev, k) for k in config_keys(vars(ev), ev.__file__)}, **overrides)


def test_eval_py_leaves_out_prompts_that_do_not_fit_the_model(tiny_model, tmp_path, capsys):
    import eval as ev
    data = tmp_path / "data"
    write_jsonl(data / "long" / "test.jsonl", [GOOD, dict(GOOD, id="big", messages=[{"role": "user", "content": "1" * 600}])])
    cfg = eval_cfg(model=str(tiny_model), base_model="none", eval_sets="long", data_dir=str(data), n=1, k="1",
                   max_new_tokens=8, drift_prompts=0, stage_drift=False, spectral_k=-1, device="cpu",
                   out=str(tmp_path / "eval.json"))
    ev.main(cfg)
    assert "long: left out 1 of 2 prompts longer than 120 tokens" in capsys.readouterr().out
    with open(tmp_path / "eval.json") as f:
        assert json.load(f)["accuracy"]["long"]["n_prompts"] == 1
    with pytest.raises(UserError, match="max_new_tokens=128 leaves no room for a prompt in the model's context of 128 tokens"):
        ev.main(dict(cfg, max_new_tokens=128, out=str(tmp_path / "other.json")))
    assert not (tmp_path / "other.json").exists()


def sample_main(*args):
    import sample
    from configurator import configure
    return sample.main(configure(dict(vars(sample)), list(args), sample.__file__))


def test_sample_py_leaves_out_prompts_that_do_not_fit_the_model(tiny_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+1\n" + "1" * 600 + "\n")
    sample_main(f"--init_from={tiny_model}", f"--prompt_file={prompts}", "--max_new_tokens=4", "--device=cpu")
    out = capsys.readouterr().out
    assert f"{prompts}: left out 1 of 2 prompts longer than 124 tokens" in out and out.count("### ") == 1
    with pytest.raises(UserError, match="prompt: all 1 prompts are longer than 124 tokens: shorten the prompt"):
        sample_main(f"--init_from={tiny_model}", "--prompt=" + "1" * 600, "--max_new_tokens=4", "--device=cpu")


def test_sample_py_by_default_caps_responses_at_half_the_context(tiny_model, capsys):
    """sample.py's default max_new_tokens=0 is half the model's context (64 of this model's 128), so a toy
    checkpoint samples without a flag; a cap that leaves no room for a prompt is one line naming the flag."""
    import sample
    model = models.load_model(str(tiny_model), torch.device("cpu"))[0]
    assert sample.default_response_cap(model) == 64
    sample_main(f"--init_from={tiny_model}", "--prompt=1+1", "--temperature=0", "--device=cpu")
    assert capsys.readouterr().out.startswith("### 1+1\n--> ")
    with pytest.raises(UserError, match="max_new_tokens=128 leaves no room for a prompt in the model's context of 128 "
                                        "tokens: lower --max_new_tokens"):
        sample_main(f"--init_from={tiny_model}", "--prompt=1+1", "--max_new_tokens=128", "--device=cpu")
    with pytest.raises(UserError, match=r"max_prompt_len=100 \+ max_new_tokens=64 exceeds the model's context of 128 "
                                        "tokens: lower --max_prompt_len or --max_new_tokens"):
        models.prompt_budget(model, 64, max_prompt_len=100)


def test_characters_the_toy_tokenizer_cannot_encode_are_refused(loaded):
    """The toy tokenizer knows printable ASCII and newline: anything else would vanish from the prompt."""
    _, tokenizer = loaded
    accent = dict(GOOD, id="accent", messages=[{"role": "user", "content": "caf\u00e9 1+1"}])
    with pytest.raises(UserError) as e:
        models.fit_tasks([GOOD, accent], "s", tokenizer, cap=120)
    assert "s: task accent:" in str(e.value) and "\u00e9" in str(e.value) and "\n" not in str(e.value)
    tick = dict(GOOD, id="tick", solution="\\boxed{2} \u2713")  # an SFT solution is checked too
    assert models.fit_tasks([tick], "s", tokenizer, cap=120) == [tick]
    with pytest.raises(UserError, match="task tick"):
        models.fit_tasks([tick], "s", tokenizer, cap=120, context=128)


def test_characters_a_large_tokenizer_maps_to_unknown_are_a_warning():
    from tokenizers import Regex, Tokenizer, models as token_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, **{chr(32 + i): i + 1 for i in range(300)}}  # 301 tokens, no euro sign
    core = Tokenizer(token_models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[UNK]")
    said = []
    euro = dict(GOOD, id="euro", messages=[{"role": "user", "content": "5\u20ac+1"}])
    assert models.fit_tasks([GOOD, euro], "s", tokenizer, cap=100, say=said.append) == [GOOD, euro]
    assert said == ["warning: s: 1 tasks hold characters the tokenizer cannot encode ('\u20ac'; task euro first): "
                    "the model never sees them"]


def test_a_chat_template_that_raises_is_one_line(loaded):
    _, tokenizer = loaded
    gemma_like = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    gemma_like.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                                "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    system = dict(GOOD, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1"}])
    assert models.fit_tasks([GOOD], "s", gemma_like, cap=100) == [GOOD]
    with pytest.raises(models.ModelError) as e:
        models.fit_tasks([GOOD, system], "s", gemma_like, cap=100)
    assert "System role not supported" in str(e.value) and "[system, user]" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_set_names_its_prepare_py_and_a_misspelt_one_the_sets_there(tmp_path):
    from data import tasks as task_files
    data = tmp_path / "data"
    (data / "fam").mkdir(parents=True)
    (data / "fam" / "prepare.py").write_text("")

    def line(name, data_dir=str(data)):
        with pytest.raises(UserError) as e:
            task_files.load(name, "train", data_dir)
        assert "\n" not in str(e.value)
        return str(e.value)
    assert line("fam/add").endswith(f"run `python {data / 'fam' / 'prepare.py'}` first")  # nothing prepared yet
    for name in ("add", "mul"):
        write_jsonl(data / "fam" / name / "train.jsonl", [GOOD])
    assert line("fam/mull").endswith(f"{data / 'fam'} has no set 'mull'; it has add, mul")
    assert line("famm").endswith(f"{data} has no set 'famm'; it has fam")
    assert line("fam").endswith("fam is a folder of sets, not a set: name one of fam/add, fam/mul")  # not 'run prepare'
    assert line("fam/add", str(tmp_path / "elsewhere")).endswith(
        f"and there is no {tmp_path / 'elsewhere' / 'fam' / 'prepare.py'} to make it: check --data_dir and the set's name")


def test_a_mistyped_folder_that_reads_as_a_hub_id_says_there_is_no_such_folder(toy_data, tmp_path):
    line = one_line_error(run_train_here("config/grpo_toy.py", "--init_from=no_such_dir/no_such_base", f"--out_dir={tmp_path}"))
    assert "cannot load model 'no_such_dir/no_such_base': no such folder here, and from the hub: " in line


def test_a_mistyped_path_under_a_folder_that_exists_is_no_hub_id(tmp_path, monkeypatch):
    """out/typo has one slash, like Qwen/Qwen3-4B, but out/ is a folder here: a path, refused at once (asking
    the hub took ~50 s of retries, and its message was about the network)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"^model out/typo not found: no such folder \(out/ is a folder here, so "
                                        r"out/typo reads as a path, not a hub id; "):
        models.load_model("out/typo", CPU)


def test_an_out_dir_that_is_the_model_folder_or_inside_it_is_refused(toy_data, tmp_path):
    """A run written into its init_from folder (another run's checkpoint, which that run's next save
    replaces whole) would be lost, and would mix its files into a model folder."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    for out, where in ((base, "is init_from"), (base / "run", "is inside init_from")):
        with pytest.raises(UserError, match=f"out_dir={out} {where}="):
            train.main(cli_cfg(f"--out_dir={out}", f"--init_from={base}"))
    assert sorted(os.listdir(base)) == ["config.json"]


def test_missing_model_folder_is_one_clear_error():
    with pytest.raises(train.UserError, match="not found"):
        models.load_model("out/no_such_run/ckpt", None, scratch=defaults())


def test_a_checkpoint_folder_without_its_tokenizer_files_is_refused(tiny_model, tmp_path):
    """transformers would build a 1-token tokenizer from such a folder without a word."""
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, folder / name)
    with pytest.raises(models.ModelError, match="has no tokenizer files"):
        models.load_model(str(folder), CPU)


def test_a_weights_only_folder_still_serves_where_no_tokenizer_is_needed(tiny_model, tmp_path):
    """teacher_init reads only the weights: a folder without tokenizer files is fine there."""
    folder = tmp_path / "weights_only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, folder / name)
    model, tokenizer = models.load_model(str(folder), CPU, with_tokenizer=False)
    assert tokenizer is None and models.context_length(model) == 128


@pytest.mark.parametrize("content,expect", [
    (b'{"kind": "poetry", "messages": [{"role": "user", "content": "x"}], "answer": "1"}\n',
     "prompts.jsonl:1: kind='poetry' has no answer checker"),
    (b'{"kind": "math", "messages": [{"role": "critic", "content": "x"}], "answer": "1"}\n',
     "prompts.jsonl:1: message role 'critic'"),
    (b'{"kind": "mcq", "messages": [{"role": "user", "content": "x"}], "answer": "lead"}\n', "an mcq answer must be"),
    (b"\xff\xfe not text\n", "prompts.jsonl:1: not UTF-8 text"),
    ("txt", "prompts.txt:2: not UTF-8 text"),
    ("dir", "is a directory, not a file"),
])
def test_sample_py_checks_records_and_files_as_train_py_does(tmp_path, content, expect):
    if content == "dir":
        path = tmp_path / "prompts.jsonl"
        path.mkdir()
    elif content == "txt":
        path = tmp_path / "prompts.txt"
        path.write_bytes(b"1+1\n\xe9t\xe9\n")
    else:
        path = tmp_path / "prompts.jsonl"
        path.write_bytes(content)
    with pytest.raises(UserError) as e:  # before any model is loaded: no/model is never looked up
        sample_main("--init_from=no/model", f"--prompt_file={path}")
    assert expect in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args,expect", [
    (["--max_new_tokens=-1"], "max_new_tokens=-1 must be >= 1 (or 0: half the model's context)"),
    (["--num_samples=0"], "num_samples=0 must be >= 1"),
    (["--prompt_file=EMPTY"], "holds no prompts"),
])
def test_sample_py_bad_input_is_one_line(toy_data, tmp_path, args, expect):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    args = [a.replace("EMPTY", str(empty)) for a in args]
    if args == ["--max_new_tokens=-1"]:  # once through the command line: one line, exit 1
        proc = subprocess.run([sys.executable, "sample.py", "--init_from=no/model", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert expect in one_line_error(proc)
        return
    import sample
    from configurator import configure
    with pytest.raises(train.UserError, match=expect):
        sample.main(configure(dict(vars(sample)), ["--init_from=no/model", *args], sample.__file__))


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
        assert expect in one_line_error(run_train_here("config/grpo_toy.py", *TINY, "--init_from=scratch", *args))
        return
    with pytest.raises(train.UserError, match=expect.replace("(", r"\(")) as e:
        train.main(cli_cfg(*args))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("env,expect", [
    ({"RANK": "1"}, "RANK=1 with WORLD_SIZE=1 (unset: 1): a rank must be in [0, WORLD_SIZE)"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "first"}, "RANK='first' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT, LOCAL_RANK are not"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999", "LOCAL_RANK": "0"},
     "MASTER_PORT=99999 is not a port number"),
    ({"WORLD_SIZE": "0"}, "RANK=0 with WORLD_SIZE=0"),
])
def test_a_launch_that_is_not_torchruns_is_one_line(monkeypatch, env, expect):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError) as e:
        runtime.Dist("cpu")
    assert expect in str(e.value) and "torchrun" in str(e.value)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_that_never_turn_up_stop_the_run_in_seconds_not_half_an_hour(toy_data):
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "NANOSDPO_RENDEZVOUS_TIMEOUT": "2"}
    line = one_line_error(run_train("config/toy_base.py", *TINY, "--device=cpu", "--out_dir=out/never_written", check=False,
                                    env=env))
    assert "rank 0 of 2 could not meet the others" in line and "within 2 s" in line
    assert not os.path.exists(os.path.join(ROOT, "out", "never_written"))
    assert "RANK=1 with WORLD_SIZE=1" in one_line_error(run_train_here("--device=cpu", env={"RANK": "1"}))


@pytest.mark.ranks
def test_ranks_reading_different_data_stop_in_one_line(toy_data, tmp_path):
    for rank in (0, 1):
        rows = [dict(GOOD, id=str(i), answer=str(2 + (rank if i == 3 else 0))) for i in range(4)]  # one answer differs
        write_jsonl(tmp_path / f"data{rank}" / "d" / "train.jsonl", rows)
        write_jsonl(tmp_path / f"data{rank}" / "d" / "test.jsonl", rows[:2])
    per_rank = tmp_path / "per_rank.py"
    per_rank.write_text(f"import os\ndata_dir = {str(tmp_path)!r} + '/data' + os.environ.get('RANK', '0')\n")
    proc = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "config/toy_base.py", *TINY,
                           "--stages=", "--eval_sets=", "--dataset=d", str(per_rank), "--max_iters=1", "--device=cpu",
                           f"--tokenizer_path={os.path.join(toy_data, 'toy', 'tokenizer')}", f"--out_dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "error: the task files under data_dir=" in proc.stderr and "differ between ranks (rank 0 and rank 1)" in proc.stderr
    assert not (tmp_path / "run").exists()
