"""Loss weights (steps 3 and 5): GRPO advantages, which tokens the distillation reaches (density and
density_select: random, last, disagree), the normalisers of both terms over the whole step (token-mean,
seq-mean, over ranks) and DAPO's overlong filter."""
import pytest
import torch

from conftest import hand_made_batch, tiny_setup

import models
import train


def test_an_advantage_is_the_reward_minus_its_group_mean_and_an_all_equal_group_has_none():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = train.group_advantages(r, 4, norm_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]  # all-equal group: no signal
    adv = train.group_advantages(r, 4, norm_std=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert adv[4:].abs().max() == 0


@pytest.mark.parametrize("norm_std", [False, True])
def test_a_group_of_equal_partial_scores_has_exactly_no_advantage(norm_std):
    # partial scores (a code reward's fraction of tests passed) whose float mean is not exact
    r = torch.tensor([0.3] * 8 + [0.7] * 8 + [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    adv = train.group_advantages(r, 8, norm_std=norm_std)
    assert adv[:16].abs().max() == 0  # not 3e-8, nor that ÷ a 1e-8 std
    assert (adv[16:] != 0).all()


def test_the_grpo_term_normalises_by_the_steps_tokens_its_sequences_or_a_constant_length():
    lengths, keep = [2, 4, 3], [True, True, False]
    tm = train.grpo_weights(lengths, keep, "token-mean", 8)
    assert torch.allclose(torch.cat(tm).sum(), torch.tensor(1.0)) and tm[2].sum() == 0
    sm = train.grpo_weights(lengths, keep, "seq-mean-token-mean", 8)
    assert [round(w.sum().item(), 6) for w in sm] == [0.5, 0.5, 0.0]
    dr = train.grpo_weights(lengths, keep, "seq-mean-token-sum-norm", 8)
    assert torch.allclose(dr[1], torch.full((4,), 1 / 16))


def test_a_fractional_reward_at_the_success_threshold_is_a_success_everywhere(toy_data, monkeypatch):
    """7 of 10 tests is 0.7, which float32 rounds to 0.69999998: the rollout kept the rounded rewards, so at
    success_threshold=0.7 the response was no demonstration (nor a success in the diagnostics) while acc and
    the eval's pass@n counted it as one."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", group_size=4, max_new_tokens=6, success_threshold=0.7)
    monkeypatch.setattr(train, "rewards_of", lambda tasks, texts, checker="builtin": [
        (0.7, None) if i % 4 == 0 else (0.0, "wrong") for i in range(len(texts))])
    tasks = train.load_tasks("toy/add", "test", toy_data)[:2]
    batch, metrics = train.build_batch(tasks, model, tokenizer, cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert batch.rewards == [0.7, 0.0, 0.0, 0.0] * 2
    assert metrics["acc"] == 0.25 and metrics["peer_frac"] == 0.75 and metrics["distilled"] > 0


def test_a_random_density_mask_keeps_its_fraction_and_follows_its_seed():
    g = torch.Generator().manual_seed(0)
    masks = train.density_masks([1000] * 20, 0.25, g)
    frac = torch.cat(masks).float().mean().item()
    assert abs(frac - 0.25) < 4 * (0.25 * 0.75 / 20000) ** 0.5  # 4 sigma
    again = train.density_masks([1000] * 20, 0.25, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(masks, again))
    assert all(m.all() for m in train.density_masks([5, 7], 1.0, g))


def test_density_one_distills_every_token_of_every_response_with_a_peer(toy_data):
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", success_threshold=0.0, group_size=4, max_new_tokens=6,
                                       density=1.0)
    tasks = train.load_tasks("toy/add", "test", toy_data)[:2]
    g = torch.Generator().manual_seed(0)
    batch, metrics = train.build_batch(tasks, model, tokenizer, cfg, g, torch.device("cpu"))
    n = sum(len(r) for r in batch.response_ids)
    assert metrics["peer_frac"] == 1.0 and metrics["distill_frac"] == 1.0
    assert all(torch.allclose(w, torch.full_like(w, 1.0 / n)) for w in batch.distill_weight)
    batch, metrics = train.build_batch(tasks, model, tokenizer, dict(cfg, density=0.5), g, torch.device("cpu"))
    kept = sum(int((w > 0).sum()) for w in batch.distill_weight)
    assert 0 < kept < sum(len(r) for r in batch.response_ids)
    assert all(torch.allclose(w[w > 0], torch.tensor(1.0 / kept)) for w in batch.distill_weight if (w > 0).any())


def test_density_selection_keeps_the_fraction_and_picks_its_tokens(toy_data):
    n = [10, 7, 1]
    last = train.density_masks(n, 0.3, None, "last")
    assert [m.tolist() for m in last] == [[False] * 7 + [True] * 3, [False] * 5 + [True] * 2, [True]]
    placeholder = train.density_masks(n, 0.3, None, "disagree")
    assert [int(m.sum()) for m in placeholder] == [3, 2, 1]
    # disagree: the same count per response, moved to the largest divergences (a live teacher on another prompt)
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live", density=0.5, density_select="disagree")
    batch = hand_made_batch(tokenizer, with_teacher=True)
    lengths = [len(r) for r in batch.response_ids]
    weights = torch.cat([m.float() / 7 for m in train.density_masks(lengths, 0.5, None, "disagree")])
    tokens = torch.tensor([t for r in batch.response_ids for t in r])
    with torch.no_grad():
        h = models.response_hidden(model, batch.prompt_ids, batch.response_ids, torch.device("cpu"))
        teacher = train.Teacher("live", 0.0).logits(model, batch.teacher_prompt_ids, batch.response_ids,
                                                    torch.device("cpu"))
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
    record = {}  # a count is the step's total (it was logged as a rank's mean); a rate stays a mean
    train.metrics.iteration_record(record, dict(metrics, reprompt_truncated=3, acc=0.5),
                                   dict.fromkeys(("loss", "reference_s", "teacher_s", "student_s") + train.metrics.TOKEN_SUMS, 0.0),
                                   algo="sft", distill=cfg["distill"], world=2, global_sum=two_ranks, ratio_max=0.0)
    assert record["reprompt_truncated"] == 6 and record["acc"] == 0.5


def test_distill_frac_over_ranks_is_the_share_of_every_ranks_tokens():
    """Ranks hold as many responses but not as many tokens: distill_frac is distilled tokens over the
    step's tokens, not the mean of the ranks' shares (400 of 400 and 0 of 20 is 400/420, not 0.5)."""
    def rollout(lengths, distilled):
        return dict(peer_frac=float(distilled > 0), distill_frac=distilled / sum(lengths), distilled=distilled,
                    reprompt_truncated=0, reward=0.0, acc=0.0, resp_len=sum(lengths) / len(lengths), tokens=sum(lengths))
    mine, other = rollout([100] * 4, 400), rollout([5] * 4, 0)
    losses = dict.fromkeys(("loss", "reference_s", "teacher_s", "student_s") + train.metrics.TOKEN_SUMS, 0.0)
    theirs = [other[k] for k in sorted(other)] + [0.0] * (1 + len(train.metrics.TOKEN_SUMS))
    record = train.metrics.iteration_record({}, mine, losses, algo="sdpo", distill="topk", world=2, ratio_max=0.0,
                                            global_sum=lambda xs: [a + b for a, b in zip(xs, theirs)])
    assert record["distill_frac"] == pytest.approx(400 / 420) and record["tokens"] == 420
    assert record["resp_len"] == pytest.approx(420 / 8) and "distilled" not in record


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
