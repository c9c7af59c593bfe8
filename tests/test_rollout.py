"""Rollout, advantages and the SDPO teacher context: the pieces between generation and the loss."""
import pytest
import torch

from conftest import defaults

import decoding
import models
import teacher
import train


def tiny_model(vocab=20, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def eager_compile(monkeypatch):
    """torch.compile through the eager backend (dynamo traces the step, no minutes of CPU codegen)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: real_compile(fn, backend="eager"))
    monkeypatch.setattr(decoding, "_compiled_steps", {})


def test_response_mask_keeps_first_eos_once_and_nothing_after():
    eos = 2
    tokens = torch.tensor([[5, 6, 2, 7, 2],   # EOS in the middle: keep it, drop the rest
                           [2, 2, 2, 2, 2],   # EOS first: exactly one token
                           [5, 6, 7, 8, 9]])  # no EOS: everything (truncated)
    mask = train.response_mask(tokens, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ((tokens == eos) & mask).sum(-1).tolist() == [1, 1, 0]  # the stop token is trained, once


def test_generate_pad_equal_to_eos_still_keeps_the_stop_token():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    eos = 3
    out = train.generate(model, [[1, 4, 5], [6]], group_size=4, max_new_tokens=12, temperature=3.0, top_p=1.0,
                         eos_ids=[eos], pad_id=eos, generator=g)  # pad == eos, as with many tokenizers
    assert len(out.response_ids) == 8 and out.prompt_ids[4] == [6]
    for ids, logp, trunc in zip(out.response_ids, out.old_logprobs, out.truncated):
        assert len(ids) == len(logp) and (logp <= 0).all()
        assert ids.count(eos) == (0 if trunc else 1) and (trunc or ids[-1] == eos)
    assert any(not t for t in out.truncated), "with temperature 3 over 20 tokens some row should stop"


def test_generate_logprobs_match_a_full_forward_with_left_padding():
    """The recorded sampling log-probs are what the training forward computes (ratio ≈ 1)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 4, 5, 6, 7], [8, 9]]
    out = train.generate(model, prompts, group_size=2, max_new_tokens=6, temperature=0.7, top_p=1.0, eos_ids=[19],
                         pad_id=0, generator=g)
    for p, r, old in zip(out.prompt_ids, out.response_ids, out.old_logprobs):
        logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)] / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(old, ref, atol=1e-4, rtol=1e-4)


