"""The teacher (teacher.py): whose weights read the teacher prompt (frozen, EMA, trust region, live;
teacher_init), how it follows the student and resets at a stage boundary, the logits it gives the loss
(one shared prefill per prompt; the same token positions as the student), what eval scores as it and
what an SDPO run logs about it."""
import contextlib
import os
import re

import pytest
import torch

from conftest import TINY, defaults, hand_made_batch, read_log, run_train, tiny_qwen2, tiny_setup

import models
import runtime
import teacher
import train


def test_every_teacher_kind_has_a_row_in_the_teachers_table_and_a_model_scored_at_eval():
    """Adding a kind is one place, teacher.py: a row in Teacher's docstring table and in KINDS (CHOICES is its
    keys), and its lines in the methods. At eval a kind with its own copy scores that copy (frozen, EMA), live
    the student; trust_region is not scored."""
    own, student = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    rows = [line.split()[0] for line in train.Teacher.__doc__.splitlines() if line.startswith("        ")]
    assert rows[1:] == list(teacher.KINDS) and train.CHOICES["teacher"] == tuple(teacher.KINDS)  # header, then a row a kind
    scored = {kind: train.Teacher(kind, 0.1, own=own if facts.own_copy else None).eval_model(student)
              for kind, facts in teacher.KINDS.items()}
    assert all(scored[kind] is own for kind, facts in teacher.KINDS.items() if facts.own_copy)
    assert all(model in (own, student, None) for model in scored.values())
    assert {k: scored[k] for k in ("frozen", "ema", "trust_region", "live")} == {"frozen": own, "ema": own,
                                                                               "trust_region": None, "live": student}


@pytest.mark.parametrize("change,shared", [({}, True), ({"kl_coef": 0.1, "grpo_mix": 1.0}, True),
                                           ({"teacher_stage_reset": "student"}, False), ({"teacher": "ema"}, False)])
