"""The step and the loop end to end on a tiny model: a step moves every weight, the normalisers and the
overlong filter weight the tokens as documented, runs finish, resume is exact."""
import json
import os

import pytest
import torch

from conftest import TINY, defaults, read_log, run_train

import models
import train


def tiny_setup(toy_data, algo, **overrides):
    cfg = dict(defaults(), algo=algo, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), n_layer=1, n_head=2,
               n_embd=32, block_size=128, micro_batch_size=3, topk=10, loss_chunk=7)
    cfg.update(overrides)
    model, tokenizer = models.load_model("scratch", torch.device("cpu"), scratch=cfg)
    return cfg, model, tokenizer


def hand_made_batch(tokenizer, with_teacher):
    """Two groups' worth of responses with non-zero advantages and (optionally) teacher prompts."""
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


@pytest.mark.parametrize("algo,teacher", [("grpo", "ema"), ("sdpo", "live"), ("sft", "ema")])
def test_one_step_changes_every_trainable_parameter(toy_data, algo, teacher):
    cfg, model, tokenizer = tiny_setup(toy_data, algo, teacher=teacher, grpo_mix=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = hand_made_batch(tokenizer, with_teacher=algo == "sdpo")
    m = train.loss_backward(model, batch, cfg, torch.device("cpu"))
    assert math_isfinite(m["loss"]) and m["loss"] != 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train.optimizer_step(model, opt, 1.0)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, f"{algo}: a step left {unchanged} unchanged"


def math_isfinite(x):
    return x == x and abs(x) != float("inf")


def test_all_masked_sdpo_batch_gives_zero_loss_without_nan(toy_data):
    """No response has a peer: zero loss, a graph, finite zero gradients."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live")
    batch = hand_made_batch(tokenizer, with_teacher=False)
    batch.pg_weight = [torch.zeros_like(w) for w in batch.pg_weight]
    batch.distill_weight[0] = torch.zeros(0)  # edge case: nothing at all to learn from
    m = train.loss_backward(model, batch, cfg, torch.device("cpu"))
    assert m["loss"] == 0 and m["distill_tokens"] == 0
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("algo", ["grpo", "sdpo"])
def test_fused_and_naive_loss_agree_inside_train(toy_data, algo):
    cfg, model, tokenizer = tiny_setup(toy_data, algo, teacher="live", kl_coef=0.1 if algo == "grpo" else 0.0,
                                       temperature=0.8)
    batch = hand_made_batch(tokenizer, with_teacher=algo == "sdpo")
    initial = models.frozen_copy(model)
    grads = []
    for fused in (True, False):
        model.zero_grad()
        m = train.loss_backward(model, batch, dict(cfg, fused_loss=fused), torch.device("cpu"), initial_model=initial)
        grads.append((m["loss"], [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-4, abs=1e-6)  # fp32 sums in another order
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_tiny_end_to_end_sft_then_grpo_then_sdpo(toy_data, tmp_path):
    base = tmp_path / "base"
    # the toy base's two stages (everything, then the teacher-context copies), 2 + 1 iterations
    run_train("config/toy_base.py", *TINY, f"--out_dir={base}", "--stages=toy/add+toy/sort+toy/context:2,toy/context:1",
              "--device=cpu")
    log = read_log(base)
    assert [r["iter"] for r in log if "loss" in r] == [1, 2, 3]
    assert os.path.exists(base / "ckpt" / "model.safetensors") and os.path.exists(base / "accuracy_matrix.json")
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(base / "ckpt")  # a plain HF folder
    for cfgfile, extra in (("config/grpo_toy.py", []), ("config/sdpo_toy.py", ["--success_threshold=0.0"])):
        out = tmp_path / cfgfile.split("/")[1][:-3]
        proc = run_train(cfgfile, *TINY, *extra, f"--init_from={base}/ckpt", f"--out_dir={out}", "--max_iters=2")
        rows = [r for r in read_log(out) if "loss" in r]
        assert len(rows) == 2 and all(math_isfinite(r["loss"]) for r in rows), proc.stdout
        assert "eval @ iter 0" in proc.stdout and "eval @ iter 2" in proc.stdout
    sdpo = [r for r in read_log(tmp_path / "sdpo_toy") if "loss" in r]
    assert all(r["peer_frac"] == 1.0 and r["distill_frac"] == 1.0 and r["div"] >= 0 for r in sdpo)


def test_memory_knobs_run_end_to_end(toy_data, tmp_path):
    """gen_batch_size (one group per generate call here) and grad_checkpointing through main:
    rollouts, the live teacher, the student backward and the evals all run."""
    out = tmp_path / "knobs"
    run_train("config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--teacher=live",
              "--gen_batch_size=4", "--grad_checkpointing=True", f"--out_dir={out}", "--max_iters=2", "--device=cpu")
    log = read_log(out)
    steps = [r for r in log if "loss" in r]
    assert [r["iter"] for r in steps] == [1, 2] and all(math_isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)
    assert steps[0]["tokens"] > 0 and steps[0]["peer_frac"] == 1.0  # every response had a peer: the teacher ran


def test_a_fresh_run_into_an_earlier_run_refuses_unless_told_to_overwrite(toy_data, tmp_path):
    """Rerunning into the same out_dir must neither destroy the earlier run by default nor leave its
    stage snapshots and eval reports behind when told to replace it (eval.py would read them as
    this run's); other files always stay."""
    out = tmp_path / "run"
    (out / "stage7_toy_mul").mkdir(parents=True)
    (out / "log.jsonl").write_text(json.dumps({"iter": 999, "loss": 1.0}) + "\n")
    (out / "eval.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    args = ("config/grpo_toy.py", *TINY, "--init_from=scratch", f"--out_dir={out}", "--max_iters=2", "--device=cpu")
    proc = run_train(*args, check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert "--init_from=resume" in proc.stderr and "--overwrite=True" in proc.stderr
    assert (out / "log.jsonl").read_text().startswith('{"iter": 999') and (out / "stage7_toy_mul").exists()
    proc = run_train(*args, "--overwrite=True")
    assert "removed the earlier run's" in proc.stdout
    assert [r["iter"] for r in read_log(out) if "loss" in r] == [1, 2]
    assert not (out / "stage7_toy_mul").exists() and not (out / "eval.json").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "ckpt" / "model.safetensors").exists()


def test_resume_continues_exactly(toy_data, tmp_path):
    """3 iterations, checkpoint, 3 more == 6 uninterrupted (SDPO+EMA: model, optimizer, teacher, RNG).

    One CPU thread: multi-threaded reductions may sum in another order from run to run, and at
    the first steps the teacher-student divergence of a random model is at float-noise level."""
    common = ["config/sdpo_toy.py", *TINY, "--dataset=toy/add", "--init_from=scratch", "--success_threshold=0.0", "--teacher=ema",
              "--density=0.5", "--learning_rate=1e-2", "--device=cpu"]
    one_thread = {"OMP_NUM_THREADS": "1"}
    run_train(*common, f"--out_dir={tmp_path / 'full'}", "--max_iters=6", env=one_thread)
    run_train(*common, f"--out_dir={tmp_path / 'split'}", "--max_iters=6", "--save_interval=3",
              "--stages=toy/add:3", env=one_thread)  # stop after 3 (a one-stage run of 3 iterations) ...
    run_train(*common, f"--out_dir={tmp_path / 'split'}", "--max_iters=6", "--init_from=resume",
              "--stages=toy/add:3,toy/add:3", env=one_thread)  # ... then continue into a second stage of 3
    full = [r for r in read_log(tmp_path / "full") if "loss" in r]
    split = [r for r in read_log(tmp_path / "split") if "loss" in r]
    assert [r["iter"] for r in split] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, split):
        for key in ("loss", "reward", "resp_len", "div", "distill_frac", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["iter"], key, a[key], b[key])


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


def test_non_finite_gradient_is_refused(toy_data):
    cfg, model, tokenizer = tiny_setup(toy_data, "sft")
    next(model.parameters()).grad = torch.full_like(next(model.parameters()), float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(train.Collapse, match="gradient norm"):
        train.optimizer_step(model, torch.optim.AdamW(model.parameters()), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step taken


def test_sft_normalises_by_every_ranks_tokens_and_reports_its_own(toy_data):
    """With several ranks the SFT weights divide by the whole step's tokens (global_sum), while the
    metric is this rank's count: metrics.iteration_record adds the ranks' counts itself."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sft")
    tasks = train.load_tasks("toy/add", "train", toy_data)[:3]
    two_ranks = lambda xs: [2 * x for x in xs]  # noqa: E731  (two ranks with the same tokens)
    batch, metrics = train.build_batch(tasks, model, tokenizer, cfg, None, torch.device("cpu"), global_sum=two_ranks)
    n = sum(len(r) for r in batch.response_ids)
    assert metrics["tokens"] == n
    assert all(torch.allclose(w, torch.full_like(w, 1.0 / (2 * n))) for w in batch.pg_weight)
    record = {}
    train.metrics.iteration_record(record, metrics, dict.fromkeys(("loss", "reference_s", "teacher_s", "student_s") + train.metrics.TOKEN_SUMS, 0.0),
                                   algo="sft", distill=cfg["distill"], world=2, global_sum=two_ranks, ratio_max=0.0)
    assert record["tokens"] == 2 * n


def test_teacher_reads_the_same_token_positions_as_the_student(toy_data):
    """A live teacher given the student's own prompt is the student: divergence exactly ~0 on
    every token, which only holds if both score the same response ids at the same positions."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live", distill="full")
    batch = hand_made_batch(tokenizer, with_teacher=True)
    batch.teacher_prompt_ids = list(batch.prompt_ids)
    m = train.loss_backward(model, batch, cfg, torch.device("cpu"))
    assert m["distill_tokens"] == sum(len(r) for r in batch.response_ids)
    assert abs(m["div_sum"]) < 1e-5 and abs(m["logratio_ok_sum"] + m["logratio_failed_sum"]) < 1e-4


def test_micro_batch_split_does_not_change_the_step(toy_data):
    """Token-mean over the whole step: 1 sequence per micro-batch gives the gradient of 8."""
    grads = []
    for mbs in (1, 8):
        cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live", grpo_mix=0.5, micro_batch_size=mbs)
        train.loss_backward(model, hand_made_batch(tokenizer, with_teacher=True), cfg, torch.device("cpu"))
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_grad_checkpointing_changes_no_gradient(toy_data):
    """grad_checkpointing recomputes the blocks in the backward: same loss and gradients; the live
    teacher's no-grad forward (same module, training mode) still uses its KV cache."""
    results = []
    for ckpt in (False, True):
        cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live", grpo_mix=0.5)
        if ckpt:
            models.enable_grad_checkpointing(model)
        model.train()
        m = train.loss_backward(model, hand_made_batch(tokenizer, with_teacher=True), cfg, torch.device("cpu"))
        results.append((m["loss"], m["div_sum"], [p.grad for p in model.parameters()]))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5) and results[1][1] == pytest.approx(results[0][1], rel=1e-5)
    for a, b in zip(results[0][2], results[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_two_normalisations_match_hand_computations():
    """3 responses of lengths 2, 3, 4; the first has no teacher, the second keeps 2 of its 3 tokens."""
    masks = [torch.tensor([False, False]), torch.tensor([True, False, True]), torch.tensor([True] * 4)]
    token = train.distill_weights(masks, "token-mean", 0.5)
    for w, want in zip(token, [[0, 0], [0.5 / 6, 0, 0.5 / 6], [0.5 / 6] * 4]):  # 6 distilled tokens
        assert w.tolist() == pytest.approx(want)
    seq = train.distill_weights(masks, "seq-mean", 1.0)
    for w, want in zip(seq, [[0, 0], [1 / 6, 0, 1 / 6], [1 / 12] * 4]):  # mean per response, / 3 responses
        assert w.tolist() == pytest.approx(want)
    # a loss of D per token: token-mean gives the mean over distilled tokens, seq-mean the mean of the
    # responses' means, a response without a teacher counting as 0
    d = [torch.tensor([9.0, 9.0]), torch.tensor([1.0, 5.0, 3.0]), torch.tensor([2.0, 2.0, 2.0, 6.0])]
    assert sum((w * x).sum() for w, x in zip(token, d)).item() == pytest.approx(0.5 * (1 + 3 + 12) / 6)
    assert sum((w * x).sum() for w, x in zip(seq, d)).item() == pytest.approx((0 + 2 + 3) / 3)
    # over ranks: the counts are global
    assert train.distill_weights(masks, "seq-mean", 1.0, global_sum=lambda xs: [x * 2 for x in xs])[2][0] == pytest.approx(1 / 24)


def test_overlong_filter_leaves_truncated_responses_out_of_the_loss(toy_data):
    """A scratch model never stops within 3 tokens: every response is truncated."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", success_threshold=0.0, group_size=4, max_new_tokens=3,
                                       grpo_mix=0.5, kl_coef=0.1)
    tasks = train.load_tasks("toy/add", "test", toy_data)[:2]
    for overlong in (False, True):
        batch, _ = train.build_batch(tasks, model, tokenizer, dict(cfg, overlong_filter=overlong),
                                     torch.Generator().manual_seed(0), torch.device("cpu"))
        assert all(batch.truncated)
        in_loss = sum(int(w.any()) for w in batch.pg_weight + batch.distill_weight)
        assert (in_loss == 0) == overlong