def test_generate_in_chunks_of_max_rows_equals_one_batch(monkeypatch):
    """max_rows (gen_batch_size) decodes whole groups a few at a time; with the nucleus cut to the
    single most likely token sampling is deterministic, so the chunks must give the same rows."""
    model = tiny_model()
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10], [11, 12, 13]]
    calls = []
    real = train.decode
    monkeypatch.setattr(train, "decode", lambda m, p, **k: calls.append(len(p)) or real(m, p, **k))
    runs = [train.generate(model, prompts, group_size=3, max_new_tokens=10, temperature=1.0, top_p=1e-6, eos_ids=[19],
                           pad_id=0, generator=torch.Generator().manual_seed(0), max_rows=max_rows)
            for max_rows in (0, 7, 1)]
    assert calls == [4, 2, 2, 1, 1, 1, 1]  # 7 rows -> 2 prompts x 3 per call; 1 row -> one whole group
    for out in runs[1:]:
        assert out.prompt_ids == runs[0].prompt_ids and out.response_ids == runs[0].response_ids
        assert out.truncated == runs[0].truncated
        for a, b in zip(out.old_logprobs, runs[0].old_logprobs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_static_cache_decoding_equals_the_dynamic_cache(monkeypatch):
    """static=True (StaticCache + compiled step, the CUDA fast path) samples the same tokens with the
    same log-probs as the dynamic-cache loop; run here through torch.compile's eager backend, which
    traces the step with dynamo like the real compile but skips code generation (minutes on CPU)."""
    eager_compile(monkeypatch)
    model = tiny_model()
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10]]
    runs = [train.generate(model, prompts, group_size=3, max_new_tokens=10, temperature=1.5, top_p=0.9, eos_ids=[19],
                           pad_id=0, generator=torch.Generator().manual_seed(3), static=static)
            for static in (False, True, True)]  # the second static call reuses the cache buffers
    assert decoding._compiled_steps, "the static path went through torch.compile"
    for out in runs[1:]:
        assert out.response_ids == runs[0].response_ids
        for a, b in zip(out.old_logprobs, runs[0].old_logprobs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len({len(r) for r in runs[0].response_ids}) > 1, "rows of different lengths (EOS inside the decode)"


@pytest.mark.parametrize("static", [False, True])
def test_a_rollout_with_grad_checkpointing_samples_what_the_model_without_it_samples(monkeypatch, static):
    """train.py rolls out from the model it trains, which is in train mode; with grad_checkpointing,
    transformers 5.17's checkpointed layers drop the KV cache in train mode whatever the grad mode
    (the static path then fails on an empty prefill cache, the dynamic one decodes each token without
    its context). Rollouts and the teacher's shared prefill run in eval mode, and restore the mode."""
    eager_compile(monkeypatch)
    plain, checkpointed = tiny_model(vocab=96), tiny_model(vocab=96)
    checkpointed.train()
    models.enable_grad_checkpointing(checkpointed)
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10]]
    runs = [train.generate(m, prompts, group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_ids=[2], pad_id=0,
                           generator=torch.Generator().manual_seed(5), static=static) for m in (plain, checkpointed)]
    assert runs[1].response_ids == runs[0].response_ids
    for a, b in zip(runs[1].old_logprobs, runs[0].old_logprobs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    responses = [r + [3] for r in runs[0].response_ids]
    prompts_per_row = runs[0].prompt_ids
    shared = [models.shared_prompt_hidden(m, prompts_per_row, responses, torch.device("cpu")) for m in (plain, checkpointed)]
    torch.testing.assert_close(shared[1], shared[0], atol=1e-5, rtol=1e-5)
    assert checkpointed.training and all(m.training for m in checkpointed.modules()), "train mode restored"
    assert not plain.training


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms, as gpu_check's resume check runs: index_copy_ becomes
    index_put_, which refuses a source of another dtype than the cache."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_under_autocast_every_kv_cache_is_in_the_autocast_dtype(monkeypatch, deterministic):
    """Under bf16 autocast RoPE makes keys fp32 and values bf16; transformers 5.17 then allocates
    fp32 caches, and its StaticCache refuses the first bf16 value of a compiled (eager backend) or
    deterministic decode step. Rollout (dynamic and static) and teacher caches store bf16, and the
    static path samples what the dynamic one does."""
    eager_compile(monkeypatch)
    monkeypatch.setattr(decoding, "_static_caches", {})
    model = tiny_model(vocab=96)
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runs = [train.generate(model, prompts, group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_ids=[2],
                               pad_id=0, generator=torch.Generator().manual_seed(5), static=static)
                for static in (False, True)]
    assert runs[1].response_ids == runs[0].response_ids
    for a, b in zip(runs[1].old_logprobs, runs[0].old_logprobs):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    (static_cache,) = decoding._static_caches.values()
    assert {t.dtype for layer in static_cache.layers for t in (layer.keys, layer.values)} == {torch.bfloat16}
    made, real = [], models.new_cache
    monkeypatch.setattr(models, "new_cache", lambda model, dev: made.append(real(model, dev)) or made[-1])
    monkeypatch.setattr(train, "new_cache", models.new_cache)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train.generate(model, prompts, group_size=2, max_new_tokens=4, temperature=1.0, top_p=1.0, eos_ids=[2], pad_id=0,
                       generator=torch.Generator().manual_seed(5))
        models.shared_prompt_hidden(model, runs[0].prompt_ids, [r + [3] for r in runs[0].response_ids], torch.device("cpu"))
    assert len(made) == 2  # the rollout's and the teacher's
    assert {t.dtype for cache in made for layer in cache.layers for t in (layer.keys, layer.values)} == {torch.bfloat16}
    with torch.no_grad():  # outside autocast the cache keeps the model's own dtype
        cache = decoding.new_cache(model, torch.device("cpu"))
        decoding.forward_with_cache(model, torch.tensor([[1, 4]]), torch.ones(1, 2, dtype=torch.long), None, cache)
    assert cache.layers[0].keys.dtype == cache.layers[0].values.dtype == torch.float32


def test_at_most_one_static_cache_is_alive(monkeypatch):
    """A static cache per shape kept forever did not fit a GPU at the paper's scale: a longer batch
    frees the live cache before allocating its own, a shorter one reuses it, and free_static_cache
    (before a train step it does not fit beside) drops it."""
    eager_compile(monkeypatch)
    monkeypatch.setattr(decoding, "_static_caches", {})
    model = tiny_model(vocab=96)

    def rollout(prompts, max_new_tokens):
        train.generate(model, prompts, group_size=2, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0,
                       eos_ids=[2], pad_id=0, generator=torch.Generator().manual_seed(5), static=True)
        assert len(decoding._static_caches) == 1
        return next(iter(decoding._static_caches.values()))

    first = rollout([[1, 4, 5], [8, 9]], 8)
    assert rollout([[1, 4], [8]], 8) is first  # shorter: the same buffers
    longer = rollout([[1, 4, 5], [8, 9]], 70)
    assert longer is not first and longer.layers[0].keys.shape[2] >= 73
    assert decoding.static_cache_bytes() == sum(t.numel() * t.element_size() for layer in longer.layers
                                              for t in (layer.keys, layer.values))
    decoding.free_static_cache()
    assert not decoding._static_caches and decoding.static_cache_bytes() == 0


def test_the_static_cache_stays_through_a_train_step_only_where_it_fits():
    gb = 10 ** 9
    assert decoding.static_cache_fits(allocated=80 * gb, step_extra=40 * gb, total=141 * gb)
    assert not decoding.static_cache_fits(allocated=128 * gb, step_extra=35 * gb, total=141 * gb)  # the paper-scale case
    assert not decoding.static_cache_fits(allocated=1 * gb, step_extra=None, total=141 * gb)  # first step: not measured yet
    memory = decoding.StepMemory()
    memory.before_step(torch.device("cpu"))  # a CPU run keeps its cache (no device memory to run out of)
    memory.after_step(torch.device("cpu"))
    assert memory.step_extra is None


def test_eval_mode_restores_every_submodules_own_mode():
    model = tiny_model().train()
    model.model.layers[0].eval()  # a submodule set apart stays apart
    with models.eval_mode(model, None):
        assert not any(m.training for m in model.modules())
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training


def test_top_p_only_samples_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, _ = train.sample_top_p(logits, 1.0, 0.7, g)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 never drawn
    tokens, _ = train.sample_top_p(logits, 1.0, 1.0, g)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = train.group_advantages(r, 4, norm_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]  # all-equal group: no signal
    adv = train.group_advantages(r, 4, norm_std=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert adv[4:].abs().max() == 0


def test_grpo_weights_aggregation_modes():
    lengths, keep = [2, 4, 3], [True, True, False]
    tm = train.grpo_weights(lengths, keep, "token-mean", 8)
    assert torch.allclose(torch.cat(tm).sum(), torch.tensor(1.0)) and tm[2].sum() == 0
    sm = train.grpo_weights(lengths, keep, "seq-mean-token-mean", 8)
    assert [round(w.sum().item(), 6) for w in sm] == [0.5, 0.5, 0.0]
    dr = train.grpo_weights(lengths, keep, "seq-mean-token-sum-norm", 8)
    assert torch.allclose(dr[1], torch.full((4,), 1 / 16))


def test_density_mask_fraction_and_seeding():
    g = torch.Generator().manual_seed(0)
    masks = train.density_masks([1000] * 20, 0.25, g)
    frac = torch.cat(masks).float().mean().item()
    assert abs(frac - 0.25) < 4 * (0.25 * 0.75 / 20000) ** 0.5  # 4 sigma
    again = train.density_masks([1000] * 20, 0.25, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(masks, again))
    assert all(m.all() for m in train.density_masks([5, 7], 1.0, g))


def test_pick_peer_first_success_never_self():
    rewards = [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [train.pick_peer(rewards, 4, i, 1.0, True) for i in range(4)] == [1, 2, 1, 1]
    assert train.pick_peer(rewards, 4, 1, 1.0, False) == 1  # self allowed
    assert all(train.pick_peer(rewards, 4, i, 1.0, True) is None for i in range(4, 8))


def test_strip_thinking():
    assert train.strip_thinking("<think>long\nthought</think>\\boxed{3}") == "\\boxed{3}"
    assert train.strip_thinking("answer <think>never closed") == "answer"


def test_teacher_context_text_for_a_hand_made_group():
    cfg = dict(defaults(), use_feedback=True, feedback_only_without_solution=True)
    tasks = [{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}], "answer": "4"}]
    texts = ["<think>hm</think>\\boxed{4}", "\\boxed{5}", "\\boxed{6}"]
    rewards, feedbacks = [1.0, 0.0, 0.0], [None, "Your final answer 5 is wrong.", "Your final answer 6 is wrong."]
    ctx = train.teacher_contexts(tasks, texts, rewards, feedbacks, 3, cfg)
    assert ctx[0] is None  # the only success: no other peer, and no feedback on a success
    assert ctx[1][0] == {"role": "system", "content": "S"}  # system message untouched
    assert ctx[1][1]["content"] == ("Q?\n\nCorrect solution:\n\n\\boxed{4}\n\nCorrectly solve the original question.")
    assert tasks[0]["messages"][1]["content"] == "Q?"  # the task itself is not mutated
    # feedback always (not only without a solution)
    cfg["feedback_only_without_solution"] = False
    ctx = train.teacher_contexts(tasks, texts, rewards, feedbacks, 3, cfg)
    assert ctx[2][1]["content"] == ("Q?\n\nCorrect solution:\n\n\\boxed{4}\n\nThe following is feedback from your "
                                    "unsuccessful earlier attempt:\n\nYour final answer 6 is wrong.\n\n"
                                    "Correctly solve the original question.")
    # no success in the group: feedback only, or nothing without use_feedback
    ctx = train.teacher_contexts(tasks, texts, [0.0] * 3, feedbacks, 3, cfg)
    assert ctx[0] is None and "Correct solution" not in ctx[1][1]["content"] and "answer 5" in ctx[1][1]["content"]
    cfg["use_feedback"] = False
    assert train.teacher_contexts(tasks, texts, [0.0] * 3, feedbacks, 3, cfg) == [None] * 3


def test_ema_update_math():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    before = [p.clone() for p in a.parameters()]
    teacher.ema_update(a, b, 0.25)
    for p0, p, q in zip(before, a.parameters(), b.parameters()):
        torch.testing.assert_close(p, 0.75 * p0 + 0.25 * q)


def test_a_teacher_prompt_over_max_reprompt_len_keeps_the_system_turn_and_the_question(toy_data):
    """Cutting an over-long teacher prompt from the left dropped the system turn and the question;
    the demonstration is shortened instead (to its end, where the answer is)."""
    import os
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    cfg = defaults()
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "12+30"}]
    peer = "step " * 60 + "\\boxed{42}"
    full = models.prompt_ids(tok, train.teacher_messages(messages, peer, None, cfg))
    limit = len(full) - 40
    (ids, short), cut = train.template_teacher_prompts(tok, [{"messages": messages}] * 2, [(peer, None), None], 1, cfg, limit)
    assert cut == 1 and short is None and len(ids) <= limit
    text = tok.decode(ids)
    assert text.startswith(tok.decode(full[:8])) and "Answer briefly." in text and "12+30" in text
    assert text.endswith(tok.decode(full[-12:])) and "\\boxed{42}" in text  # the instruction and the answer stay
    (same, _), cut = train.template_teacher_prompts(tok, [{"messages": messages}], [(peer, None)] * 2, 2, cfg, len(full))
    assert cut == 0 and same == full


def test_samples_jsonl_rows_come_from_several_groups():
    import metrics
    G, prompts = 3, 5
    batch = train.Batch(prompt_ids=[[i // G] for i in range(G * prompts)], response_ids=[[1]] * (G * prompts),
                        old_logprobs=[None] * (G * prompts), truncated=[False] * (G * prompts),
                        texts=[f"r{i}" for i in range(G * prompts)], rewards=[0.0] * (G * prompts),
                        teacher_prompt_ids=[None] * (G * prompts))
    tasks = [{"answer": str(p)} for p in range(prompts)]
    rows = metrics.sample_rows(batch, tasks, G, lambda ids: str(ids), iteration=7)
    assert [r["response"] for r in rows] == ["r0", "r1", "r3", "r4", "r6", "r7", "r9", "r10"]
    assert {r["answer"] for r in rows} == {"0", "1", "2", "3"}  # four prompts, not only the first
