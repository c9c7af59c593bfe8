"""
nanoSDPO: on-policy post-training of language models (SFT, GRPO, SDPO) in one file.

    python train.py config/toy_base.py                 # SFT a toy model from scratch
    python train.py config/sdpo_toy.py --density=0.5   # any default below can be overridden

One iteration of the loop, in the order the code runs:
  1. rollout    sample `batch_prompts` prompts from the current stage's dataset and generate
                `group_size` responses to each (batched, KV-cached, left-padded prompts; each
                prompt is prefilled once and its cache shared by its group). The response mask
                keeps the first EOS and nothing after it. The log-probs under which each token
                was sampled are recorded: they are the "old" log-probs of the PPO / IS ratios.
  2. reward     reward(kind, response, answer) -> (score in [0,1], feedback or None).
  3. advantage  GRPO: A_i = r_i - mean(group), / (std(group)+eps) if norm_adv_std. Groups whose
                rewards are all equal carry no signal and are dropped from the GRPO loss.
  4. teacher    SDPO: each response gets a demonstration, the first successful peer of its group
                (never itself with dont_reprompt_on_self_success), and/or the feedback its own
                attempt received. The teacher reads: original prompt + demonstration (+ feedback)
                + "Correctly solve the original question.", through the chat template, followed
                by the student's *own response token ids* -- so teacher and student score the
                same tokens at the same positions. No demonstration and no feedback: no signal.
                The teacher's weights are `frozen` (initial model), `ema` (updated after every
                optimizer step: θ_T ← (1−τ)θ_T + τθ, τ = teacher_rate), `trust_region` (logits
                mixed (1−μ)·initial + μ·current, μ = teacher_rate) or `live` (current weights).
  5. loss       one student forward over prompt + response, then per response token:
                  sft   cross-entropy on the reference solution;
                  grpo  PPO-clip on ρ = exp(logπ − logπ_old), optional k3 KL to the initial model;
                  sdpo  D(student ‖ teacher) on the distillation mask = response × has-teacher ×
                        density mask (each token kept with probability `density`, redrawn every
                        step), weighted by min(ρ, is_clip) (detached), mixed with the GRPO loss by
                        grpo_mix. D: alpha=0 forward KL(q‖p), alpha=1 reverse KL(p‖q), else the
                        generalized JSD; over the full vocab, the student's top-k (+ a tail
                        bucket), or the sampled-token estimator sg(log p − log q)·log p.
                All of it goes through one fused, chunked LM-head loss (fused_loss=True) so no
                [tokens, vocab] logits tensor is ever materialised whole.
  6. step       AdamW, linear warmup then constant lr, grad clipping; then the teacher update.
  7. log        one line per iteration + out_dir/log.jsonl; periodic eval (mean@n) and atomic
                HF-format checkpoints that `init_from="resume"` continues exactly.
Continual post-training: `stages="toy/add:200,toy/mul:200"` runs those datasets in turn,
carrying the model (and optimizer unless reset_optimizer); after each stage every eval set is
scored and a row is appended to out_dir/accuracy_matrix.json, and a model snapshot is kept.

Simplifications, on purpose:
  - One on-policy update per batch (no PPO epochs): the ratio ρ differs from 1 only by the
    numerical gap between the sampling forward (KV cache) and the training forward.
  - Old log-probs are the temperature-scaled log-softmax at the sampled token; top_p truncation
    is not folded in (train with top_p=1, as the paper does).
  - Token-mean losses divide by the token count of the whole step (all micro-batches), so the
    step size does not depend on how the batch is split.
  - Generation is plain HF forward calls with a DynamicCache; no vLLM, no paged attention.
"""
import contextlib
import copy
import functools
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- defaults
# Every line `name = value  # help` below is a config key: config files and --name=value
# override them (configurator.py), `python train.py --help` lists them with this help text.
# I/O
out_dir = "out/run"  # where logs, checkpoints and snapshots go
init_from = "scratch"  # 'scratch' (toy model from the config below), 'resume', or an HF folder / hub id
tokenizer_path = "data/toy/tokenizer"  # tokenizer for init_from='scratch'
data_dir = "data"  # datasets live in data_dir/<name>/{train,test}.jsonl
dataset = "toy/add"  # training set; several joined with '+' are mixed
stages = ""  # continual training: 'name:iters,name:iters,...' (overrides dataset and max_iters)
eval_sets = ""  # comma-separated test sets scored at eval time ('' = the training set)
eval_interval = 25  # iterations between evals (0 = only at the start and end of each stage)
eval_n = 4  # samples per test prompt for mean@n / pass@n
eval_max_prompts = 100  # test prompts per set (0 = all)
eval_temperature = 0.6  # sampling temperature at eval
eval_top_p = 0.95  # nucleus sampling at eval
save_interval = 0  # iterations between checkpoints (0 = at each eval)
log_jsonl = True  # append every iteration's metrics to out_dir/log.jsonl
wandb_log = False  # also log to Weights & Biases (pip install wandb)
wandb_project = "nanosdpo"  # wandb project name
wandb_run_name = "run"  # wandb run name
seed = 1337  # seeds python, torch, data order, sampling and density masks
device = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = "auto"  # 'auto' (bfloat16 on CUDA, float32 on CPU), 'float32', 'bfloat16'
enable_thinking = False  # passed to the chat template (Qwen3: thinking off, the paper's setting)
# model built by init_from='scratch' (a small Qwen2-architecture model)
n_layer = 4  # transformer blocks
n_head = 4  # attention heads
n_embd = 128  # hidden size
block_size = 256  # max positions
# algorithm and batch
algo = "grpo"  # 'sft', 'grpo' or 'sdpo'
max_iters = 100  # iterations (one optimizer step each)
batch_prompts = 32  # prompts per iteration
group_size = 8  # responses per prompt
micro_batch_size = 64  # sequences per forward/backward (gradient accumulation over the rest)
max_new_tokens = 64  # response length cap
temperature = 1.0  # rollout sampling temperature (also divides the training logits)
top_p = 1.0  # rollout nucleus sampling
# optimizer
learning_rate = 1e-5  # AdamW lr after warmup (constant)
warmup_iters = 10  # linear warmup steps
weight_decay = 0.01  # AdamW weight decay
beta1 = 0.9  # AdamW beta1
beta2 = 0.999  # AdamW beta2
grad_clip = 1.0  # clip the global grad norm (0 = off)
# GRPO
norm_adv_std = False  # divide advantages by the group's std (+eps)
clip_low = 0.2  # PPO clip: ratio >= 1 - clip_low
clip_high = 0.28  # PPO clip: ratio <= 1 + clip_high
kl_coef = 0.0  # k3 KL to the initial model (0 = off, no reference forward)
loss_agg = "token-mean"  # 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'
# SDPO: teacher context
success_threshold = 1.0  # reward at which a response counts as a successful demonstration
dont_reprompt_on_self_success = True  # a response never gets itself as its demonstration
remove_thinking = True  # strip <think>...</think> from demonstrations
use_feedback = False  # add the reward function's feedback on the response's own attempt
feedback_only_without_solution = True  # ...but only when there is no successful peer
reprompt_template = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."  # teacher user turn
solution_template = "\n\nCorrect solution:\n\n{solution}"  # how the demonstration is shown
feedback_template = "\n\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}"  # how feedback is shown
max_reprompt_len = 4096  # teacher prompt tokens; longer ones keep their last max_reprompt_len tokens
# SDPO: teacher and divergence
teacher = "ema"  # 'frozen', 'ema', 'trust_region' or 'live'
teacher_rate = 0.05  # ema: τ per optimizer step; trust_region: μ, the weight of the current model
teacher_init = ""  # optional HF folder / hub id mixed into the initial teacher weights
teacher_init_alpha = 0.0  # weight of teacher_init in that mix
alpha = 0.5  # 0 = forward KL(q‖p), 1 = reverse KL(p‖q), between = generalized JSD
distill = "topk"  # 'topk', 'full' or 'token' (sampled-token estimator, reverse KL)
topk = 100  # student top-k support for distill='topk'
tail = True  # add a tail bucket with the remaining mass (else renormalise over the top-k)
is_clip = 2.0  # clip of the detached IS weight on the distillation loss (0 = off)
density = 1.0  # expected fraction of response tokens that get the distillation loss, in (0, 1]
grpo_mix = 0.0  # loss = (1 - grpo_mix)·distill + grpo_mix·grpo
fused_loss = True  # chunked LM-head loss with a hand-written backward (False: full logits)
loss_chunk = 256  # tokens per chunk of the fused loss
# continual training
teacher_stage_reset = "keep"  # at a stage boundary the teacher: 'keep', 'student' (copy) or 'initial'
reset_optimizer = False  # fresh AdamW state at each stage
stop_on_collapse = True  # stop (keeping the last good checkpoint) on NaN/inf or a collapse
collapse_patience = 3  # evals in a row with zero accuracy on the training set that count as a collapse
# -----------------------------------------------------------------------------

