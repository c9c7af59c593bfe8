"""Rollout (step 1): generate() samples group_size responses per prompt from one shared prefill, keeps
each response up to its first EOS and the log-prob each token was sampled with, on the dynamic or the
static KV cache, in chunks, under autocast and gradient checkpointing."""
import gc
import weakref

import pytest
import torch
import transformers

from conftest import DSA, tiny_qwen2

import decoding
import models
import train


def eager_compile(monkeypatch):
    """torch.compile through the eager backend (dynamo traces the step, no minutes of CPU codegen)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, backend="eager", **kw))
    monkeypatch.setattr(decoding, "_compiled_steps", {})


def recording_compile(monkeypatch):
    """torch.compile through a backend that keeps each graph dynamo hands it and runs it as traced
    (like the eager backend: no code generation); returns the list of graphs."""
    real_compile, graphs = torch.compile, []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()  # no compiled entries of earlier tests on the step's code
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, backend=backend, **kw))
    monkeypatch.setattr(decoding, "_compiled_steps", {})
    return graphs


def has_symbolic_sizes(graph):
    return any(isinstance(d, torch.SymInt) for n in graph.graph.nodes if n.op == "placeholder"
               for d in getattr(n.meta.get("example_value"), "shape", ()))


def test_response_mask_keeps_first_eos_once_and_nothing_after():
    eos = 2
    tokens = torch.tensor([[5, 6, 2, 7, 2],   # EOS in the middle: keep it, drop the rest
                           [2, 2, 2, 2, 2],   # EOS first: exactly one token
                           [5, 6, 7, 8, 9]])  # no EOS: everything (truncated)
    mask = train.response_mask(tokens, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ((tokens == eos) & mask).sum(-1).tolist() == [1, 1, 0]  # the stop token is trained, once


def test_top_p_only_samples_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, _ = train.sample_top_p(logits, 1.0, 0.7, g)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 never drawn
    tokens, _ = train.sample_top_p(logits, 1.0, 1.0, g)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_the_nucleus_found_among_the_top_k_is_the_one_a_full_sort_finds():
    """nucleus() looks among each row's top NUCLEUS_K first and sorts whole only the rows whose nucleus is
    wider: the kept tokens and values are those of sorting every row (as sample_top_p did), so the
    same generator draws the same tokens."""
    def by_full_sort(probs, top_p):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    torch.manual_seed(0)
    vocab = 8 * train.NUCLEUS_K
    scale = torch.tensor([0.1, 1.0, 3.0, 8.0]).repeat_interleave(16)[:, None]  # flat rows need the whole sort
    probs = torch.softmax(torch.randn(64, vocab) * scale, dim=-1)
    for top_p in (0.5, 0.9, 0.95):
        kept = train.nucleus(probs, top_p)
        assert torch.equal(kept, by_full_sort(probs, top_p))
        wide = (kept > 0).sum(-1) > train.NUCLEUS_K
        assert wide.any() and not wide.all()  # both paths ran
        draws = [torch.multinomial(p, 1, generator=torch.Generator().manual_seed(1)) for p in (kept, by_full_sort(probs, top_p))]
        assert torch.equal(*draws)
    small = probs[:, :100].softmax(-1)  # a small vocabulary: sorted whole
    assert torch.equal(train.nucleus(small, 0.9), by_full_sort(small, 0.9))


def test_decoding_n_tokens_runs_one_prefill_and_n_minus_1_steps(monkeypatch):
    """No forward after the last token (its logits would be sampled from by nothing)."""
    model, calls = tiny_qwen2(), []
    real = train.forward_with_cache
    monkeypatch.setattr(train, "forward_with_cache", lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))
    out = train.generate(model, [[1, 4, 5], [8]], group_size=2, max_new_tokens=6, temperature=1.0, top_p=1.0,
                         eos_ids=[99], pad_id=0, generator=torch.Generator().manual_seed(0))  # 99: never sampled
    assert all(len(r) == 6 for r in out.response_ids) and calls == [3] + [1] * 5


def test_generate_pad_equal_to_eos_still_keeps_the_stop_token():
    model = tiny_qwen2()
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
    model = tiny_qwen2()
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
    model = tiny_qwen2()
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
    model = tiny_qwen2()
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
    plain, checkpointed = tiny_qwen2(vocab=96), tiny_qwen2(vocab=96)
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


def test_the_decode_step_compiles_one_static_graph_per_shape_whatever_ran_before(monkeypatch):
    """Each compile of a 4B decode step costs about a minute, and its kernels set the rounding: so one graph
    a shape, the same in every process. Grad checkpointing's input hook (transformers 5.17 broke the graph
    in two there) and the trained student beside a frozen teacher (requires_grad, which dynamo guards on)
    add none; a new shape gets a graph of its own sizes, not the symbolic one dynamo's automatic dynamic
    shapes would make of the second shape, which a resumed process, skipping that history, never built."""
    graphs = recording_compile(monkeypatch)
    student = tiny_qwen2(vocab=96)
    student.train()
    models.enable_grad_checkpointing(student)
    teacher = models.frozen_copy(student)

    def rollout(model, group_size):
        train.generate(model, [[1, 4, 5], [8, 9]], group_size=group_size, max_new_tokens=6, temperature=1.0, top_p=1.0,
                       eos_ids=[2], pad_id=0, generator=torch.Generator().manual_seed(5), static=True)
        return len(graphs)

    assert rollout(student, 2) == 1, "grad checkpointing split the decode step's graph"
    assert rollout(teacher, 2) == 1 and rollout(student, 2) == 1, "student and teacher compiled the step apart"
    assert rollout(student, 4) == 2 and rollout(student, 3) == 3  # 8 rows, then 6: each shape its own graph
    assert not any(has_symbolic_sizes(g) for g in graphs)
    assert all(p.requires_grad for p in student.parameters()) and not any(p.requires_grad for p in teacher.parameters())


def test_eval_mode_restores_every_submodules_own_mode():
    model = tiny_qwen2().train()
    model.model.layers[0].eval()  # a submodule set apart stays apart
    with models.eval_mode(model, None):
        assert not any(m.training for m in model.modules())
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training


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
    monkeypatch.setattr(decoding, "_decode_weights", {})
    model = tiny_qwen2(vocab=96)
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
    frees the live cache before allocating its own, a shorter one reuses it, and free_decode_state
    (before a train step it does not fit beside) drops it."""
    eager_compile(monkeypatch)
    monkeypatch.setattr(decoding, "_static_caches", {})
    model = tiny_qwen2(vocab=96)

    def rollout(prompts, max_new_tokens):
        train.generate(model, prompts, group_size=2, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0,
                       eos_ids=[2], pad_id=0, generator=torch.Generator().manual_seed(5), static=True)
        assert len(decoding._static_caches) == 1
        return next(iter(decoding._static_caches.values()))

    first = rollout([[1, 4, 5], [8, 9]], 8)
    assert rollout([[1, 4], [8]], 8) is first  # shorter: the same buffers
    old, seen = weakref.ref(first), []  # is the old cache gone when the new one allocates its buffers?
    real_init = transformers.cache_utils.StaticLayer.lazy_initialization

    def allocating(self, *args, **kwargs):
        gc.collect()
        seen.append(old() is not None)
        return real_init(self, *args, **kwargs)
    monkeypatch.setattr(transformers.cache_utils.StaticLayer, "lazy_initialization", allocating)
    del first
    longer = rollout([[1, 4, 5], [8, 9]], 70)
    assert seen == [False] * model.config.num_hidden_layers, "the old cache was alive beside the new one"
    assert longer.layers[0].keys.shape[2] >= 73
    assert decoding.decode_state_bytes() == sum(t.numel() * t.element_size() for layer in longer.layers
                                              for t in (layer.keys, layer.values))  # fp32: no decode weights
    decoding.free_decode_state()
    assert not decoding._static_caches and decoding.decode_state_bytes() == 0