def test_a_frozen_teacher_is_the_initial_model_itself_unless_it_must_differ(toy_data, tmp_path, change, shared):
    """One copy serves the frozen teacher and the initial model (the KL reference, a stage reset's target):
    both are the starting weights and neither changes. A 'student' reset (and teacher_init,
    test_teacher_init_is_the_teacher) gives the teacher its own copy; an EMA teacher always has one."""
    cfg = dict(defaults(), algo="sdpo", teacher="frozen", n_layer=1, n_head=2, n_embd=32, block_size=128,
               out_dir=str(tmp_path / "run"), device="cpu", dataset="toy/add", data_dir=toy_data,
               tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"))
    cfg.update(change)
    with contextlib.ExitStack() as stack:
        run = train.setup(cfg, runtime.Dist("cpu"), stack)
        assert (run.teacher.own is run.initial_model) == shared
        assert run.teacher.own is not run.model and not any(p.requires_grad for p in run.teacher.own.parameters())
        for a, b in zip(run.teacher.own.parameters(), run.model.parameters()):  # the starting weights, either way
            assert torch.equal(a, b)


def test_teacher_init_is_the_teacher(toy_data, tmp_path):
    """teacher_init alone (teacher_init_alpha's default 1) makes the teacher that checkpoint."""
    other, _ = models.load_model("scratch", torch.device("cpu"), scratch=dict(defaults(), seed=7, n_layer=1, n_head=2,
                                                                              n_embd=32, block_size=128))
    other.save_pretrained(tmp_path / "other")
    cfg = dict(defaults(), algo="sdpo", teacher="frozen", teacher_init=str(tmp_path / "other"), n_layer=1, n_head=2,
               n_embd=32, block_size=128, out_dir=str(tmp_path / "run"), device="cpu", dataset="toy/add",
               data_dir=toy_data, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"))
    with contextlib.ExitStack() as stack:
        run = train.setup(cfg, runtime.Dist("cpu"), stack)
        for a, b in zip(run.teacher.own.parameters(), other.parameters()):
            torch.testing.assert_close(a, b)
        assert not torch.equal(next(run.model.parameters()), next(other.parameters()))


def test_the_ema_update_moves_the_teacher_by_tau_towards_the_student():
    a, b = tiny_qwen2(seed=0), tiny_qwen2(seed=1)
    before = [p.clone() for p in a.parameters()]
    teacher.ema_update(a, b, 0.25)
    for p0, p, q in zip(before, a.parameters(), b.parameters()):
        torch.testing.assert_close(p, 0.75 * p0 + 0.25 * q)


def test_the_teacher_follows_the_student_by_its_kind_and_resets_at_a_stage_boundary(toy_data):
    """after_step moves only an EMA teacher (θ_T ← (1−τ)θ_T + τθ); start_stage reloads the own copy
    from the student or the initial model, and 'keep' leaves it."""
    cfg, student, _ = tiny_setup(toy_data, "sdpo")
    initial = models.frozen_copy(student)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.1)
    for kind, moves in (("ema", True), ("frozen", False)):  # the EMA's formula; every kind's: the next test
        t = train.Teacher(kind, 0.25, own=models.frozen_copy(initial))
        t.after_step(student)
        p_t, p0, p = (next(m.parameters()) for m in (t.own, initial, student))
        torch.testing.assert_close(p_t, 0.75 * p0 + 0.25 * p if moves else p0)
        t.start_stage("keep", student, initial)
        torch.testing.assert_close(next(t.own.parameters()), 0.75 * p0 + 0.25 * p if moves else p0)
        t.start_stage("student", student, initial)
        torch.testing.assert_close(next(t.own.parameters()), p)
        t.start_stage("initial", student, initial)
        torch.testing.assert_close(next(t.own.parameters()), p0)


def test_after_a_step_a_teacher_with_its_own_copy_moves_exactly_when_its_kind_uses_teacher_rate(toy_data):
    """KINDS says which kinds read teacher_rate; a new own-copy kind that does but has no after_step branch
    would be a frozen teacher without a word."""
    cfg, student, _ = tiny_setup(toy_data, "sdpo")
    initial = models.frozen_copy(student)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.1)
    for kind, facts in teacher.KINDS.items():
        if not facts.own_copy:
            continue
        t = train.Teacher(kind, 0.25, own=models.frozen_copy(initial))
        t.after_step(student)
        moved = not torch.equal(next(t.own.parameters()), next(initial.parameters()))
        assert moved == facts.uses_rate, (kind, moved)


def test_the_trust_region_teachers_logits_are_the_initial_and_current_models_mixed_by_mu(toy_data):
    """Two shares: (1 − μ) of the initial model's logits and μ of the student's, each at the
    responses' tokens read after the teacher prompt; rows without a teacher prompt stay zero."""
    cfg, student, tokenizer = tiny_setup(toy_data, "sdpo")
    initial = models.frozen_copy(student)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.1)
    batch = hand_made_batch(tokenizer, with_teacher=True)
    prompts = [None] + batch.teacher_prompt_ids[1:]
    dev = torch.device("cpu")
    shares = train.Teacher("trust_region", 0.3, initial=initial).logits(student, prompts, batch.response_ids, dev)
    assert [s.coef for s in shares] == pytest.approx([0.7, 0.3])
    for share, m in zip(shares, (initial, student)):
        n0 = len(batch.response_ids[0])
        with torch.no_grad():
            want = models.response_hidden(m.eval(), prompts[1:], batch.response_ids[1:], dev)
        assert share.hidden[:n0].abs().max() == 0
        torch.testing.assert_close(share.hidden[n0:], want, atol=1e-5, rtol=1e-5)
        assert share.weight is m.get_output_embeddings().weight or torch.equal(share.weight, m.get_output_embeddings().weight)