CHOICES = {
    "algo": ("sft", "grpo", "sdpo"),
    "teacher": ("frozen", "ema", "trust_region", "live"),
    "distill": ("topk", "full", "token"),
    "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "teacher_stage_reset": ("keep", "student", "initial"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
}
RANGES = {  # key: (low, high, low inclusive)
    "density": (0.0, 1.0, False), "alpha": (0.0, 1.0, True), "teacher_rate": (0.0, 1.0, True),
    "teacher_init_alpha": (0.0, 1.0, True), "grpo_mix": (0.0, 1.0, True), "top_p": (0.0, 1.0, False),
    "eval_top_p": (0.0, 1.0, False), "success_threshold": (0.0, 1.0, True),
}
POSITIVE = ("max_iters", "batch_prompts", "group_size", "micro_batch_size", "max_new_tokens", "topk",
            "loss_chunk", "n_layer", "n_head", "n_embd", "block_size", "eval_n", "max_reprompt_len")


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 1, nothing half-written."""


def check_config(cfg):
    """Validate values that a type check cannot: choices, ranges, formats."""
    for key, options in CHOICES.items():
        if cfg[key] not in options:
            raise UserError(f"{key}={cfg[key]!r} is not one of {', '.join(options)}")
    for key, (low, high, low_ok) in RANGES.items():
        v = cfg[key]
        if not ((v >= low if low_ok else v > low) and v <= high):
            raise UserError(f"{key}={v} is out of range {'[' if low_ok else '('}{low}, {high}]")
    for key in POSITIVE:
        if cfg[key] <= 0:
            raise UserError(f"{key}={cfg[key]} must be positive")
    for key in ("temperature", "eval_temperature"):
        if cfg[key] <= 0:
            raise UserError(f"{key}={cfg[key]} must be > 0 (sampling needs a temperature)")
    if cfg["algo"] != "sft" and cfg["group_size"] < 2:
        raise UserError(f"group_size={cfg['group_size']} must be >= 2 for {cfg['algo']} (advantages and peers need a group)")
    parse_stages(cfg["stages"], cfg["dataset"], cfg["max_iters"])


def parse_stages(stages, dataset, max_iters):
    """'a:100,b:50' -> [('a', 100), ('b', 50)]; '' -> [(dataset, max_iters)]."""
    if not stages:
        return [(dataset, max_iters)]
    out = []
    for part in stages.split(","):
        name, sep, iters = part.strip().rpartition(":")
        if not sep or not name or not iters.isdigit() or int(iters) <= 0:
            raise UserError(f"stages entry {part!r} is not 'dataset:iters' (e.g. stages='toy/add:200,toy/mul:200')")
        out.append((name, int(iters)))
    return out


# ----------------------------------------------------------------------------- data
def load_tasks(name, split, data_dir="data"):
    """Read data_dir/<name>/<split>.jsonl ('a+b' mixes sets). Errors name the fix."""
    tasks = []
    for part in name.split("+"):
        path = os.path.join(data_dir, part, f"{split}.jsonl")
        if not os.path.exists(path):
            prepare = os.path.join(data_dir, part.split("/")[0], "prepare.py")
            raise UserError(f"{path} not found: run `python {prepare}` first")
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    task = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                missing = [k for k in ("kind", "messages", "answer") if k not in task] if isinstance(task, dict) else ["an object"]
                if missing:
                    raise UserError(f"{path}:{lineno}: missing {', '.join(missing)} (see DESIGN.md's data schema)")
                tasks.append(task)
    if not tasks:
        raise UserError(f"{name} ({split}) has no tasks")
    return tasks


def prompt_ids(tokenizer, messages, enable_thinking=False):
    """Chat-template a prompt (with the assistant generation prefix) to token ids."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    return tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- rewards