def test_a_short_last_chunk_decodes_on_the_live_static_cache_and_gives_the_one_batch_rows(monkeypatch):
    """gen_batch_size rows at a time: a last chunk with fewer prompts is padded to a full one (its extra
    rows dropped) so that it decodes on the live cache instead of reallocating it (and the next rollout's
    first chunk reallocating it again: new buffers, CUDA graphs re-recorded). With the nucleus cut to the
    most likely token, the padded chunks give the one-batch rows."""
    eager_compile(monkeypatch)
    monkeypatch.setattr(decoding, "_static_caches", {})
    model = tiny_qwen2(vocab=96)
    made, real_init = [], decoding.StaticKVCache.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        real_init(self, *args, **kwargs)
    monkeypatch.setattr(decoding.StaticKVCache, "__init__", counting)
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10], [11, 12, 13], [14, 15], [16, 17, 18], [19, 20]]

    def rollout(static, max_rows, seed=0):
        return train.generate(model, prompts, group_size=2, max_new_tokens=6, temperature=1.0, top_p=1e-6, eos_ids=[2],
                              pad_id=0, generator=torch.Generator().manual_seed(seed), static=static, max_rows=max_rows)
    one_batch = rollout(False, 0)
    for seed in range(3):  # three rollouts of 3 + 3 + 1 prompts: one cache, allocated once
        chunked = rollout(True, 6, seed)
        assert chunked.prompt_ids == one_batch.prompt_ids and chunked.response_ids == one_batch.response_ids
        assert chunked.truncated == one_batch.truncated
        for a, b in zip(chunked.old_logprobs, one_batch.old_logprobs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(made) == 1 and len(decoding._static_caches) == 1
    calls, real_decode = [], train.decode
    monkeypatch.setattr(train, "decode", lambda m, p, **k: calls.append(len(p)) or real_decode(m, p, **k))
    rollout(True, 6)
    rollout(True, 64)  # 14 rows in one chunk: not padded to 32 prompts
    assert calls == [3, 3, 3, 7]
    decoding.free_decode_state()


def test_a_cache_holding_more_than_keys_and_values_decodes_on_the_dynamic_cache(monkeypatch):
    """A sparse-attention indexer (DeepSeek-V3.2) keeps keys of its own in each cache layer, which the
    move into a StaticCache does not carry: the static path decoded with an indexer blind to the prompt.
    Such a cache (any layer not a plain DynamicLayer: sliding windows too) stays on the dynamic path,
    so static=True samples what static=False does. (check_model refuses a sparse index_topk for another
    reason, tests/test_models.py; generate itself does not call it.)"""
    eager_compile(monkeypatch)
    monkeypatch.setattr(decoding, "_static_caches", {})
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, max_position_embeddings=64, **DSA, index_topk=4)
    model = transformers.DeepseekV32ForCausalLM(config).float().eval()
    for prompts in ([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]], [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]):
        runs = [train.generate(model, prompts, group_size=2, max_new_tokens=8, temperature=1.0, top_p=1e-6, eos_ids=[2],
                               pad_id=0, generator=torch.Generator().manual_seed(0), static=static) for static in (False, True)]
        assert runs[1].response_ids == runs[0].response_ids
        for a, b in zip(runs[1].old_logprobs, runs[0].old_logprobs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not decoding._static_caches, "no static cache was made"


def test_decode_weights_are_the_casts_autocast_makes_so_no_number_changes():
    """A compiled decode step traces autocast's weight casts into its graph and re-reads every fp32
    weight at every token; decode_weights hands it bf16 copies instead. They are the casts autocast
    makes, so a decode through them samples the same tokens with the same log-probs, bit for bit."""
    model = tiny_qwen2(vocab=96)
    fp32 = {n: p for n, p in model.named_parameters()}
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10]]

    def rollout(copies):
        with torch.autocast("cpu", dtype=torch.bfloat16), decoding.decode_weights(model, enabled=copies):
            if copies:
                linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
                assert {m.weight.dtype for m in linears} == {torch.bfloat16}
                assert model.lm_head.weight is not model.model.embed_tokens.weight  # the embedding stays fp32
                assert model.model.embed_tokens.weight.dtype == torch.float32
            return train.decode(model, prompts, group_size=2, max_new_tokens=10, temperature=1.0, top_p=1.0, eos_ids=[2],
                                pad_id=0, generator=torch.Generator().manual_seed(3))
    try:
        plain, copied = rollout(False), rollout(True)
    finally:
        decoding.free_decode_state()
    assert copied.response_ids == plain.response_ids
    assert all(torch.equal(a, b) for a, b in zip(copied.old_logprobs, plain.old_logprobs))
    assert all(p is fp32[n] for n, p in model.named_parameters())  # the very fp32 parameters are back
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    with decoding.decode_weights(model):  # outside autocast: nothing to copy
        assert not decoding._decode_weights and model.lm_head.weight.dtype == torch.float32


