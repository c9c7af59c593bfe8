"""SDPO as the references define it (lasgroup/SDPO, TRL's experimental SDPO, SDPO-CL): knobs that
would silently do nothing are refused, the two loss normalisations match hand computations, the
teacher_init checkpoint is the teacher, and the token-selection knob beside density."""
import contextlib
import os

import pytest
import torch

from conftest import TINY, defaults, read_log, run_train

import models
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


def test_stray_think_closing_tag_drops_what_precedes_it():
    assert train.strip_thinking("reasoning the template opened</think>\\boxed{3}") == "\\boxed{3}"
    assert train.strip_thinking("<think>a</think>x<think>b</think>y") == "xy"
    assert train.strip_thinking("answer <think>never closed") == "answer"


def test_teacher_init_is_the_teacher(toy_data, tmp_path):
    """teacher_init alone (teacher_init_alpha's default 1) makes the teacher that checkpoint."""
    other, _ = models.load_model("scratch", torch.device("cpu"), scratch=dict(defaults(), seed=7, n_layer=1, n_head=2,
                                                                              n_embd=32, block_size=128))
    other.save_pretrained(tmp_path / "other")
    cfg = dict(defaults(), algo="sdpo", teacher="frozen", teacher_init=str(tmp_path / "other"), n_layer=1, n_head=2,
               n_embd=32, block_size=128, out_dir=str(tmp_path / "run"), device="cpu", dataset="toy/add",
               data_dir=toy_data, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"))
    with contextlib.ExitStack() as stack:
        run = train.setup(cfg, models.Dist("cpu"), stack)
        for a, b in zip(run["teacher_model"].parameters(), other.parameters()):
            torch.testing.assert_close(a, b)
        assert not torch.equal(next(run["model"].parameters()), next(other.parameters()))


def test_density_selection_keeps_the_fraction_and_picks_its_tokens(toy_data):
    n = [10, 7, 1]
    last = train.density_masks(n, 0.3, None, "last")
    assert [m.tolist() for m in last] == [[False] * 7 + [True] * 3, [False] * 5 + [True] * 2, [True]]
    placeholder = train.density_masks(n, 0.3, None, "disagree")
    assert [int(m.sum()) for m in placeholder] == [3, 2, 1]
    # disagree: the same count per response, moved to the largest divergences (a live teacher on another prompt)
    from test_train import hand_made_batch, tiny_setup
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live", density=0.5, density_select="disagree")
    batch = hand_made_batch(tokenizer, with_teacher=True)
    lengths = [len(r) for r in batch.response_ids]
    weights = torch.cat([m.float() / 7 for m in train.density_masks(lengths, 0.5, None, "disagree")])
    tokens = torch.tensor([t for r in batch.response_ids for t in r])
    with torch.no_grad():
        h = models.response_hidden(model, batch.prompt_ids, batch.response_ids, torch.device("cpu"))
        teacher = train.teacher_parts(mode="live", rate=0.0, model=model, teacher_model=None, initial_model=None,
                                      teacher_prompts=batch.teacher_prompt_ids, responses=batch.response_ids,
                                      dev=torch.device("cpu"))
        _, stats = train.naive_token_loss(h, model.get_output_embeddings().weight, tokens, lambda *a: a[0].sum(),
                                          teacher=teacher, alpha=0.5, distill="topk", topk=10, tail=True)
    picked = train.select_by_divergence(h, model.get_output_embeddings().weight, tokens, teacher, weights, lengths=lengths,
                                        cfg=cfg, token_loss=train.naive_token_loss, options={})
    start = 0
    for length in lengths:
        w, div = picked[start:start + length], stats["div"][start:start + length]
        k = int((weights[start:start + length] > 0).sum())
        assert int((w > 0).sum()) == k and set(w.nonzero().squeeze(1).tolist()) == set(div.topk(k).indices.tolist())
        start += length


def test_an_sdpo_run_logs_its_teachers_accuracy_and_the_diagnostics(toy_data, tmp_path):
    out = tmp_path / "run"
    run_train("config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--dataset=toy/add",
              "--distill_agg=seq-mean", "--density=0.5", "--density_select=last", f"--out_dir={out}", "--max_iters=2",
              "--device=cpu")
    log = read_log(out)
    evals = [r for r in log if "eval_tag" in r]
    assert len(evals) == 2 and all("eval/toy/add/teacher_mean@2" in r and "eval/toy/add/mean@2" in r for r in evals)
    steps = [r for r in log if "loss" in r]
    for key in ("ratio_mean", "ratio_max", "clip_frac", "kl_sampler", "entropy", "div", "topk_mass", "sampled_logratio"):
        assert all(key in r for r in steps), key
    assert all(0 < r["topk_mass"] <= 1 and r["entropy"] > 0 and r["ratio_max"] >= r["ratio_mean"] > 0 for r in steps)
    assert (out / "samples.jsonl").exists()
