"""
Any HF causal LM, the way train.py needs it: loaded (or a toy model built from scratch), checked
once at load, dropout off, its decoder body and LM head taken apart for the fused loss (the hidden
states that predict each response token, with the teacher's shared-prompt prefill), its EOS ids and
its prompts; with lora_rank > 0, peft's LoRA adapters on it (apply_lora, the base views the LoRA
teachers read, the merged weights ckpt/ exports). Decoding with a KV cache is decoding.py; the device,
autocast and ranks are runtime.py.

train.py never asks the model for its training logits: it runs the decoder body, keeps the final
hidden states h and does the LM head itself, in chunks (models.lm_head). That is only right if the
model's own forward does nothing else after the body than logits = scale · (h @ Wᵀ): true for most
causal LMs (scale 1), Granite (1/logits_scaling), Cohere (logit_scale), ... A model that also adds a
bias, soft-caps its logits (Gemma-2) or has a head with its own layers is refused at load with one
line, rather than trained with silently wrong log-probs.
"""
import contextlib
import copy
import functools
import inspect
import math
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from huggingface_hub.utils import logging as hf_hub_logging
from transformers.utils import logging as hf_logging

from configurator import UserError, require
from data import tasks as data_tasks
from decoding import CACHE, new_cache
from runtime import amp_dtype, is_sharded, sharded_copy

# progress bars and hub retry warnings would bury the one-line errors and the training log
hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
hf_hub_logging.set_verbosity_error()

SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


class ModelError(UserError):
    """The model cannot be loaded or trained here: one line, like every UserError."""