def test_decode_weights_are_kept_refreshed_after_a_step_and_freed_with_the_static_cache(monkeypatch):
    """Between rollouts the copies stay (the same buffers, so CUDA graphs replay), refreshed on entry
    from the weights the optimizer step wrote; free_decode_state drops them with the static cache, and
    new ones compile nothing new; another model replaces them (at most one set alive); an error inside
    puts the fp32 weights back."""
    eager_compile(monkeypatch)
    monkeypatch.setattr(decoding, "_static_caches", {})
    monkeypatch.setattr(decoding, "_decode_weights", {})
    model, other = tiny_qwen2(vocab=96), tiny_qwen2(vocab=96, seed=1)
    prompts = [[1, 4, 5, 6, 7], [8, 9]]

    def rollout(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return train.generate(m, prompts, group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_ids=[2],
                                  pad_id=0, generator=torch.Generator().manual_seed(5), static=True)
    from torch._dynamo.utils import counters
    rollout(model)
    graphs = counters["stats"]["unique_graphs"]
    slots = decoding._decode_weights["slots"]
    pointers = [c.data_ptr() for *_, c in slots]
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(slots) == n_linear + 3 * model.config.num_hidden_layers  # + Qwen2's q, k, v biases
    assert decoding.decode_state_bytes() > 0
    with torch.no_grad():  # an optimizer step, in place
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after_step = rollout(model)
    assert [c.data_ptr() for *_, c in decoding._decode_weights["slots"]] == pointers  # same buffers, new values
    decoding.free_decode_state()
    assert not decoding._decode_weights and not decoding._static_caches and decoding.decode_state_bytes() == 0
    fresh = rollout(model)  # new copies of the stepped weights: what the refreshed ones gave
    assert fresh.response_ids == after_step.response_ids
    assert all(torch.equal(a, b) for a, b in zip(fresh.old_logprobs, after_step.old_logprobs))
    assert counters["stats"]["unique_graphs"] == graphs, "refreshed or new copies: no recompile"
    old_copies = [weakref.ref(c) for *_, c in decoding._decode_weights["slots"]]  # fresh's copies
    del slots
    alive, real_parameter = [], torch.nn.Parameter

    class Counting(real_parameter):  # counts the old copies still alive as each new copy is made
        def __new__(cls, data=None, requires_grad=True):
            gc.collect()
            alive.append(sum(r() is not None for r in old_copies))
            return real_parameter(data, requires_grad)
    monkeypatch.setattr(torch.nn, "Parameter", Counting)
    rollout(other)
    monkeypatch.setattr(torch.nn, "Parameter", real_parameter)
    assert alive and set(alive) == {0}, "the old copies were alive beside the new ones"
    assert decoding._decode_weights["model"]() is other and len(decoding._decode_weights["slots"]) == len(old_copies)
    weight = model.lm_head.weight
    with pytest.raises(RuntimeError, match="inside"):
        with torch.autocast("cpu", dtype=torch.bfloat16), decoding.decode_weights(model):
            raise RuntimeError("inside")
    assert model.lm_head.weight is weight and weight.dtype == torch.float32
    decoding.free_decode_state()


def test_the_decode_state_stays_through_a_train_step_only_where_it_fits():
    gb = 10 ** 9
    assert decoding.decode_state_fits(allocated=80 * gb, step_extra=40 * gb, total=141 * gb)
    assert not decoding.decode_state_fits(allocated=128 * gb, step_extra=35 * gb, total=141 * gb)  # the paper-scale case
    assert not decoding.decode_state_fits(allocated=1 * gb, step_extra=None, total=141 * gb)  # first step: not measured yet
    memory = decoding.StepMemory()
    memory.before_step(torch.device("cpu"))  # a CPU run keeps its cache (no device memory to run out of)
    memory.after_step(torch.device("cpu"))
    assert memory.step_extra is None


def test_every_ranks_random_streams_are_distinct_and_rank_0s_are_a_one_process_runs():
    """seed + rank (sampling) and seed + k + rank (evals) made rank 1's sampling stream rank 0's student-eval one."""
    seeds = [train.stream_seed(1337, rank, stream) for rank in range(64) for stream in range(3)]
    assert len(set(seeds)) == len(seeds)
    assert [train.stream_seed(1337, 0, stream) for stream in range(3)] == [1337, 1338, 1339]