def test_shared_prompt_hidden_equals_one_forward_per_sequence(toy_data):
    """The teacher's sharing (one prefill per distinct prompt, one read per distinct prompt+response
    pair) changes no number."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo")
    model.eval()
    p1, p2 = [1, 5, 6, 7, 8, 9, 10], [1, 11, 12]
    prompts = [p1, p1, p2, p1, p2, p1, p2]
    responses = [[20, 21, 22, 2], [23, 2], [24, 25, 26, 27, 28, 2], [2], [29, 30, 2], [23, 2], [23, 2]]
    with torch.no_grad():
        plain = models.response_hidden(model, prompts, responses, torch.device("cpu"))
    shared = models.shared_prompt_hidden(model, prompts, responses, torch.device("cpu"))
    assert shared.shape == plain.shape == (sum(map(len, responses)), 32)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_teacher_reads_the_same_token_positions_as_the_student(toy_data):
    """A live teacher given the student's own prompt is the student: divergence exactly ~0 on
    every token, which only holds if both score the same response ids at the same positions."""
    cfg, model, tokenizer = tiny_setup(toy_data, "sdpo", teacher="live", distill="full")
    batch = hand_made_batch(tokenizer, with_teacher=True)
    batch.teacher_prompt_ids = list(batch.prompt_ids)
    m = train.loss_backward(model, batch, cfg, torch.device("cpu"))
    assert m["distill_tokens"] == sum(len(r) for r in batch.response_ids)
    assert abs(m["div_sum"]) < 1e-5 and abs(m["logratio_ok_sum"] + m["logratio_failed_sum"]) < 1e-4


def test_an_sdpo_run_logs_its_teachers_accuracy_and_the_diagnostics(toy_data, tmp_path):
    out = tmp_path / "run"
    proc = run_train("config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--dataset=toy/add",
                     "--distill_agg=seq-mean", "--density=0.5", "--density_select=last", f"--out_dir={out}", "--max_iters=2",
                     "--device=cpu")
    log = read_log(out)
    evals = [r for r in log if "eval_tag" in r]
    assert len(evals) == 2 and all("eval/toy/add/teacher_mean@2" in r and "eval/toy/add/mean@2" in r for r in evals)
    last = evals[-1]  # the console's eval line shows both (and between them the share cut off, when not 0)
    assert re.search(rf"toy/add mean@2 {last['eval/toy/add/mean@2']:.3f}( \(\d+% cut off at max_new_tokens=\d+\))? "
                     rf"\(teacher {last['eval/toy/add/teacher_mean@2']:.3f}\)", proc.stdout), proc.stdout
    steps = [r for r in log if "loss" in r]
    for key in ("ratio_mean", "ratio_max", "clip_frac", "kl_sampler", "entropy", "div", "topk_mass", "sampled_logratio"):
        assert all(key in r for r in steps), key
    assert all(0 < r["topk_mass"] <= 1 and r["entropy"] > 0 and r["ratio_max"] >= r["ratio_mean"] > 0 for r in steps)
    assert (out / "samples.jsonl").exists()
    assert all(r["eval/toy/add/teacher_prompts"] == 4 for r in evals)  # every eval prompt has a teacher prompt


def test_a_teacher_scored_on_fewer_prompts_than_the_student_says_so(toy_data, tmp_path):
    """Eval teacher prompts over max_reprompt_len are left out (those with the longest solutions): the
    teacher's score is then over a subset, which the eval line and the record say."""
    out = tmp_path / "run"
    proc = run_train("config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--dataset=toy/sort",
                     "--max_reprompt_len=110", f"--out_dir={out}", "--max_iters=1", "--device=cpu")
    evals = [r for r in read_log(out) if "eval_tag" in r]
    assert len(evals) == 2 and all(r["eval/toy/sort/teacher_prompts"] == 3 for r in evals)
    assert "left out 1 of 4 prompts longer than 110 tokens" in proc.stdout
    assert len(re.findall(r"\(teacher \d\.\d{3} on 3 of its 4 prompts\)", proc.stdout)) == 2