@contextlib.contextmanager
def eval_mode(*modules):
    """Run forwards in eval mode (callers add no_grad), restoring each submodule's mode after. Rollouts,
    evals and teacher forwards need it: in train mode transformers 5.17's gradient-checkpointed
    layers drop the KV cache (past_key_values=None) whatever the grad mode, so a prefill writes
    nothing, and dropout would sample from another policy than the one trained."""
    modes = [(m, m.training) for module in modules if module is not None for m in module.modules()]
    for module in modules:
        if module is not None:
            module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def disable_dropout(model):
    """Dropout off everywhere, for good (TRL's disable_dropout): every nn.Dropout p = 0, every float
    *drop* attribute of a module (attention_dropout, layerdrop, ... read at forward time) and of the
    config 0. RL needs the training forward's log-probs to be those the rollout sampled with (ρ = 1
    before any update); the references train RL with dropout off."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "drop" in name.lower() and isinstance(value, float):
                setattr(module, name, 0.0)
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}
    for config in configs.values():
        for name, value in list(vars(config).items()):
            if "drop" in name.lower() and isinstance(value, float):
                setattr(config, name, 0.0)
    return model


def decoder_body(model):
    """The module the model's forward runs before its LM head (`model`, `transformer`, `gpt_neox`,
    ...: what base_model_prefix names); its last_hidden_state has been through the final norm."""
    body = model.base_model
    if body is model:  # Llama4 / Mllama: the prefix names no attribute, their forward calls self.model
        body = getattr(model, "model", None)
    if not isinstance(body, torch.nn.Module) or body is model:
        raise ModelError(f"{type(model).__name__} has no decoder body that nanoSDPO can find")
    return body


def takes_position_ids(module):
    """False for ALiBi models (Bloom, MPT): their position bias follows the attention mask."""
    return "position_ids" in inspect.signature(module.forward).parameters


def body_forward(body, input_ids, attention_mask, position_ids=None, cache=None):
    """The body's last_hidden_state, called by keyword (the positional order differs: GPT-2's second
    argument is the cache)."""
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=cache is not None)
    if position_ids is not None and takes_position_ids(body):
        inputs["position_ids"] = position_ids
    if cache is not None:
        inputs[CACHE] = cache
    return body(**inputs).last_hidden_state


def lm_head(model):
    """(weight [V, H], scale): the model's logits are scale · (h @ weight.T) of its body's hidden states.
    A pure lookup (check_model holds it against the model's own logits once, at load)."""
    return model.get_output_embeddings().weight, logit_scale(model.config.get_text_config())


def logit_scale(config):
    """The factor a model's forward applies to h @ Wᵀ, as its config declares it: 1/logits_scaling
    (Granite), logit_scale (Cohere), else 1."""
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale /= config.logits_scaling
    if getattr(config, "logit_scale", None):
        scale *= config.logit_scale
    return float(scale)


@torch.no_grad()
def check_model(model):
    """Take the model's LM head apart, or refuse it in one line (ModelError).

    On 8 tokens: the model's own logits against scale · (h @ Wᵀ), with the scale lm_head reads from
    its config (1/logits_scaling for Granite, logit_scale for Cohere, 1 for most); then a left-padded prefill
    into a DynamicCache continued at explicit positions, the pattern of the rollout and the teacher
    forward, against one plain forward (recurrent and hybrid models keep state outside the cache)."""
    name, config = type(model).__name__, model.config.get_text_config()
    for field in SOFTCAP_FIELDS:
        if getattr(config, field, None):
            raise ModelError(f"{name}: config {field}={getattr(config, field)} (soft-capped logits) is not supported "
                             "by nanoSDPO's LM-head loss; set it to null in config.json to train without the cap")
    # a sparse-attention indexer (DeepSeek-V3.2, GLM-MoE-DSA, ...) keeps the top index_topk keys per query: past
    # that many tokens, transformers' KV-cached decode picks other keys than one forward over the sequence
    # (both 5.17 and 5.24), so the rollout's log-probs would not be the training forward's (rho != 1)
    topk, positions = getattr(config, "index_topk", None), getattr(config, "max_position_embeddings", None)
    if topk and positions and topk < positions:
        raise ModelError(f"{name}: config index_topk={topk} (sparse attention) is not supported: past {topk} tokens its "
                         "KV-cached decode attends to other keys than a full forward; set index_topk >= "
                         f"max_position_embeddings ({positions}) in config.json to train it with every key kept (dense)")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ModelError(f"{name}: its LM head is a {type(head).__name__}, not one linear layer")
    if head.bias is not None:
        raise ModelError(f"{name}: its LM head has a bias, which nanoSDPO's LM-head loss does not support")
    was_training = model.training
    model.eval()
    try:
        dev, vocab = head.weight.device, head.weight.shape[0]
        ids = ((torch.arange(8, device=dev) * 7919 + 11) % vocab)[None]
        mask = torch.ones_like(ids)
        try:
            want = model(input_ids=ids, attention_mask=mask).logits.double()
        except Exception as e:  # a model whose own forward fails here (an HF bug, an odd config): one line
            raise ModelError(f"{name}: its forward fails on 8 tokens ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        raw = (body_forward(decoder_body(model), ids, mask) @ head.weight.T).double()
        scale, tolerance = lm_head(model)[1], 1e-4 * (1 + want.abs().max().item())
        err = (want - scale * raw).abs().max().item() if want.shape == raw.shape else math.inf
        if err > tolerance:
            fitted = (want * raw).sum().item() / max((raw * raw).sum().item(), 1e-30) if want.shape == raw.shape else 0
            if fitted and (want - fitted * raw).abs().max().item() <= tolerance:
                raise ModelError(f"{name}: its logits are h @ Wᵀ scaled by {fitted:.6g}, not by the {scale:.6g} its config "
                                 "declares (logits_scaling / logit_scale): nanoSDPO's LM-head loss does not support it")
            raise ModelError(f"{name}: its logits are not a scaled h @ Wᵀ of its body's hidden states "
                             f"(max |Δ| {err:.3g}): nanoSDPO's LM-head loss does not support this architecture")
        # the rollout / teacher pattern: prefill 2 left-padded prompts, pick rows, continue at positions
        prompt = ((torch.arange(10, device=dev) * 7919 + 11) % vocab).view(2, 5)
        p_mask = torch.ones_like(prompt)
        p_mask[1, :2] = 0
        rest = ((torch.arange(6, device=dev) * 104729 + 5) % vocab).view(2, 3)
        which = torch.tensor([1, 0], device=dev)
        position = (p_mask.cumsum(-1) - 1).clamp(min=0)
        rest_position = p_mask.sum(-1)[which, None] + torch.arange(3, device=dev)[None]
        full_mask = torch.cat([p_mask[which], torch.ones_like(rest)], 1)
        body, cache = decoder_body(model), new_cache(model, dev)
        try:
            body_forward(body, prompt, p_mask, position, cache)
            cache.batch_select_indices(which)
            got = body_forward(body, rest, full_mask, rest_position, cache)
        except Exception as e:
            raise ModelError(f"{name}: its body cannot continue from a KV cache ({type(e).__name__}): "
                             "recurrent and hybrid models are not supported") from None
        plain = body_forward(body, torch.cat([prompt[which], rest], 1), full_mask, torch.cat([position[which], rest_position], 1))
        if (got - plain[:, 5:]).abs().max().item() > 1e-4 * (1 + plain.abs().max().item()):
            raise ModelError(f"{name}: a KV-cached continuation differs from a plain forward: recurrent and hybrid "
                             "models are not supported")
        # left padding must not move positions: the padded row against the same tokens unpadded
        # (a model that takes no position_ids and counts positions from the first column, as the
        # BART-family decoders do, would shift them; ALiBi models follow the mask and pass)
        unpadded = torch.cat([prompt[1:, 2:], rest[:1]], 1)  # plain's row 0 is prompt row 1 (2 pads) + rest row 0
        alone = body_forward(body, unpadded, torch.ones_like(unpadded))
        if (plain[0, 2:] - alone[0]).abs().max().item() > 1e-4 * (1 + alone.abs().max().item()):
            raise ModelError(f"{name}: a left-padded row differs from the same tokens unpadded (padding moves its "
                             "positions, or its attention ignores the mask): nanoSDPO's batched rollouts do not support it")
    finally:
        model.train(was_training)


def pad_batch(seqs, pad_id, left):
    """Token-id lists -> (ids [B, T], attention mask [B, T]). Left padding puts every prompt's end
    in the last column, where generation continues; right padding suits full sequences."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def hidden_states(model, sequences, dev):
    """Right-pad sequences, run the decoder body, return its final hidden states [B, T, H]."""
    ids, mask = pad_batch(sequences, 0, left=False)
    return body_forward(decoder_body(model), ids.to(dev), mask.to(dev))


def response_hidden(model, prompts, responses, dev):
    """Hidden states predicting each response token (positions p-1 .. p+n-2 of prompt+response): [Σn, H]."""
    h = hidden_states(model, [p + r for p, r in zip(prompts, responses)], dev)
    return torch.cat([h[i, len(p) - 1:len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))], 0)


@torch.no_grad()
def shared_prompt_hidden(model, prompts, responses, dev):
    """response_hidden without grad, computing each distinct input once: a group's responses share
    one teacher prompt (its first successful peer), so each distinct prompt is prefilled once and
    its KV cache reused; and identical (prompt, response) pairs, common when answers are short
    (several peers write the same correct answer), are read once.

    Prompts are left-padded into one prefill; the distinct responses (right-padded) continue from
    their prompt's cache row at positions len(prompt), len(prompt)+1, ..."""
    with eval_mode(model):  # a checkpointed layer in train mode drops the cache (transformers 5.17)
        return _shared_prompt_hidden(model, prompts, responses, dev)


def _shared_prompt_hidden(model, prompts, responses, dev):
    body = decoder_body(model)
    keys = list(zip(map(tuple, prompts), map(tuple, responses)))
    unique = {p: k for k, p in enumerate(dict.fromkeys(p for p, _ in keys))}
    pairs = {pr: k for k, pr in enumerate(dict.fromkeys(keys))}
    ids, mask = (t.to(dev) for t in pad_batch(list(unique), 0, left=True))
    cache = new_cache(model, dev)
    last = body_forward(body, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)[:, -1:]
    which = torch.tensor([unique[p] for p, _ in pairs], device=dev)
    hidden = last[which]  # [pairs, 1, H]: predicts each pair's first response token
    if max(len(r) for r in responses) > 1:  # the last response token predicts nothing
        cache.batch_select_indices(which)
        rest_ids, rest_mask = pad_batch([list(r[:-1]) for _, r in pairs], 0, left=False)
        position = mask.sum(-1)[which, None] + torch.arange(rest_ids.shape[1], device=dev)[None]
        rest = body_forward(body, rest_ids.to(dev), torch.cat([mask[which], rest_mask.to(dev)], dim=1), position, cache)
        hidden = torch.cat([hidden, rest], 1)  # [pairs, 1 + rest, H]: position t predicts token t
    width = hidden.shape[1]
    index = [pairs[key] * width + t for key in keys for t in range(len(key[1]))]
    return hidden.flatten(0, 1)[torch.tensor(index, device=dev)]


def stop_token_ids(model, tokenizer):
    """Every id that ends a response, sorted: the tokenizer's EOS and each eos_token_id the model's
    generation_config and config declare (an int or a list: Qwen3 lists <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    for source in (getattr(model, "generation_config", None), model.config, model.config.get_text_config()):
        declared = getattr(source, "eos_token_id", None)
        ids.update(declared if isinstance(declared, (list, tuple)) else [declared])
    return sorted(int(i) for i in ids if i is not None)


def has_chat_template(tokenizer):
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, messages, enable_thinking=False):
    """A prompt's token ids, ending where the reply starts: the chat template with its generation
    prefix, or, for a tokenizer without one (a base model), the messages' contents one per line.
    A template that refuses the messages (Gemma's raises "System role not supported") is one line."""
    if has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=enable_thinking)
        except Exception as e:  # jinja2's TemplateError from the template's raise_exception(), ...
            roles = ", ".join(m.get("role", "?") for m in messages)
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ModelError(f"the tokenizer's chat template refused a prompt with roles [{roles}]: {reason} (change the "
                             "data's turns, e.g. fold the system turn into the user's, or the tokenizer's chat_template)") from None
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode("\n".join(m["content"] for m in messages) + "\n", add_special_tokens=True)


def fit_prompt(tokenizer, build, demo, limit, enable_thinking=False):
    """(token ids, shortened?) of the prompt build(demo) (chat messages around a demonstration text
    demo, or None) in at most `limit` tokens: the demonstration is shortened to its end (where the
    answer is), the rest kept (system turn, question, instruction); only a prompt that is too long
    without any demonstration keeps its last `limit` tokens."""
    ids = prompt_ids(tokenizer, build(demo), enable_thinking)
    if len(ids) <= limit:
        return ids, False
    demo_ids = tokenizer.encode(demo, add_special_tokens=False) if demo else []
    keep = len(demo_ids) - (len(ids) - limit)
    for _ in range(4):  # re-tokenising the joined text can differ by a few tokens: shrink until it fits
        if keep <= 0:
            break
        ids = prompt_ids(tokenizer, build(tokenizer.decode(demo_ids[-keep:])), enable_thinking)
        if len(ids) <= limit:
            return ids, True
        keep -= len(ids) - limit
    if demo:  # nothing of the demonstration fits: the prompt around an empty one (system turn and question kept)
        ids = prompt_ids(tokenizer, build(""), enable_thinking)
    return ids[-limit:], True


def context_length(model):
    config = model.config.get_text_config()
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def prompt_budget(model, max_new_tokens, max_prompt_len=0):
    """(prompt cap, context): the most prompt tokens the model reads before max_new_tokens of
    response (max_prompt_len, or the context minus max_new_tokens); nothing left is one line."""
    context = context_length(model) or math.inf
    cap = max_prompt_len or context - max_new_tokens
    if max_prompt_len and max_prompt_len + max_new_tokens > context:
        raise UserError(f"max_prompt_len={max_prompt_len} + max_new_tokens={max_new_tokens} exceeds the model's context of "
                        f"{context} tokens: lower --max_prompt_len or --max_new_tokens")
    if cap <= 0:
        raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of {context} "
                        "tokens: lower --max_new_tokens")
    return cap, context


CHARS_PER_TOKEN = 64  # no tokenizer spells one token with more: a longer text is too long without tokenizing it


def dropped_characters(tokenizer, texts):
    """The characters of texts that the tokenizer cannot spell back: what it drops (the toy tokenizer
    knows printable ASCII and newline only) or maps to its unknown token. Each distinct character is
    tried once per tokenizer (a data set holds few)."""
    chars = set().union(*map(set, texts)) - set(" \t\n\r")
    return sorted(c for c in chars if not _spells_back(tokenizer, c))


@functools.lru_cache(maxsize=1 << 16)
def _spells_back(tokenizer, char):
    return char in tokenizer.decode(tokenizer.encode(char, add_special_tokens=False), skip_special_tokens=False)


def fit_tasks(tasks, name, tokenizer, *, cap, enable_thinking=False, context=None, say=print,
              fix="raise max_prompt_len (or use a model with a longer context)", required=True):
    """The tasks whose prompt (through the chat template) is at most `cap` tokens, and with
    `context` (SFT) whose prompt + solution + EOS fits it; the others are left out and counted.
    A text far longer in characters is left out without being tokenized (bounded time on any
    input). Characters the tokenizer would drop silently are refused for a character-level
    tokenizer (under 256 tokens: the toy's) and a warning for any other."""
    prompt_len = {}

    def prompt_fits(task):
        if data_tasks.prompt_chars(task) > CHARS_PER_TOKEN * cap:
            return False
        prompt_len[id(task)] = len(prompt_ids(tokenizer, task["messages"], enable_thinking))
        return prompt_len[id(task)] <= cap

    def sequence_fits(task):  # SFT trains on prompt + solution + EOS, one sequence
        if len(task["solution"]) > CHARS_PER_TOKEN * context:
            return False
        return prompt_len[id(task)] + len(tokenizer.encode(task["solution"], add_special_tokens=False)) + 1 <= context
    kept = data_tasks.fitting(tasks, name, prompt_fits, say, why=f"longer than {cap} tokens", fix=fix, required=required)
    if context is not None:
        kept = data_tasks.fitting(kept, name, sequence_fits, say, what="SFT tasks", required=required,
                                  why=f"whose prompt + solution is longer than the model's {context}-token context",
                                  fix="shorten the solutions (or use a model with a longer context)")
    dropped = []
    for task in kept:
        texts = [m["content"] for m in task["messages"]] + ([task["solution"]] if context is not None else [])
        lost = dropped_characters(tokenizer, texts)
        if lost and len(tokenizer) < 256:
            raise UserError(f"{name}: task {task.get('id', '?')}: the {len(tokenizer)}-token tokenizer cannot encode "
                            f"{''.join(lost)[:40]!r} and would drop it silently: remove those characters from the data "
                            "(the toy tokenizer knows printable ASCII and newline) or use a model whose tokenizer has them")
        if lost:
            dropped.append((task.get("id", "?"), lost))
    if dropped:
        chars = "".join(sorted({c for _, lost in dropped for c in lost}))
        say(f"warning: {name}: {len(dropped)} tasks hold characters the tokenizer cannot encode ({chars[:40]!r}; task "
            f"{dropped[0][0]} first): the model never sees them")
    return kept


# a folder holding none of these has no tokenizer (transformers would build a 1-token one silently)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt", "sentencepiece.bpe.model")


def load_model(init, dev, dtype=torch.float32, scratch=None, with_tokenizer=True):
    """(model, tokenizer) from an HF folder or hub id, or, for init='scratch', a small Qwen2-shaped
    model built from `scratch` (tokenizer_path, seed, n_layer, n_head, n_embd, block_size).
    Checked with check_model; every failure is a ModelError with one line. with_tokenizer=False:
    only the weights are wanted (teacher_init, the initial model), and the tokenizer is None."""
    if init == "scratch":
        if not scratch:
            raise ModelError("init_from=scratch builds a toy model from train.py's settings: give a checkpoint folder or hub id")
        s = scratch
        tokenizer_path = data_tasks.resolve(s["tokenizer_path"])
        if not os.path.exists(os.path.join(tokenizer_path, "tokenizer_config.json")):
            raise ModelError(f"{s['tokenizer_path']} has no tokenizer (looked for {data_tasks.searched(tokenizer_path)}): "
                             "run `python data/toy/prepare.py` first")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        torch.manual_seed(s["seed"])
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=s["n_embd"], intermediate_size=4 * s["n_embd"],
            num_hidden_layers=s["n_layer"], num_attention_heads=s["n_head"], num_key_value_heads=s["n_head"],
            max_position_embeddings=s["block_size"], tie_word_embeddings=True, bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    else:
        if os.path.isdir(init) and not os.path.exists(os.path.join(init, "config.json")):
            inside = os.path.join(init, "ckpt")
            raise ModelError(f"{init} is not a model folder (no config.json): point init_from at a checkpoint folder"
                             + (f" ({inside}: a run's latest)" if os.path.exists(os.path.join(inside, "config.json")) else ""))
        if not os.path.isdir(init) and init.count("/") != 1:
            raise ModelError(f"model {init} not found: no such folder, and not a hub id like Qwen/Qwen3-8B "
                             f"({writer_hint(init)})")
        first = init.split("/")[0]
        if not os.path.isdir(init) and os.path.isdir(first):  # out/typo: a mistyped path, not a hub id to retry for a minute
            raise ModelError(f"model {init} not found: no such folder ({first}/ is a folder here, so {init} reads as a path, "
                             f"not a hub id; {writer_hint(init)})")
        if with_tokenizer and os.path.isdir(init) and not any(os.path.exists(os.path.join(init, f)) for f in TOKENIZER_FILES):
            raise ModelError(f"{init} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): copy them from the "
                             "model it was trained from (tokenizer.save_pretrained) into the folder")
        try:
            tokenizer = AutoTokenizer.from_pretrained(init) if with_tokenizer else None
            model = AutoModelForCausalLM.from_pretrained(init, dtype=dtype)
        except Exception as e:  # not on the hub, no network, a damaged file, an unknown architecture, ...
            where = "" if os.path.isdir(init) else "no such folder here, and from the hub: "  # (a mistyped path, too)
            raise ModelError(f"cannot load model {init!r}: {where}{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
        if tokenizer is not None and len(tokenizer) < 2:  # what transformers builds, without a word, from no vocabulary
            raise ModelError(f"{init}'s tokenizer has {len(tokenizer)} token(s): its tokenizer files are missing or empty")
    if tokenizer is not None and tokenizer.eos_token_id is None:  # the model's config may still name its EOS
        declared = stop_token_ids(model, tokenizer)
        if not declared:
            raise ModelError(f"{init}: neither its tokenizer nor its config names an end-of-sequence token: set "
                             "eos_token in its tokenizer_config.json")
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(declared[0])
    if tokenizer is not None and tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(dev, dtype)
    check_model(model)
    return model, tokenizer


def load_student(init, dev, cfg):
    """The model train.py trains, and its tokenizer: load_model(init), with LoRA adapters on it when
    lora_rank > 0 (apply_lora; its frozen base kept in the autocast dtype, and then loaded and checked
    in fp32 on the CPU first, so the GPU never holds the fp32 base)."""
    if not cfg["lora_rank"]:
        return load_model(init, dev, scratch=cfg)
    base_dtype = amp_dtype(dev, cfg["dtype"])
    model, tokenizer = load_model(init, torch.device("cpu") if base_dtype else dev, scratch=cfg)
    model = apply_lora(model, rank=cfg["lora_rank"], alpha=cfg["lora_alpha"], targets=cfg["lora_targets"],
                       base_dtype=base_dtype)
    return model.to(dev), tokenizer


def writer_hint(init):
    """Which command writes a missing toy checkpoint: out/<name>/ckpt is config/<name>.py's (when it exists)."""
    parts = os.path.normpath(init).split(os.sep)
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", f"{parts[-2]}.py") if len(parts) >= 2 else ""
    if parts[-1] == "ckpt" and os.path.exists(config):
        return f"python train.py config/{parts[-2]}.py writes {init}"
    return "for the toy base: python train.py config/toy_base.py"


def enable_grad_checkpointing(model):
    """Recompute each decoder block in the backward instead of keeping its activations. Only
    forwards with grad recompute: rollouts and teacher forwards (no grad) keep their KV cache.
    transformers also hooks the embeddings to make their output require grad, which reentrant
    checkpointing needs and its default, non-reentrant one does not; the hook breaks the compiled
    decode step's graph (dynamo cannot trace requires_grad_ in it), so it is taken off again."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def frozen_copy(model):
    """A copy of the model's weights in eval mode, without grad (the initial model, a teacher's own copy);
    of a sharded model (parallel=fsdp) a copy sharded alike, never whole on the device (sharded_copy)."""
    m = (sharded_copy(model) if is_sharded(model) else copy.deepcopy(model)).eval()
    m.requires_grad_(False)
    return m


# ----------------------------------------------------------------------------- LoRA (peft, optional)
# lora_rank > 0 trains low-rank adapters on the model's linear layers through peft, injected in place:
# the student stays the HF model train.py knows (body, LM head, cache), its adapted layers peft's
# LoraLayer. The teachers that need "the model without the adapter" get a view of it (base_view):
# the same base tensors, no second model in memory. The LM head is never adapted: the fused loss
# reads the head's weight itself (models.lm_head), and would miss an adapter's share of the logits.
LORA_ALL = "all-linear"  # peft's name for every linear layer but the output (LM head)


def check_lora_settings(cfg):
    """The LoRA knobs that need no model, checked with the rest of the config (one line each); peft
    is imported here, only when lora_rank > 0."""
    if not cfg["lora_rank"]:
        return
    require("peft", f"lora_rank={cfg['lora_rank']}")
    if not lora_target_names(cfg["lora_targets"]):
        raise UserError(f"lora_targets={cfg['lora_targets']!r} names no module: give comma-separated linear layer names "
                        f"(q_proj,v_proj) or '{LORA_ALL}'")
    if cfg["teacher_init"]:
        raise UserError("teacher_init mixes a checkpoint into the teacher's weights, but a LoRA teacher shares the "
                        "student's frozen base: set teacher_init='' with lora_rank > 0 (or train without LoRA)")
    if cfg["teacher"] == "frozen" and cfg["teacher_stage_reset"] == "student":
        raise UserError("teacher=frozen with LoRA is the base with the adapter off, which cannot become a copy of the "
                        "student: use teacher=ema --teacher_rate=0 (an adapter copy that stays put) for "
                        "teacher_stage_reset=student")
    if cfg["parallel"] == "fsdp":  # sharding a frozen base beside its adapters is not done
        raise UserError("lora_rank > 0 with parallel=fsdp is not supported: LoRA's state is small enough for data "
                        "parallelism (parallel=ddp), or train without LoRA")


def lora_target_names(targets):
    """'q_proj, v_proj' -> ['q_proj', 'v_proj']; 'all-linear' stays peft's one string."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    return LORA_ALL if names == [LORA_ALL] else names


def check_lora_targets(model, targets):
    """The modules lora_targets names (exact names or their last parts, as peft matches them), each a
    linear layer of the model and not its LM head; anything else is one line listing what it has."""
    names = lora_target_names(targets)
    if names == LORA_ALL:
        return names
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
    head = model.get_output_embeddings()
    modules = dict(model.named_modules())
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, (torch.nn.Linear, Conv1D))
                     and m is not head})
    for name in names:
        found = [m for n, m in modules.items() if n == name or n.endswith("." + name)]
        if any(m is head for m in found):
            raise UserError(f"lora_targets names {name}, the LM head: nanoSDPO never adapts it (the fused loss reads the "
                            f"head's weight itself): leave it out, or use '{LORA_ALL}' (which leaves it out)")
        wrong = next((m for m in found if not isinstance(m, (torch.nn.Linear, Conv1D))), None)
        if not found or wrong is not None:
            what = f"is a {type(wrong).__name__}, not a linear layer" if found else "names no module"
            raise UserError(f"lora_targets: {name!r} {what} of {type(model).__name__}: its linear layers are "
                            f"{', '.join(linear)} (or '{LORA_ALL}')")
    return names


