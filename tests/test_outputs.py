"""What a run leaves for its users: ckpt/ is a clean HF model folder (vLLM / lm-eval load it as it
is), in save_dtype, with the trainer state beside it; 'nothing is learning' is said out loud; the
optional math-verify checker. (DAPO's overlong filter, a step's weights, is in test_train.py.)"""
import contextlib
import json
import os

import pytest
import torch
from safetensors import safe_open

from conftest import defaults

import metrics
import runtime
import models
import train


def sft_cfg(toy_data, out, **overrides):
    return dict(defaults(), algo="sft", dataset="toy/add", n_layer=1, n_head=2, n_embd=32, block_size=128,
                batch_prompts=4, micro_batch_size=8, max_iters=2, eval_interval=0, eval_max_prompts=2, eval_n=2,
                max_new_tokens=8, warmup_iters=1, learning_rate=1e-2, out_dir=str(out), device="cpu",
                data_dir=toy_data, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), **overrides)


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])
def test_ckpt_is_a_clean_hf_folder_in_save_dtype_and_resumes_exactly(toy_data, tmp_path, save_dtype):
    cfg = sft_cfg(toy_data, tmp_path / "run", save_dtype=save_dtype)
    train.main(cfg)
    ckpt = tmp_path / "run" / "ckpt"
    top = {p.name for p in ckpt.iterdir()}
    assert "trainer" in top and {"config.json", "generation_config.json", "model.safetensors"} <= top
    assert all(not name.endswith(".safetensors") or name == "model.safetensors" for name in top)  # no teacher, no optimizer
    # exactly the keys transformers writes for this model, in save_dtype
    reference, _ = models.load_model("scratch", torch.device("cpu"), scratch=cfg)
    reference.save_pretrained(tmp_path / "plain")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f, safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert all(f.get_tensor(k).dtype == getattr(torch, save_dtype) for k in f.keys())
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert next(loaded.parameters()).dtype == getattr(torch, save_dtype)
    # resuming starts from the fp32 master weights, not from the (rounded) export
    with contextlib.ExitStack() as stack:
        run = train.setup(dict(cfg, init_from="resume", max_iters=3), runtime.Dist("cpu"), stack)
        with open(ckpt / "trainer" / "state.json") as f:
            assert json.load(f)["iter"] == run.state.iter == 2
        exported = dict(loaded.named_parameters())
        for name, p in run.model.named_parameters():
            assert p.dtype == torch.float32
            if save_dtype == "bfloat16":
                torch.testing.assert_close(p.bfloat16(), exported[name].detach())
        if save_dtype == "bfloat16":
            assert any(not torch.equal(p, exported[n].float()) for n, p in run.model.named_parameters())


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


def test_math_checker_dispatch_and_cross_check():
    assert train.reward("math", "\\boxed{1/2}", "0.5") == (1.0, None)
    pytest.importorskip("math_verify", reason="math-verify is optional (pip install math-verify) and not installed")
    pairs = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{3}", "4", 0.0), ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
             ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}", 1.0), ("\\boxed{12", "12", 0.0), ("no box", "1", 0.0)]
    for response, answer, want in pairs:
        assert train.reward("math", response, answer, math_checker="math_verify")[0] == want, (response, answer)
        assert train.reward("math", response, answer)[0] == want, (response, answer)  # the builtin agrees
