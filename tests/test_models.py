"""Any HF causal LM: on tiny random models of several architectures, the training log-probs (decoder
body + models.lm_head + the fused loss), the rollout's sampling log-probs and the teacher's shared
prefill all equal log_softmax(model(ids).logits) -- or the model is refused at load with one line."""
import json
import os

import pytest
import torch
import transformers

from conftest import DSA, TINY, read_log, run_train, run_train_here

import decoding
import models
import train

V, H = 96, 32
LLAMA = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# name: (config class, model class, config, the logit scale the model applies, or the refusal it must get)
ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA, head_dim=16, tie_word_embeddings=False), 1.0),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(LLAMA, attention_bias=True), 1.0),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA, sliding_window=4), 1.0),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=H, n_layer=2, n_head=2, n_positions=64,
                                                   eos_token_id=2), 1.0),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(LLAMA, num_attention_heads=2), 1.0),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=H, n_layer=2, n_head=2), 1.0),  # ALiBi
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(LLAMA, logits_scaling=4.0, embedding_multiplier=2.0,
                                                            residual_multiplier=0.5), 0.25),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(LLAMA, logit_scale=0.25), 0.25),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA, head_dim=16, final_logit_softcapping=0.5,
                                                         query_pre_attn_scalar=16), "final_logit_softcapping"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(LLAMA, num_key_value_heads=2), "bias"),
    # an attention indexer keeping index_topk >= the context's keys (dense): its cache layers need the config
    # (refused as "recurrent" without it)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(LLAMA, **DSA, index_topk=64), 1.0),
    # sparse (index_topk below the context): past 4 tokens a cached decode attends to other keys than a full forward
    "deepseek_v32_sparse": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(LLAMA, **DSA, index_topk=4), "index_topk=4"),
    # no position_ids, positions counted from the first column: left padding would shift them
    "bart": ("BartConfig", "BartForCausalLM", dict(vocab_size=V, d_model=H, decoder_layers=2, decoder_attention_heads=2,
                                                   decoder_ffn_dim=64, encoder_layers=2, encoder_attention_heads=2,
                                                   encoder_ffn_dim=64, max_position_embeddings=64), "left-padded row"),
}


def build(name):
    config_cls, model_cls, kwargs, _ = ARCHS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs)
    if name == "gemma2":
        config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config).float().eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("name", ARCHS)
def test_training_logprobs_equal_the_models_own_or_the_model_is_refused(name):
    model = build(name)
    expected = ARCHS[name][3]
    if isinstance(expected, str):
        with pytest.raises(models.ModelError, match=expected) as e:
            models.check_model(model)
        assert "\n" not in str(e.value)
        return
    assert models.lm_head(model)[1] == pytest.approx(expected, rel=1e-6)  # a lookup: before check_model too
    models.check_model(model)
    weight, scale = models.lm_head(model)
    assert scale == pytest.approx(expected, rel=1e-6)
    if name == "llama":  # a config that declares a scale its forward does not apply is refused, naming both
        liar = build(name)
        liar.config.logit_scale = 0.5
        with pytest.raises(models.ModelError, match="scaled by 1, not by the 0.5 its config declares"):
            models.check_model(liar)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 3)]
    responses = [torch.randint(3, V, (n,), generator=g).tolist() for n in (4, 6)]
    tokens = torch.tensor([t for r in responses for t in r])
    with torch.no_grad():
        want = torch.cat([torch.log_softmax(model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float(), -1)
                          .gather(-1, torch.tensor(r)[:, None]).squeeze(-1) for p, r in zip(prompts, responses)])
        # the training path: body, scale folded into the hidden states, the fused LM-head loss
        h = models.response_hidden(model, prompts, responses, torch.device("cpu")) * scale
        _, stats = train.fused_token_loss(h, weight, tokens, lambda lp, d, t, rows: lp.sum(), alpha=0.5,
                                          distill="topk", topk=5, tail=True, chunk_size=4)
        torch.testing.assert_close(stats["logp"], want, atol=1e-4, rtol=0)
        # the teacher path: one prefill per distinct prompt, continued from its KV cache
        shared = models.shared_prompt_hidden(model, prompts, responses, torch.device("cpu")) * scale
        torch.testing.assert_close(shared, h, atol=1e-4, rtol=1e-4)
    # the rollout: the log-prob each token was sampled with, under the model's own logits
    out = train.generate(model, prompts, group_size=2, max_new_tokens=5, temperature=1.0, top_p=1.0, eos_ids=[2],
                         pad_id=0, generator=torch.Generator().manual_seed(0))
    for p, r, old in zip(out.prompt_ids, out.response_ids, out.old_logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(old, ref, atol=1e-4, rtol=1e-4)


def test_a_refused_architecture_is_one_line_through_train_py(toy_data, tmp_path):
    model = build("gemma2")
    model.save_pretrained(tmp_path / "gemma2")
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer")).save_pretrained(tmp_path / "gemma2")
    proc = run_train_here("config/grpo_toy.py", *TINY, f"--init_from={tmp_path / 'gemma2'}", f"--out_dir={tmp_path / 'out'}",
                          "--max_iters=1", "--device=cpu")
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "final_logit_softcapping" in proc.stderr and not (tmp_path / "out").exists()


def test_stop_token_ids_take_every_declared_eos():
    model = build("qwen3")
    model.generation_config.eos_token_id = [2, 7]

    class Tok:
        eos_token_id = 9
    assert models.stop_token_ids(model, Tok()) == [2, 7, 9]
    tokens = torch.tensor([[5, 7, 2, 4], [5, 6, 9, 2], [5, 6, 4, 4]])
    assert train.response_mask(tokens, [2, 7, 9]).sum(-1).tolist() == [2, 3, 4]  # the first of any EOS, once


def test_a_tokenizer_without_a_chat_template_gets_plain_prompts(toy_data):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "12+3"}]
    assert "<|im_start|>" in tok.decode(models.prompt_ids(tok, messages))
    tok.chat_template = None
    assert not models.has_chat_template(tok)
    assert tok.decode(models.prompt_ids(tok, messages)) == "S\n12+3\n"


