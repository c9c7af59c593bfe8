"""The step (step 6): loss_backward over micro-batches (fused = naive, split-independent, gradient
checkpointing changes nothing), the optimizer step that moves every weight or refuses a non-finite
gradient, and the learning-rate schedule."""
import pytest
import torch

from conftest import hand_made_batch, math_isfinite, tiny_setup

import models
import train


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


def test_non_finite_gradient_is_refused(toy_data):
    cfg, model, tokenizer = tiny_setup(toy_data, "sft")
    next(model.parameters()).grad = torch.full_like(next(model.parameters()), float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(train.Collapse, match="gradient norm"):
        train.optimizer_step(model, torch.optim.AdamW(model.parameters()), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step taken


def test_lr_schedule_warmup_then_constant_or_cosine():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    constant = [train.set_lr(opt, it, learning_rate=1.0, warmup_iters=4, total_iters=20, decay_lr=False, min_lr=0.1)
                for it in range(20)]
    assert constant[:4] == [0.25, 0.5, 0.75, 1.0] and set(constant[4:]) == {1.0}
    cosine = [train.set_lr(opt, it, learning_rate=1.0, warmup_iters=4, total_iters=20, decay_lr=True, min_lr=0.1)
              for it in range(20)]
    assert cosine[:4] == constant[:4] and cosine[3] == 1.0
    assert all(a > b for a, b in zip(cosine[3:], cosine[4:]))  # strictly decreasing after warmup
    assert cosine[-1] == pytest.approx(0.1) and opt.param_groups[0]["lr"] == cosine[-1]