def apply_lora(model, *, rank, alpha, targets, base_dtype=None):
    """The model with peft's LoRA adapters on `targets` (injected in place, and returned): only the
    adapters train, in fp32; every base weight is frozen, and stored in base_dtype when given (the
    autocast dtype: bf16 on CUDA, where every matmul casts to it anyway and a frozen weight needs no
    fp32 master copy). The adapters start at B = 0, so the model starts as the base exactly."""
    peft = require("peft", f"lora_rank={rank}")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=check_lora_targets(model, targets),
                             lora_dropout=0.0, bias="none")  # dropout off, as everywhere in RL (disable_dropout)
    peft.inject_adapter_in_model(config, model)
    for p in model.parameters():
        if p.requires_grad:  # an adapter weight
            p.data = p.data.float()
        elif base_dtype is not None:
            p.data = p.data.to(base_dtype)  # tied weights are one Parameter: cast once
    return model


def lora_layers(model):
    """{name: layer} of the model's LoRA-adapted layers; empty for a plain model (peft never imported)."""
    lora = sys.modules.get("peft.tuners.lora")
    return {} if lora is None else {n: m for n, m in model.named_modules() if isinstance(m, lora.LoraLayer)}


def _tree_view(module, replace):
    """A copy of the module tree that shares every parameter and buffer with the original; replace(m)
    gives the module to use in m's place (shared as it is), or None to copy m and walk on."""
    swapped = replace(module)
    if swapped is not None:
        return swapped
    clone = copy.copy(module)  # the attributes (config, flags) shared; the dicts below its own
    clone._parameters, clone._buffers = dict(module._parameters), dict(module._buffers)
    clone._modules = {k: None if m is None else _tree_view(m, replace) for k, m in module._modules.items()}
    return clone