from _rewards import reward, extract_boxed  # noqa: E402  (TEMPORARY: inlined below before release)

# ----------------------------------------------------------------------------- rollout
@dataclass
class Rollout:
    """A batch of generated responses; row i answers prompt i // group_size."""
    prompt_ids: list  # list[list[int]] per row (unpadded)
    response_ids: list  # list[list[int]] per row, up to and including the first EOS
    old_logprobs: list  # list[Tensor [len(response)]] sampling log-probs of those tokens
    texts: list  # decoded responses (special tokens removed)
    truncated: list  # bool per row: hit max_new_tokens before EOS


def sample_top_p(logits, temperature, top_p, generator):
    """Sample one token per row; also return its log-prob under softmax(logits / temperature)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logprobs.exp()
    if top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


def response_mask(tokens, eos_id):
    """[B, T] -> bool mask that keeps every token up to and including the first EOS, nothing after."""
    is_eos = tokens == eos_id
    eos_before = is_eos.cumsum(-1) - is_eos.long()  # EOS count strictly before each position
    return eos_before == 0


@torch.no_grad()
def generate(model, prompts, group_size, max_new_tokens, temperature, top_p, eos_id, pad_id, generator):
    """Sample `group_size` responses to each prompt (list of token-id lists).

    Prompts are left-padded and prefilled once; the KV cache is then repeated for the group, and
    decoding stops as soon as every row has produced EOS."""
    from transformers import DynamicCache
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = model(ids, mask, position, cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    mask = mask.repeat_interleave(group_size, 0)
    position = position[:, -1:].repeat_interleave(group_size, 0)
    rows = logits.shape[0]
    tokens, logps = [], []
    done = torch.zeros(rows, dtype=torch.bool, device=dev)
    for _ in range(max_new_tokens):
        token, logp = sample_top_p(logits, temperature, top_p, generator)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logps.append(logp)
        done |= token == eos_id
        if done.all():
            break
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        position = position + 1
        logits = model(token[:, None], mask, position, cache, use_cache=True).logits[:, -1]
    tokens, logps = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu()
    keep = response_mask(tokens, eos_id)
    lengths = keep.sum(-1).tolist()
    response_ids = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
    return Rollout(
        prompt_ids=[p for p in prompts for _ in range(group_size)],
        response_ids=response_ids,
        old_logprobs=[logps[i, :n] for i, n in enumerate(lengths)],
        texts=None,
        truncated=[eos_id not in r for r in response_ids],
    )


def decode_responses(tokenizer, rollout):
    rollout.texts = tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    return rollout.texts


# ----------------------------------------------------------------------------- advantages
def group_advantages(rewards, group_size, norm_std, eps=1e-6):
    """GRPO: reward minus its group's mean (optionally / group std). rewards: [B*G]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(-1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv.view(-1)


# ----------------------------------------------------------------------------- teacher context
def strip_thinking(text):
    """Drop <think>...</think> blocks (and an unclosed trailing one) from a demonstration."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    return text.split("<think>")[0].strip()


def pick_peer(rewards, group_size, i, threshold, dont_reprompt_on_self_success):
    """Index of the first successful response in row i's group, or None.

    The first (a random one: rollouts are i.i.d.), not the shortest: choosing the shortest
    demonstration pushes the student towards ever shorter answers."""
    start = (i // group_size) * group_size
    for j in range(start, start + group_size):
        if rewards[j] >= threshold and not (dont_reprompt_on_self_success and j == i):
            return j
    return None


def teacher_prompt_text(question, peer, feedback, reprompt_template, solution_template, feedback_template):
    """The teacher's user turn: the question, a demonstration and/or feedback, the instruction."""
    solution = solution_template.format(solution=peer) if peer is not None else ""
    fb = feedback_template.format(feedback=feedback) if feedback is not None else ""
    return reprompt_template.format(prompt=question, solution=solution, feedback=fb)