def test_a_toy_run_from_a_model_without_a_chat_template_says_so(toy_data, tmp_path):
    """A base model (no chat template) trains on plain prompts, with one line saying so."""
    from transformers import AutoTokenizer
    model = build("llama")
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    tok.chat_template = None
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    with open(tmp_path / "base" / "tokenizer_config.json") as f:
        assert not json.load(f).get("chat_template")
    proc = run_train("config/grpo_toy.py", *TINY, f"--init_from={tmp_path / 'base'}", f"--out_dir={tmp_path / 'out'}",
                     "--max_iters=1", "--device=cpu")
    assert "has no chat template" in proc.stdout


def test_a_gpt2_with_dropout_samples_and_trains_one_policy(toy_data, tmp_path):
    """GPT-2's configs ship dropout 0.1: with it on in the rollout or the training forward, the first
    iteration's ratio is not 1 before any update (ρmax ~1.2, kl_sampler ~5e-3). train.py turns
    dropout off at load (the RL references' choice), so sampler and trainer are one policy."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=H, n_layer=2, n_head=2, n_positions=128, eos_token_id=tok.eos_token_id,
                        bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    run_train("config/grpo_toy.py", *TINY, f"--init_from={tmp_path / 'gpt2'}", f"--out_dir={tmp_path / 'out'}",
              "--max_iters=1", "--device=cpu", "--temperature=1.0", "--group_size=8", "--max_new_tokens=16",
              "--kl_coef=0.001")  # a random model never succeeds: the KL term keeps every response in the loss
    record = next(r for r in read_log(tmp_path / "out") if r.get("iter") == 1 and "ratio_mean" in r)
    assert record["tokens"] > 50
    assert abs(record["ratio_mean"] - 1) < 1e-5 and record["ratio_max"] < 1 + 1e-4, record
    assert record["kl_sampler"] < 1e-8, record


def test_a_sliding_window_model_decodes_on_the_dynamic_cache_when_static_is_asked(monkeypatch):
    """Built from the config, a sliding-window layer's prefill cache keeps only the window, which a
    StaticCache cannot continue from: static=True then decodes on the dynamic cache, the same rows."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, backend="eager", **kw))
    monkeypatch.setattr(decoding, "_compiled_steps", {})
    monkeypatch.setattr(decoding, "_static_caches", {})
    model = build("mistral")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    runs = [train.generate(model, prompts, group_size=2, max_new_tokens=6, temperature=1.0, top_p=1.0, eos_ids=[2], pad_id=0,
                           generator=torch.Generator().manual_seed(0), static=static) for static in (False, True)]
    assert runs[1].response_ids == runs[0].response_ids and not decoding._static_caches
    cache = decoding.new_cache(model, torch.device("cpu"))
    assert all(layer.is_sliding for layer in cache.layers)  # the config's layer kinds