def base_view(model):
    """A LoRA model without its adapters, as a model of its own: each adapted layer's base layer in
    its place, every tensor shared (nothing copied). It is peft's disable_adapter() as an object:
    the frozen teacher, the KL reference and trust-region's initial model under LoRA."""
    layers = lora_layers(model)
    ids = {id(m) for m in layers.values()}
    return _tree_view(model, lambda m: m.get_base_layer() if id(m) in ids else None)


def adapter_copy(model):
    """A LoRA model with its own frozen copy of the adapter weights and the base shared: the EMA
    teacher under LoRA (its update moves only the adapter copy; ema_update skips shared tensors)."""
    ids = {id(m) for m in lora_layers(model).values()}

    def own_adapter(m):
        if id(m) not in ids:
            return None
        clone = copy.copy(m)  # m's own dicts, every submodule shared ...
        clone._parameters, clone._buffers, clone._modules = dict(m._parameters), dict(m._buffers), dict(m._modules)
        for name in m.adapter_layer_names:  # ... but lora_A, lora_B (and peft's other adapter parts) copied
            clone._modules[name] = copy.deepcopy(m._modules[name]).requires_grad_(False)
        return clone
    return _tree_view(model, own_adapter)


@torch.no_grad()
def merged_state_dict(model):
    """A LoRA model's weights with each adapter folded in (W + scale · B @ A), under the plain model's
    names: what ckpt/ exports, servable without peft. A plain model: its state dict."""
    layers = lora_layers(model)
    if not layers:
        return model.state_dict()
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, layer in layers.items():
        base = layer.get_base_layer().weight
        state[f"{name}.weight"] = base.float() + layer.get_delta_weight(layer.active_adapters[0]).float()
    return state


@torch.no_grad()
def base_fingerprint(model):
    """Two numbers that change when a model's weights do (a LoRA model's: its frozen base): the sum and
    the sum of squares of its weights rounded to bf16 (so fp32 and bf16 copies of one model agree), in
    float64. One tensor at a time: a float64 copy of a whole 4B model would be 32 GB."""
    total, squares = 0.0, 0.0
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            t = p.detach().to(torch.bfloat16).double()
            total, squares = total + t.sum().item(), squares + t.square().sum().item()
    return [total, squares]


def adapter_tensors(model):
    """{name: parameter} of a LoRA model's adapter, named as peft's adapter_model.safetensors names it
    (PeftModel.from_pretrained loads the folder checkpoint.py writes)."""
    return {"base_model.model." + n.replace(".default.", "."): p for n, p in model.named_parameters() if ".lora_" in n}