def teacher_contexts(tasks, rollout, rewards, feedbacks, group_size, cfg):
    """Per rollout row: the teacher's chat messages, or None when it has no signal."""
    out = []
    for i in range(len(rollout.response_ids)):
        j = pick_peer(rewards, group_size, i, cfg["success_threshold"], cfg["dont_reprompt_on_self_success"])
        peer = None
        if j is not None:
            peer = strip_thinking(rollout.texts[j]) if cfg["remove_thinking"] else rollout.texts[j]
        feedback = None
        if cfg["use_feedback"] and feedbacks[i] and not (cfg["feedback_only_without_solution"] and peer is not None):
            feedback = feedbacks[i]
        if peer is None and feedback is None:
            out.append(None)
            continue
        messages = copy.deepcopy(tasks[i // group_size]["messages"])
        messages[-1]["content"] = teacher_prompt_text(messages[-1]["content"], peer, feedback, cfg["reprompt_template"],
                                                      cfg["solution_template"], cfg["feedback_template"])
        out.append(messages)
    return out


# ----------------------------------------------------------------------------- losses
from _fused import distill_divergence, fused_token_loss, naive_token_loss, sampled_logprobs  # noqa: E402,F401  (TEMPORARY)


@dataclass
class TokenBatch:
    """Per response token of a micro-batch (rows of the fused loss), everything the loss reads."""
    tokens: torch.Tensor  # [N] sampled / target token ids
    old_logp: torch.Tensor  # [N] log-probs at sampling time (ratios)
    ref_logp: torch.Tensor  # [N] initial-model log-probs (k3 KL), or None
    advantage: torch.Tensor  # [N] the row's sequence advantage
    pg_weight: torch.Tensor  # [N] aggregation weight of the GRPO / SFT term (0 = not in it)
    distill_weight: torch.Tensor  # [N] distillation mask × normaliser × (1 − grpo_mix)


def make_loss_fn(tb, algo, clip_low, clip_high, kl_coef, is_clip, distill):
    """Per-token loss on the student's log-prob of each token (logp), the divergence to the
    teacher (div) and the teacher's log-prob (teacher_logp); `rows` selects this chunk's rows."""
    def loss_fn(logp, div, teacher_logp, rows):
        w_pg, w_d = tb.pg_weight[rows], tb.distill_weight[rows]
        if algo == "sft":
            return -(w_pg * logp).sum()
        ratio = torch.exp(logp - tb.old_logp[rows])
        adv = tb.advantage[rows]
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
        if kl_coef > 0:
            log_r = tb.ref_logp[rows] - logp
            pg = pg + kl_coef * (torch.exp(log_r) - log_r - 1)  # k3 estimator of KL(π‖π_ref)
        loss = (w_pg * pg).sum()
        if algo == "sdpo":
            is_w = ratio.detach().clamp(max=is_clip) if is_clip > 0 else 1.0
            if distill == "token":  # sampled-token estimator of reverse KL: advantage = log q − log p
                div = (logp - teacher_logp).detach() * logp
            loss = loss + (w_d * is_w * div).sum()
        return loss
    return loss_fn


def grpo_weights(n_tokens, keep, loss_agg, max_new_tokens):
    """Per-token aggregation weights of the GRPO term over the whole step.

    n_tokens: response length of each sequence; keep: bool per sequence (has signal)."""
    kept = [n for n, k in zip(n_tokens, keep) if k]
    total, n_seq = max(sum(kept), 1), max(len(kept), 1)
    weights = []
    for n, k in zip(n_tokens, keep):
        if not k:
            w = 0.0
        elif loss_agg == "token-mean":
            w = 1.0 / total
        elif loss_agg == "seq-mean-token-mean":
            w = 1.0 / (n * n_seq)
        else:  # seq-mean-token-sum-norm (Dr. GRPO): a constant length normaliser
            w = 1.0 / (max_new_tokens * n_seq)
        weights.append(torch.full((n,), w))
    return weights


def density_masks(n_tokens, density, generator):
    """Bernoulli(density) keep-mask per response token (density=1: all kept)."""
    if density >= 1.0:
        return [torch.ones(n, dtype=torch.bool) for n in n_tokens]
    return [torch.rand(n, generator=generator) < density for n in n_tokens]


# ----------------------------------------------------------------------------- model helpers
def hidden_states(model, sequences, dev):
    """Right-pad sequences, run the decoder body, return hidden states [B, T, H]."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state


def response_rows(hidden, prompt_lens, response_lens):
    """Gather the hidden states that predict each response token: positions p-1 .. p+n-2."""
    rows = [hidden[i, p - 1:p - 1 + n] for i, (p, n) in enumerate(zip(prompt_lens, response_lens))]
    return torch.cat(rows, 0)


def lm_head_weight(model):
    return model.get_output_embeddings().weight


@torch.no_grad()
def ema_update(teacher_model, student_model, rate):
    """θ_T ← (1 − rate)·θ_T + rate·θ, once per optimizer step."""
    t = [p for p in teacher_model.parameters()]
    s = [p.detach() for p in student_model.parameters()]
    torch._foreach_lerp_(t, s, rate)


@torch.no_grad()
def mix_weights(target_model, other_model, weight):
    """target ← (1 − weight)·target + weight·other (teacher_init_alpha)."""
    ema_update(target_model, other_model, weight)


def build_char_tokenizer_path_check(path):
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        raise UserError(f"{path} has no tokenizer: run `python data/toy/prepare.py` first")


def load_model(init, cfg, dev, torch_dtype):
    """Return (model, tokenizer) for 'scratch', or an HF folder / hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    if init == "scratch":
        build_char_tokenizer_path_check(cfg["tokenizer_path"])
        tokenizer = AutoTokenizer.from_pretrained(cfg["tokenizer_path"])
        torch.manual_seed(cfg["seed"])
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg["n_embd"], intermediate_size=4 * cfg["n_embd"],
                             num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
                             num_key_value_heads=cfg["n_head"], max_position_embeddings=cfg["block_size"],
                             tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        model = Qwen2ForCausalLM(config)
    else:
        if os.path.isdir(init) and not os.path.exists(os.path.join(init, "config.json")):
            raise UserError(f"{init} is not a model folder (no config.json): point init_from at a checkpoint folder")
        tokenizer = AutoTokenizer.from_pretrained(init)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch_dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(dev, torch_dtype), tokenizer


# ----------------------------------------------------------------------------- evaluation
def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@torch.no_grad()
def evaluate(model, tokenizer, tasks, n, temperature, top_p, max_new_tokens, batch_prompts, generator,
             enable_thinking=False, success_threshold=1.0, progress=False):
    """Sample n responses per task; return mean@n, pass@n, mean length, and per-task scores/texts."""
    from tqdm import tqdm
    was_training = model.training
    model.eval()
    scores, texts, lengths = [], [], []
    starts = range(0, len(tasks), batch_prompts)
    for start in tqdm(starts, desc="eval", disable=not progress, leave=False):
        chunk = tasks[start:start + batch_prompts]
        prompts = [prompt_ids(tokenizer, t["messages"], enable_thinking) for t in chunk]
        rollout = generate(model, prompts, n, max_new_tokens, temperature, top_p,
                           tokenizer.eos_token_id, tokenizer.pad_token_id, generator)
        decode_responses(tokenizer, rollout)
        for i, task in enumerate(chunk):
            rows = range(i * n, (i + 1) * n)
            scores.append([reward(task["kind"], rollout.texts[r], task["answer"])[0] for r in rows])
            texts.append([rollout.texts[r] for r in rows])
            lengths.extend(len(rollout.response_ids[r]) for r in rows)
    model.train(was_training)
    correct = [sum(s >= success_threshold for s in row) for row in scores]
    return {
        f"mean@{n}": sum(map(sum, scores)) / (n * len(scores)),
        f"pass@{n}": sum(pass_at_k(n, c, n) for c in correct) / len(correct),
        "mean_len": sum(lengths) / len(lengths),
        "scores": scores,
        "texts": texts,
    }


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(path, model, tokenizer, optimizer, teacher_model, state, rng_tensors):
    """An HF model folder plus trainer state, written to a temp folder and swapped in."""
    from safetensors.torch import save_file, save_model
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    opt = optimizer.state_dict()
    tensors = {f"{i}.{k}": v.contiguous() for i, s in opt["state"].items() for k, v in s.items()}
    save_file({**tensors, **{f"rng.{k}": v for k, v in rng_tensors.items()}}, os.path.join(tmp, "trainer_state.safetensors"))
    if teacher_model is not None:
        save_model(teacher_model, os.path.join(tmp, "teacher.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({**state, "param_groups": opt["param_groups"]}, f, indent=1)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load_trainer_state(path, optimizer, teacher_model):
    """Inverse of save_checkpoint for the parts that are not the HF model: returns (state, rng tensors)."""
    from safetensors.torch import load_file, load_model as load_weights
    state_path = os.path.join(path, "state.json")
    if not os.path.exists(state_path):
        raise UserError(f"{path} is not a nanoSDPO checkpoint (no state.json): cannot resume; start with init_from=scratch or an HF model")
    with open(state_path) as f:
        state = json.load(f)
    tensors = load_file(os.path.join(path, "trainer_state.safetensors"))
    opt_state = {}
    for key, value in tensors.items():
        if not key.startswith("rng."):
            i, name = key.split(".", 1)
            opt_state.setdefault(int(i), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state.pop("param_groups")})
    if teacher_model is not None:
        load_weights(teacher_model, os.path.join(path, "teacher.safetensors"))
    return state, {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}


# ----------------------------------------------------------------------------- one optimizer step's loss
def response_hidden(model, prompts, responses, dev):
    """Hidden states predicting each response token, for prompt+response sequences: [Σn, H]."""
    h = hidden_states(model, [p + r for p, r in zip(prompts, responses)], dev)
    return response_rows(h, [len(p) for p in prompts], [len(r) for r in responses])


def teacher_parts(mode, rate, model, teacher_model, initial_model, teacher_prompts, responses, dev):
    """Teacher logits as [(hidden [N,H], lm weight, coef)], rows of samples without a teacher
    prompt left at zero (they are outside div_rows, so never read). No grad."""
    has = [i for i, t in enumerate(teacher_prompts) if t is not None]
    lengths = [len(r) for r in responses]
    offsets = [0] + list(itertools.accumulate(lengths))

    def rows(m):
        h = response_hidden(m, [teacher_prompts[i] for i in has], [responses[i] for i in has], dev)
        full = h.new_zeros(offsets[-1], h.shape[-1])
        at = 0
        for i in has:
            full[offsets[i]:offsets[i + 1]] = h[at:at + lengths[i]]
            at += lengths[i]
        return full

    with torch.no_grad():
        if mode in ("frozen", "ema"):
            return [(rows(teacher_model), lm_head_weight(teacher_model), 1.0)]
        if mode == "live":
            return [(rows(model), lm_head_weight(model).detach(), 1.0)]
        return [(rows(initial_model), lm_head_weight(initial_model), 1.0 - rate),  # trust_region
                (rows(model), lm_head_weight(model).detach(), rate)]


def loss_backward(model, batch, cfg, dev, teacher_model=None, initial_model=None, autocast=None):
    """Forward + backward over the sequences of one optimizer step, in micro-batches.

    batch: dict of per-sequence lists: prompts, responses (token ids), old_logp, advantage,
    pg_weight and distill_weight ([n] tensors already normalised over the whole step), and
    teacher_prompts (token ids or None). Sequences with no weight anywhere are skipped.
    Returns summed metrics."""
    autocast = autocast or contextlib.nullcontext
    use = [i for i in range(len(batch["responses"]))
           if batch["pg_weight"][i].any() or batch["distill_weight"][i].any()]
    use.sort(key=lambda i: len(batch["prompts"][i]) + len(batch["responses"][i]), reverse=True)  # less padding
    metrics = {"loss": 0.0, "div_sum": 0.0, "teacher_minus_student_sum": 0.0, "distill_tokens": 0}
    loss_impl = functools.partial(fused_token_loss, chunk_size=cfg["loss_chunk"]) if cfg["fused_loss"] else naive_token_loss
    weight = lm_head_weight(model)
    for start in range(0, len(use), cfg["micro_batch_size"]):
        idx = use[start:start + cfg["micro_batch_size"]]
        pick = lambda key: [batch[key][i] for i in idx]  # noqa: E731
        prompts, responses = pick("prompts"), pick("responses")
        tokens = torch.tensor([t for r in responses for t in r], device=dev)
        lengths = [len(r) for r in responses]
        tb = TokenBatch(
            tokens=tokens,
            old_logp=torch.cat(pick("old_logp")).to(dev),
            ref_logp=None,
            advantage=torch.cat([torch.full((n,), float(a)) for n, a in zip(lengths, pick("advantage"))]).to(dev),
            pg_weight=torch.cat(pick("pg_weight")).to(dev),
            distill_weight=torch.cat(pick("distill_weight")).to(dev),
        )
        parts, div_rows = None, None
        with autocast():
            if cfg["kl_coef"] > 0 and cfg["algo"] != "sft":
                with torch.no_grad():
                    h0 = response_hidden(initial_model, prompts, responses, dev)
                    tb.ref_logp = sampled_logprobs(h0, lm_head_weight(initial_model), tokens, cfg["temperature"], cfg["loss_chunk"])
            div_rows = tb.distill_weight > 0
            if cfg["algo"] == "sdpo" and div_rows.any():
                tprompts = [t if w.any() else None for t, w in zip(pick("teacher_prompts"), pick("distill_weight"))]
                parts = teacher_parts(cfg["teacher"], cfg["teacher_rate"], model, teacher_model, initial_model,
                                      tprompts, responses, dev)
            h = response_hidden(model, prompts, responses, dev)
        temperature = 1.0 if cfg["algo"] == "sft" else cfg["temperature"]
        loss_fn = make_loss_fn(tb, cfg["algo"], cfg["clip_low"], cfg["clip_high"], cfg["kl_coef"], cfg["is_clip"], cfg["distill"])
        loss, stats = loss_impl(h, weight, tokens, loss_fn, teacher=parts, div_rows=div_rows if parts else None,
                                alpha=cfg["alpha"], distill=cfg["distill"], topk=cfg["topk"], tail=cfg["tail"],
                                temperature=temperature)
        loss.backward()
        metrics["loss"] += loss.item()
        if parts:
            metrics["div_sum"] += stats["div"][div_rows].sum().item()
            metrics["teacher_minus_student_sum"] += (stats["teacher_logp"] - stats["logp"])[div_rows].sum().item()
            metrics["distill_tokens"] += int(div_rows.sum())
    return metrics


# ----------------------------------------------------------------------------- one iteration
def build_batch(tasks, model, tokenizer, cfg, generator, dev, autocast=contextlib.nullcontext):
    """Rollout → reward → advantage → teacher context for one iteration's prompts.

    Returns (batch for loss_backward, metrics). For algo='sft' the "responses" are the
    reference solutions."""
    eos = tokenizer.eos_token_id
    prompts = [prompt_ids(tokenizer, t["messages"], cfg["enable_thinking"]) for t in tasks]
    if cfg["algo"] == "sft":
        responses = [tokenizer.encode(t["solution"], add_special_tokens=False) + [eos] for t in tasks]
        lengths = [len(r) for r in responses]
        total = sum(lengths)
        return ({"prompts": prompts, "responses": responses, "old_logp": [torch.zeros(n) for n in lengths],
                 "advantage": [0.0] * len(tasks), "pg_weight": [torch.full((n,), 1.0 / total) for n in lengths],
                 "distill_weight": [torch.zeros(n) for n in lengths], "teacher_prompts": [None] * len(tasks)},
                {"tokens": total})
    G = cfg["group_size"]
    t0 = time.time()
    with autocast():
        rollout = generate(model, prompts, G, cfg["max_new_tokens"], cfg["temperature"], cfg["top_p"],
                           eos, tokenizer.pad_token_id, generator)
    decode_responses(tokenizer, rollout)
    t_gen = time.time() - t0
    scored = [reward(tasks[i // G]["kind"], text, tasks[i // G]["answer"]) for i, text in enumerate(rollout.texts)]
    rewards = torch.tensor([s for s, _ in scored], dtype=torch.float32)
    feedbacks = [f for _, f in scored]
    advantages = group_advantages(rewards, G, cfg["norm_adv_std"])
    lengths = [len(r) for r in rollout.response_ids]
    # zero-signal groups are dropped from the GRPO term (unless a KL term still needs them)
    keep = [bool(a != 0) or cfg["kl_coef"] > 0 for a in advantages.tolist()]
    pg_scale = cfg["grpo_mix"] if cfg["algo"] == "sdpo" else 1.0
    pg_weight = [w * pg_scale for w in grpo_weights(lengths, keep, cfg["loss_agg"], cfg["max_new_tokens"])]
    teacher_prompts, distill_weight = [None] * len(lengths), [torch.zeros(n) for n in lengths]
    metrics = {}
    if cfg["algo"] == "sdpo":
        contexts = teacher_contexts(tasks, rollout, rewards.tolist(), feedbacks, G, cfg)
        teacher_prompts, truncated = [], 0
        for ctx in contexts:
            ids = None if ctx is None else prompt_ids(tokenizer, ctx, cfg["enable_thinking"])
            if ids is not None and len(ids) > cfg["max_reprompt_len"]:
                ids, truncated = ids[-cfg["max_reprompt_len"]:], truncated + 1
            teacher_prompts.append(ids)
        masks = density_masks(lengths, cfg["density"], generator)
        masks = [m if t is not None else torch.zeros_like(m) for m, t in zip(masks, teacher_prompts)]
        n_distill = sum(int(m.sum()) for m in masks)
        distill_weight = [m.float() * (1 - cfg["grpo_mix"]) / max(n_distill, 1) for m in masks]
        metrics.update(peer_frac=sum(t is not None for t in teacher_prompts) / len(lengths),
                       distill_frac=n_distill / max(sum(lengths), 1), reprompt_truncated=truncated)
    successes = (rewards >= cfg["success_threshold"]).view(-1, G)
    metrics.update(reward=rewards.mean().item(), acc=successes.float().mean().item(),
                   group_success=successes.any(-1).float().mean().item(),
                   zero_signal_groups=(advantages.view(-1, G) == 0).all(-1).float().mean().item(),
                   resp_len=sum(lengths) / len(lengths), truncated=sum(rollout.truncated) / len(lengths),
                   tokens=sum(lengths), gen_s=t_gen, gen_tok_s=sum(lengths) / max(t_gen, 1e-9))
    batch = {"prompts": rollout.prompt_ids, "responses": rollout.response_ids, "old_logp": rollout.old_logprobs,
             "advantage": advantages.tolist(), "pg_weight": pg_weight, "distill_weight": distill_weight,
             "teacher_prompts": teacher_prompts}
    return batch, metrics


def set_lr(optimizer, it, learning_rate, warmup_iters):
    lr = learning_rate * min(1.0, (it + 1) / warmup_iters) if warmup_iters > 0 else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


class Collapse(Exception):
    """Training diverged or collapsed; the last good checkpoint is kept."""


def optimizer_step(model, optimizer, grad_clip):
    """Clip and step; refuse (raise Collapse) on a non-finite gradient."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise Collapse(f"gradient norm is {norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()


# ----------------------------------------------------------------------------- main loop
def pick_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_autocast(dev, dtype_name):
    """bf16/fp16 autocast on CUDA (params and optimizer stay fp32); a no-op on CPU / float32."""
    dt = {"auto": torch.bfloat16 if dev.type == "cuda" else None, "float32": None,
          "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    if dt is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, dev.type, dtype=dt)


def frozen_copy(model):
    m = copy.deepcopy(model).eval()
    m.requires_grad_(False)
    return m


def main(cfg):
    check_config(cfg)
    from tqdm import tqdm  # noqa: F401  (progress bars live in evaluate / prepare scripts)
    dev = pick_device(cfg["device"])
    autocast = make_autocast(dev, cfg["dtype"])
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    stage_list = parse_stages(cfg["stages"], cfg["dataset"], cfg["max_iters"])
    out_dir, ckpt_dir = cfg["out_dir"], os.path.join(cfg["out_dir"], "ckpt")
    resume = cfg["init_from"] == "resume"
    if resume and not os.path.exists(os.path.join(ckpt_dir, "state.json")):
        raise UserError(f"init_from=resume but {ckpt_dir} is not a nanoSDPO checkpoint (no state.json): "
                        "set out_dir to the run to continue")
    state = {"iter": 0, "stage": 0, "stage_iter": 0, "zero_acc_evals": 0, "accuracy_matrix": None, "base_init": cfg["init_from"]}
    if resume:
        with open(os.path.join(ckpt_dir, "state.json")) as f:
            state["base_init"] = json.load(f)["base_init"]
    model, tokenizer = load_model(ckpt_dir if resume else cfg["init_from"], cfg, dev, torch.float32)
    # train every tensor the model has -- one copy of tied weights
    model.train()
    # the initial model: KL reference, frozen / trust-region teacher, 'initial' stage reset
    needs_initial = (cfg["algo"] != "sft" and cfg["kl_coef"] > 0) or (cfg["algo"] == "sdpo" and (
        cfg["teacher"] in ("frozen", "trust_region") or cfg["teacher_stage_reset"] == "initial"))
    initial_model = None
    if needs_initial:
        initial_model = frozen_copy(model) if not resume else frozen_copy(load_model(state["base_init"], cfg, dev, torch.float32)[0])
    teacher_model = None
    if cfg["algo"] == "sdpo" and cfg["teacher"] in ("frozen", "ema"):
        teacher_model = frozen_copy(initial_model if initial_model is not None else model)
        if cfg["teacher_init"] and not resume:
            mix_weights(teacher_model, load_model(cfg["teacher_init"], cfg, dev, torch.float32)[0], cfg["teacher_init_alpha"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                                  weight_decay=cfg["weight_decay"])
    generator = torch.Generator().manual_seed(cfg["seed"])  # sampling and density masks
    data_rng = random.Random(cfg["seed"])  # prompt order
    if resume:
        saved, rng = load_trainer_state(ckpt_dir, optimizer, teacher_model)
        state.update(saved)
        generator.set_state(rng["sampling"])
        data_rng.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["data_rng"]))
        print(f"resumed from {ckpt_dir} at iteration {state['iter']} (stage {state['stage']}, step {state['stage_iter']})")
    os.makedirs(out_dir, exist_ok=True)
    eval_names = [s for s in cfg["eval_sets"].split(",") if s] or [n for n, _ in stage_list for n in n.split("+")]
    eval_names = list(dict.fromkeys(eval_names))
    eval_tasks = {}
    for name in eval_names:
        tasks = load_tasks(name, "test", cfg["data_dir"])
        eval_tasks[name] = tasks[:cfg["eval_max_prompts"]] if cfg["eval_max_prompts"] > 0 else tasks
    wandb = None
    if cfg["wandb_log"]:
        try:
            import wandb
        except ImportError:
            raise UserError("wandb_log=True but wandb is not installed: pip install wandb") from None
        wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"], config=cfg)

    def log(record):
        if cfg["log_jsonl"]:
            with open(os.path.join(out_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        if wandb:
            wandb.log(record, step=record["iter"])

    def run_eval(tag):
        """Score every eval set; returns {set: mean@n}."""
        eval_gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # same samples each time: comparable
        row = {}
        for name, tasks in eval_tasks.items():
            with autocast():
                res = evaluate(model, tokenizer, tasks, cfg["eval_n"], cfg["eval_temperature"], cfg["eval_top_p"],
                               cfg["max_new_tokens"], max(1, cfg["micro_batch_size"] // cfg["eval_n"]), eval_gen,
                               cfg["enable_thinking"], cfg["success_threshold"])
            row[name] = res[f"mean@{cfg['eval_n']}"]
            log({"iter": state["iter"], "eval": name, "tag": tag, f"mean@{cfg['eval_n']}": row[name],
                 f"pass@{cfg['eval_n']}": res[f"pass@{cfg['eval_n']}"], "mean_len": res["mean_len"]})
        print(f"eval @ iter {state['iter']} ({tag}): " + ", ".join(f"{k} mean@{cfg['eval_n']} {v:.3f}" for k, v in row.items()))
        return row

    def checkpoint():
        state["data_rng"] = data_rng.getstate()
        save_checkpoint(ckpt_dir, model, tokenizer, optimizer, teacher_model, {**state, "config": cfg},
                        {"sampling": generator.get_state()})

    if state["iter"] == 0:
        state["accuracy_matrix"] = {"eval_sets": eval_names, "stages": [], "base": run_eval("start"), "rows": []}
    try:
        for stage in range(state["stage"], len(stage_list)):
            name, iters = stage_list[stage]
            tasks = load_tasks(name, "train", cfg["data_dir"])
            if stage > 0 and state["stage_iter"] == 0:  # a stage boundary
                if cfg["reset_optimizer"]:
                    optimizer.state.clear()
                if teacher_model is not None and cfg["teacher_stage_reset"] != "keep":
                    source = model if cfg["teacher_stage_reset"] == "student" else initial_model
                    teacher_model.load_state_dict(source.state_dict())
            bar_desc = f"stage {stage + 1}/{len(stage_list)} {name}" if len(stage_list) > 1 else name
            while state["stage_iter"] < iters:
                t0 = time.time()
                lr = set_lr(optimizer, state["iter"], cfg["learning_rate"], cfg["warmup_iters"])
                batch_tasks = [data_rng.choice(tasks) for _ in range(cfg["batch_prompts"])]
                batch, metrics = build_batch(batch_tasks, model, tokenizer, cfg, generator, dev, autocast)
                t1 = time.time()
                m = loss_backward(model, batch, cfg, dev, teacher_model, initial_model, autocast)
                if not math.isfinite(m["loss"]):
                    raise Collapse(f"loss is {m['loss']}")
                grad_norm = optimizer_step(model, optimizer, cfg["grad_clip"])
                if teacher_model is not None and cfg["teacher"] == "ema":
                    ema_update(teacher_model, model, cfg["teacher_rate"])
                t_train = time.time() - t1
                state["iter"] += 1
                state["stage_iter"] += 1
                if m["distill_tokens"]:
                    metrics.update(div=m["div_sum"] / m["distill_tokens"],
                                   teacher_minus_student=m["teacher_minus_student_sum"] / m["distill_tokens"])
                record = {"iter": state["iter"], "stage": name, "loss": m["loss"], "lr": lr, "grad_norm": grad_norm,
                          **metrics, "train_s": t_train, "iter_s": time.time() - t0}
                log(record)
                shown = " | ".join(f"{k} {record[k]:.4g}" for k in ("loss", "reward", "acc", "resp_len", "div", "peer_frac")
                                   if k in record)
                print(f"{bar_desc} iter {state['iter']} | {shown} | tok/s {record['tokens'] / record['iter_s']:.0f}"
                      + (f" | gen {record['gen_s']:.2f}s" if "gen_s" in record else "") + f" train {t_train:.2f}s")
                last = state["stage_iter"] == iters
                if not last and cfg["eval_interval"] and state["stage_iter"] % cfg["eval_interval"] == 0:
                    row = run_eval("periodic")
                    check_collapse(row, tasks, name, state, cfg)
                    if not cfg["save_interval"]:
                        checkpoint()
                if cfg["save_interval"] and state["iter"] % cfg["save_interval"] == 0 and not last:
                    checkpoint()
            # end of stage: a row of the accuracy matrix, a snapshot, a checkpoint
            row = run_eval(f"end of stage {stage + 1}")
            state["accuracy_matrix"]["stages"].append(name)
            state["accuracy_matrix"]["rows"].append([row[s] for s in eval_names])
            with open(os.path.join(out_dir, "accuracy_matrix.json"), "w") as f:
                json.dump(state["accuracy_matrix"], f, indent=1)
            if len(stage_list) > 1:
                snap = os.path.join(out_dir, f"stage{stage + 1}_{name.replace('/', '_').replace('+', '_')}")
                model.save_pretrained(snap, safe_serialization=True)
                tokenizer.save_pretrained(snap)
            state["stage"], state["stage_iter"] = stage + 1, 0
            checkpoint()
    except Collapse as e:
        raise UserError(f"training stopped at iteration {state['iter']}: {e}. The last good checkpoint is "
                        f"{ckpt_dir}" + ("" if os.path.isdir(ckpt_dir) else " (none was written yet)")) from None
    print(f"done: {state['iter']} iterations; model in {ckpt_dir}")


def check_collapse(row, tasks, name, state, cfg):
    """Zero accuracy on the training domain for collapse_patience evals in a row = collapse."""
    own = [row[n] for n in name.split("+") if n in row]
    state["zero_acc_evals"] = state["zero_acc_evals"] + 1 if own and max(own) == 0 else 0
    if cfg["stop_on_collapse"] and state["zero_acc_evals"] >= cfg["collapse_patience"]:
        raise Collapse(f"accuracy on {name} was 0 for {state['zero_acc_evals']} evals in a row")


if __name__ == "__main__":
    from configurator import configure
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except UserError as e:
        sys.exit(f"error: {e}")
