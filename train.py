"""
nanoSDPO: on-policy post-training of language models (SFT, GRPO, SDPO) in one file.

    python train.py config/toy_base.py                 # SFT a toy model from scratch
    python train.py config/sdpo_toy.py --density=0.5   # any default below can be overridden

SDPO, self-distillation policy optimization ("Reinforcement Learning via Self-Distillation",
arXiv 2601.20802): the model, re-prompted with a successful peer's answer, is its own teacher, and
a token-level divergence pulls the student towards it. GRPO is the reward-only baseline. The
research this file serves ("Denser ≠ Better: Limits of On-Policy Self-Distillation for Continual
Post-Training", arXiv 2607.01763): does dense self-distillation learn a new domain faster, and how
much more does it forget?

One iteration of the loop, in the order the code runs (and the order of this file; train_loop()
near the end drives it: build_batch() does 1-4, loss_backward() 5, optimizer_step() and
Teacher.after_step() 6):
  1. rollout    sample `batch_prompts` prompts from the current stage's dataset and generate
                `group_size` responses to each (batched, KV-cached, left-padded prompts; each
                prompt is prefilled once and its cache repeated for its group). The response mask
                keeps the first EOS and nothing after it. The log-probs under which each token
                was sampled are recorded: they are the "old" log-probs of the PPO / IS ratios.
  2. reward     reward(kind, response, answer) -> (score in [0,1], feedback or None); the
                checkers live beside the data, in data/checkers.py.
  3. advantage  GRPO: A_i = r_i - mean(group), / (std(group)+eps) if norm_adv_std. A group whose
                rewards are all equal has exactly 0 and no signal: its rows are dropped from the
                GRPO loss (unless kl_coef > 0 still needs them), as is any other row at its mean.
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
                        density mask (density_select=random: each token kept with probability
                        `density`, redrawn every step; 'disagree' / 'last': round(density·n) tokens of
                        each response) × not overlong-filtered, weighted by min(ρ, is_clip) (detached),
                        mixed with the GRPO loss by
                        grpo_mix (make_loss_fn has the formula). D, for student p and teacher q:
                        alpha=0 forward KL(q‖p), alpha=1 reverse KL(p‖q), else the generalized
                        JSD; over the full vocab, the student's top-k (+ a tail bucket), or the
                        sampled-token estimator sg(log p − log q)·log p.
                All of it goes through one fused, chunked LM-head loss (fused_loss=True) so no
                [tokens, vocab] logits tensor is ever materialised whole (the appendix at the end).
  6. step       AdamW, linear warmup then constant lr (or a cosine to min_lr with decay_lr),
                grad clipping; then the teacher update.
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
  - Token-mean losses divide by the token count of the whole step (all micro-batches, all ranks),
    so the step size does not depend on how the batch is split.
  - Generation is plain HF forward calls with a KV cache, no vLLM and no paged attention. On CUDA
    the decode step runs on a static KV cache through torch.compile (CUDA graphs), reading copies of
    the fp32 weights in the autocast dtype (bf16 by default; decoding.decode_weights): a fixed-shape
    fast path, not a serving engine.
  - One GPU, or under torchrun DDP-style data parallelism (a hand-written gradient all-reduce) or
    FSDP2 sharding of weights, gradients, optimizer state and teacher (parallel=fsdp, runtime.py).
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
import sys
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoint
import metrics
from configurator import UserError, check_seed, check_template, check_values, parse_stages, require
from metrics import Collapse, accuracy_summary
from data import checkers, tasks as task_files
from decoding import (StepMemory, decode_weights, forward_with_cache, frozen_flags, new_cache, static_decoding,
                      use_static_rollout)
from models import (base_fingerprint, base_view, check_lora_settings, context_length, disable_dropout, enable_grad_checkpointing, eval_mode,
                    fit_prompt, fit_tasks, frozen_copy, has_chat_template, lm_head, load_model, load_student, pad_batch,
                    prompt_budget, prompt_ids, response_hidden, stop_token_ids, takes_position_ids)
from runtime import Dist, amp_dtype, fp32_out_bmm, fp32_out_mm, full_state_dict, gathered, leave, make_autocast
from teacher import KINDS as TEACHER_KINDS, Teacher, load_teacher_init

# ----------------------------------------------------------------------------- defaults
# Every line `name = value  # help` below is a config key: config files and --name=value
# override them (configurator.py), `python train.py --help` lists them with this help text.
# I/O
out_dir = "out/run"  # where logs, checkpoints and snapshots go (one run at a time)
init_from = "scratch"  # 'scratch' (toy model from the config below), 'resume', or an HF folder / hub id
overwrite = False  # a fresh run into an out_dir that holds an earlier run replaces it (else it refuses)
tokenizer_path = "data/toy/tokenizer"  # tokenizer for init_from='scratch'
data_dir = "data"  # datasets live in data_dir/<name>/{train,test}.jsonl
dataset = "toy/add"  # training set; several joined with '+' are pooled (each weighted by its size: prompts drawn from the union)
stages = ""  # continual training: 'name:iters,name:iters,...' (overrides dataset and max_iters)
eval_sets = ""  # comma-separated test sets scored at eval time ('' = every set the run trains on, all stages)
eval_interval = 25  # iterations between evals (0 = only at the start and end of each stage)
eval_n = 4  # samples per test prompt for mean@n / pass@n
eval_max_prompts = 100  # test prompts per set (0 = all)
eval_temperature = 0.6  # sampling temperature at eval
eval_top_p = 0.95  # nucleus sampling at eval
save_interval = 0  # iterations between checkpoints within a stage (0 = at each eval; a stage's end always saves)
save_dtype = "float32"  # dtype of the model exported in ckpt/ ('float32' or 'bfloat16'; resuming stays exact)
log_jsonl = True  # append every iteration's metrics to out_dir/log.jsonl
wandb_log = False  # also log to Weights & Biases (pip install wandb)
wandb_project = "nanosdpo"  # wandb project name
wandb_run_name = "run"  # wandb run name
seed = 1337  # seeds python, torch, data order, sampling and density masks
device = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:1', ...
parallel = "ddp"  # under torchrun: 'ddp' (every rank holds every weight) or 'fsdp' (FSDP2: weights, grads, AdamW, teacher sharded)
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
max_prompt_len = 0  # longer prompts are left out, and counted (0 = the model's context - max_new_tokens)
overlong_filter = False  # leave responses cut off at max_new_tokens out of the loss (DAPO's overlong filtering)
temperature = 1.0  # rollout sampling temperature (also divides the GRPO / SDPO training logits; SFT trains at 1)
top_p = 1.0  # rollout nucleus sampling
static_rollout = "auto"  # decode on a static KV cache through a torch.compile'd step: 'auto' (on for CUDA: CUDA graphs), 'on', 'off'
gen_batch_size = 0  # rows (prompts x samples) decoded at once in rollouts and evals, whole groups, at least one (0 = no cap; lower it when the KV cache OOMs)
grad_checkpointing = False  # recompute each block's activations in the backward: less memory, a slower student step
lora_rank = 0  # LoRA (pip install peft): train rank-r adapters only, the base frozen (in the autocast dtype: bf16 on CUDA by default); 0 = every weight
lora_alpha = 32.0  # LoRA: the adapters' update B·A is scaled by lora_alpha / lora_rank
lora_targets = "all-linear"  # LoRA: linear layers to adapt, comma-separated (q_proj,v_proj), or every one ('all-linear'); never the LM head
# optimizer
learning_rate = 1e-5  # AdamW lr after warmup
warmup_iters = 10  # linear warmup steps
decay_lr = False  # cosine-decay the lr from learning_rate to min_lr over the run (else constant)
min_lr = 0.0  # the lr at the last iteration when decay_lr
weight_decay = 0.01  # AdamW weight decay
beta1 = 0.9  # AdamW beta1
beta2 = 0.999  # AdamW beta2
grad_clip = 1.0  # clip the global grad norm (0 = off)
math_checker = "builtin"  # 'builtin' (data/checkers.py) or 'math_verify' (pip install math-verify)
# GRPO
norm_adv_std = False  # divide advantages by the group's std (+eps)
clip_low = 0.2  # PPO clip: ratio >= 1 - clip_low
clip_high = 0.28  # PPO clip: ratio <= 1 + clip_high
kl_coef = 0.0  # k3 KL to the initial model (0 = off, no reference forward)
loss_agg = "token-mean"  # 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'
# SDPO: teacher context
success_threshold = 1.0  # reward at which a response counts as a successful demonstration (and as solved in pass@n, where 0 never is)
dont_reprompt_on_self_success = True  # a response never gets itself as its demonstration
remove_thinking = True  # strip <think>...</think> from demonstrations
use_feedback = False  # add the reward function's feedback on the response's own attempt
feedback_only_without_solution = True  # ...but only when there is no successful peer
reprompt_template = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."  # teacher user turn
solution_template = "\n\nCorrect solution:\n\n{solution}"  # how the demonstration is shown
feedback_template = "\n\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}"  # how feedback is shown
max_reprompt_len = 4096  # teacher prompt tokens (also ≤ context - max_new_tokens); a longer prompt's demonstration is cut from its front
# SDPO: teacher and divergence
teacher = "ema"  # 'frozen', 'ema', 'trust_region' or 'live'
teacher_rate = 0.05  # ema: τ per optimizer step; trust_region: μ, the weight of the current model
teacher_init = ""  # optional HF folder / hub id mixed into the initial teacher weights
teacher_init_alpha = 1.0  # weight of teacher_init in the initial teacher (1 = the teacher is that checkpoint)
alpha = 0.5  # student p, teacher q: 0 = forward KL(q‖p), 1 = reverse KL(p‖q), between = generalized JSD
distill = "topk"  # 'topk', 'full' or 'token' (sampled-token estimator, reverse KL)
topk = 100  # student top-k support for distill='topk'
tail = True  # add a tail bucket with the remaining mass (else renormalise over the top-k)
is_clip = 2.0  # clip of the detached IS weight on the distillation loss (0 = off)
density = 1.0  # expected fraction of response tokens that get the distillation loss, in (0, 1]
density_select = "random"  # which tokens at density < 1: 'random', 'disagree' (largest divergence to the teacher), 'last' (the final answer's end)
distill_agg = "token-mean"  # 'token-mean' (every distilled token of the step alike) or 'seq-mean' (TRL's: each response's mean, over all responses; lasgroup/SDPO's runs use verl's token-mean, per micro-batch)
grpo_mix = 0.0  # loss = (1 - grpo_mix)·distill + grpo_mix·grpo
fused_loss = True  # chunked LM-head loss with a hand-written backward (False: full logits)
loss_chunk = 0  # tokens per chunk of the fused loss (0 = 128 on CPU, 512 on CUDA: one [chunk, vocab] fp32 buffer)
# continual training
teacher_stage_reset = "keep"  # at a stage boundary the teacher: 'keep', 'student' (copy) or 'initial' (the run's initial model, without teacher_init)
reset_optimizer = False  # fresh AdamW state at each stage
stop_on_collapse = True  # stop (keeping the last good checkpoint) on a collapse; NaN/inf always stops
collapse_patience = 3  # unhealthy evals in a row that count as a collapse (a set below half its best -- in a continual run only the current stage's --, any set at 0 after a best above it, or empty responses)
# -----------------------------------------------------------------------------

# ----------------------------------------------------------------------------- checks
CHOICES = {
    "algo": ("sft", "grpo", "sdpo"),
    "teacher": tuple(TEACHER_KINDS),
    "distill": ("topk", "full", "token"),
    "loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "teacher_stage_reset": ("keep", "student", "initial"),
    "dtype": ("auto", "float32", "bfloat16"),
    "static_rollout": ("auto", "on", "off"),
    "save_dtype": ("float32", "bfloat16"),
    "math_checker": ("builtin", "math_verify"),
    "density_select": ("random", "disagree", "last"),
    "distill_agg": ("token-mean", "seq-mean"),
    "parallel": ("ddp", "fsdp"),
}
RANGES = {  # key: (low, high, low inclusive)
    "density": (0.0, 1.0, False), "alpha": (0.0, 1.0, True), "teacher_rate": (0.0, 1.0, True),
    "teacher_init_alpha": (0.0, 1.0, True), "grpo_mix": (0.0, 1.0, True), "top_p": (0.0, 1.0, False),
    "eval_top_p": (0.0, 1.0, False), "success_threshold": (0.0, 1.0, True),
}
POSITIVE = ("max_iters", "batch_prompts", "group_size", "micro_batch_size", "max_new_tokens", "topk",
            "n_layer", "n_head", "n_embd", "block_size", "eval_n", "max_reprompt_len", "temperature",
            "eval_temperature", "collapse_patience", "lora_alpha")
SDPO_ONLY = ("dont_reprompt_on_self_success", "remove_thinking", "use_feedback", "feedback_only_without_solution",
             "reprompt_template", "solution_template", "feedback_template", "max_reprompt_len", "teacher", "teacher_rate",
             "teacher_init_alpha", "alpha", "distill", "topk", "tail", "is_clip", "density", "density_select",
             "distill_agg", "grpo_mix")  # the settings that algo=grpo / sft never read (unused_settings says so)
NON_NEGATIVE = ("gen_batch_size", "warmup_iters", "eval_interval", "eval_max_prompts", "save_interval", "weight_decay",
                "grad_clip", "clip_low", "clip_high", "kl_coef", "is_clip", "loss_chunk",
                "max_prompt_len", "lora_rank")


def check_config(cfg):
    """Validate values that a type check cannot: choices, ranges, formats, combinations."""
    if cfg["dtype"] == "float16":  # per-token gradients (~1e-9) flush to zero in fp16 without loss scaling
        raise UserError("dtype=float16 is not supported (no loss scaling: its small gradients flush to zero): use bfloat16")
    check_values(cfg, choices=CHOICES, ranges=RANGES, positive=POSITIVE, non_negative=NON_NEGATIVE)
    for key in ("beta1", "beta2"):  # AdamW's own check would come after out_dir is taken over
        if not 0 <= cfg[key] < 1:
            raise UserError(f"{key}={cfg[key]} is out of range [0, 1)")
    if not 0 <= cfg["min_lr"] <= cfg["learning_rate"]:
        raise UserError(f"min_lr={cfg['min_lr']} must be in [0, learning_rate={cfg['learning_rate']}]")
    if cfg["algo"] != "sft" and cfg["group_size"] < 2:
        raise UserError(f"group_size={cfg['group_size']} must be >= 2 for {cfg['algo']} (advantages and peers need a group)")
    # knobs that would silently do nothing (the references refuse them too)
    if cfg["algo"] == "sdpo" and cfg["kl_coef"] > 0 and cfg["grpo_mix"] == 0:
        raise UserError("kl_coef acts through the GRPO term, which algo=sdpo leaves out at grpo_mix=0: set grpo_mix > 0 or kl_coef=0")
    if cfg["distill"] == "token" and cfg["alpha"] != 1:
        raise UserError(f"distill=token estimates the reverse KL (alpha=1) from the sampled token, not alpha={cfg['alpha']}: "
                        "set --alpha=1, or use distill=topk / full")
    own = [k for k, kind in TEACHER_KINDS.items() if kind.own_copy]  # frozen, ema
    if cfg["teacher_init"] and not (cfg["algo"] == "sdpo" and TEACHER_KINDS[cfg["teacher"]].own_copy):
        raise UserError(f"teacher_init sets the starting weights of a teacher with its own copy: it needs algo=sdpo with "
                        f"teacher={' or '.join(own)} (teacher={cfg['teacher']} has no weights of its own)")
    if cfg["teacher_stage_reset"] != "keep" and not (cfg["algo"] == "sdpo" and TEACHER_KINDS[cfg["teacher"]].own_copy):
        raise UserError(f"teacher_stage_reset={cfg['teacher_stage_reset']} reloads a teacher's own copy at a stage boundary: "
                        f"it needs algo=sdpo with teacher={' or '.join(own)} (algo={cfg['algo']}, teacher={cfg['teacher']} "
                        "has none): set teacher_stage_reset=keep")
    if cfg["teacher_stage_reset"] == "initial" and cfg["teacher"] == "frozen" and not cfg["teacher_init"]:
        raise UserError("teacher_stage_reset=initial: the frozen teacher is the initial model already: set "
                        "teacher_stage_reset=keep (or 'student', to teach each stage from the student it starts from)")
    if cfg["parallel"] == "fsdp" and cfg["algo"] == "sdpo" and TEACHER_KINDS[cfg["teacher"]].reads_student:
        raise UserError(f"parallel=fsdp shards a teacher's own copy; teacher={cfg['teacher']} reads the sharded student "
                        f"in forwards that ranks run unevenly: use teacher={' or '.join(own)}, or parallel=ddp")
    parse_stages(cfg["stages"], cfg["dataset"], cfg["max_iters"])
    check_seed(cfg["seed"])
    check_lora_settings(cfg)  # only when lora_rank > 0: peft, and the settings LoRA refuses
    for key, names in {"reprompt_template": "prompt solution feedback", "solution_template": "solution",
                        "feedback_template": "feedback"}.items():  # each tried now, not at the first teacher prompt
        check_template(key, cfg[key], names.split())


def unused_settings(cfg, defaults, vocab):
    """Notes for settings moved from their default that this run's other settings make do nothing (or,
    topk at the vocabulary's size, something other than what they say). Said, not refused: the config
    cannot tell a value someone typed from one a config file set, and a sweep such as --density=1.0
    over a config that sets density_select must still run."""
    nothing = "does nothing in this run:"
    inert = {  # key: what it does here, if not what it says (None: it acts)
        "teacher_rate": (None if TEACHER_KINDS[cfg["teacher"]].uses_rate else f"{nothing} it is the rate of teacher="
                         f"{' or '.join(k for k, kind in TEACHER_KINDS.items() if kind.uses_rate)}, not {cfg['teacher']}"),
        "teacher_init_alpha": None if cfg["teacher_init"] else f"{nothing} it weighs teacher_init, which is not set",
        "density_select": None if cfg["density"] < 1 else f"{nothing} at density=1 every response token is distilled",
        "topk": (f"{nothing} distill={cfg['distill']} does not use it" if cfg["distill"] != "topk" else
                 f"is not below the vocabulary ({vocab} tokens): distill=topk is distill=full here" if cfg["topk"] >= vocab else None),
        "min_lr": None if cfg["decay_lr"] else f"{nothing} it is where decay_lr's cosine ends, and decay_lr=False",
        "lora_alpha": None if cfg["lora_rank"] else f"{nothing} it scales LoRA's adapters, and lora_rank=0",
        "lora_targets": None if cfg["lora_rank"] else f"{nothing} it names LoRA's adapted layers, and lora_rank=0",
    }
    if cfg["algo"] != "sdpo":  # (teacher_init and teacher_stage_reset are refused instead: check_config)
        inert.update({key: f"{nothing} it is an SDPO setting (algo={cfg['algo']})" for key in SDPO_ONLY})
    return [f"note: {key}={cfg[key]!r} {why}" for key, why in inert.items()
            if why and key in defaults and cfg[key] != defaults[key]]


# ----------------------------------------------------------------------------- data
# A task is one JSON line of data_dir/<name>/{train,test}.jsonl (data/tasks.py has the schema), its
# `kind` one of REWARD_FNS below; data/<name>/prepare.py writes the files.
def load_tasks(name, split, data_dir="data", need_solution=False):
    """data/tasks.py's load with this file's answer kinds: every record checked, up front."""
    return task_files.load(name, split, data_dir, kinds=REWARD_FNS, need_solution=need_solution)


# ----------------------------------------------------------------------------- rollout
@dataclass
class Batch:
    """One iteration's sequences, carried from the rollout to the loss and filled in phase by
    phase; row i answers prompt i // group_size (SFT: prompt i). Per row:"""
    prompt_ids: list  # rollout: the chat-templated prompt's token ids
    response_ids: list  # rollout: up to and including the first EOS (SFT: the reference solution)
    old_logprobs: list  # rollout: [n] the log-prob each token was sampled with (PPO / IS ratios)
    truncated: list  # rollout: hit max_new_tokens before an EOS
    texts: list = None  # reward: the decoded response
    rewards: list = None  # reward: score in [0, 1]
    advantages: list = None  # advantage: one number per row
    teacher_prompt_ids: list = None  # teacher context: the teacher's prompt ids, or None (no signal)
    pg_weight: list = None  # assembly: [n] each token's weight in the GRPO / SFT term, λ / Z_pg (make_loss_fn)
    distill_weight: list = None  # assembly: [n] each token's weight in the distillation term, (1 − λ) / Z_D

    def take(self, rows):
        """The same batch restricted to `rows` (a micro-batch)."""
        return Batch(**{f.name: None if getattr(self, f.name) is None else [getattr(self, f.name)[i] for i in rows]
                        for f in fields(self)})


def sample_top_p(logits, temperature, top_p, generator):
    """Sample one token per row; also return its log-prob under softmax(logits / temperature).
    temperature=0 is greedy (log-probs at temperature 1)."""
    logprobs = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    if temperature == 0:
        token = logprobs.argmax(-1)
    else:
        probs = logprobs.exp()
        if top_p < 1.0:
            probs = nucleus(probs, top_p)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


NUCLEUS_K = 256  # nucleus() looks among each row's top NUCLEUS_K first


def nucleus(probs, top_p):
    """probs [B, V] with every token outside each row's nucleus zeroed: the smallest set of the most
    probable tokens whose mass reaches top_p (a token is kept while the mass before it is <= top_p).
    A row whose top NUCLEUS_K already hold more than top_p has its nucleus among them: it is found
    there (a partial sort; sorting a 150k vocabulary every step costs more than the rest of sampling),
    the other rows are sorted whole. Both give the same kept tokens and values (the cumulative sums of
    one prefix), but tokens of exactly equal probability may be ordered differently at the edge."""
    def keep(sorted_p, order, rows):
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        return torch.zeros_like(rows).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    if probs.shape[-1] <= 4 * NUCLEUS_K:
        return keep(*probs.sort(dim=-1, descending=True), probs)
    top, order = probs.topk(NUCLEUS_K, dim=-1)  # sorted, descending
    inside = top.cumsum(-1)[:, -1] > top_p  # the mass before the (K+1)-th token: it and the rest are dropped
    out = keep(top, order, probs)
    if not inside.all():
        rest = probs[~inside]
        out[~inside] = keep(*rest.sort(dim=-1, descending=True), rest)
    return out


def response_mask(tokens, eos_ids):
    """[B, T] -> bool mask that keeps every token up to and including the first EOS, nothing after."""
    is_eos = torch.isin(tokens, torch.as_tensor(eos_ids, device=tokens.device))
    eos_before = is_eos.cumsum(-1) - is_eos.long()  # EOS count strictly before each position
    return eos_before == 0


def stream_seed(seed, rank, stream):
    """The seed of a rank's random stream: 0 its sampling and density masks, 1 / 2 the student's /
    teacher's evals, 3 + iteration a resume's reseed. Ranks sit 1000003 apart, so no rank's stream is
    another's (seed + rank and seed + k + rank once made rank 1's sampling rank 0's eval stream);
    rank 0's are seed + stream, as a one-process run's always were."""
    return seed + stream + 1_000_003 * rank


def make_generator(seed, dev):
    """A torch.Generator on `dev`: sampling stays on the device (a CPU generator cannot drive CUDA
    sampling), and its state is saved in checkpoints, so a resume samples exactly the same."""
    return torch.Generator(device=dev).manual_seed(seed)


def generate(model, prompts, *, group_size, max_rows=0, progress=False, **sampling):
    """Sample `group_size` responses to each prompt (token-id lists) -> Batch (its rollout fields).

    max_rows > 0 decodes at most that many rows (prompts × group_size) at once, whole groups at a
    time, at least one (with a progress bar if asked): the KV cache is what runs out first at long max_new_tokens.
    `sampling`: decode()'s keywords (max_new_tokens, temperature, top_p, eos_ids, pad_id, generator, static)."""
    per_call = max(1, max_rows // group_size) if max_rows > 0 else len(prompts)
    starts = range(0, len(prompts), per_call)
    # eval mode: no dropout, and transformers 5.17's checkpointed layers keep the KV cache; the static
    # (compiled) path reads bf16 copies of the matmul weights instead of casting the fp32 ones every token,
    # and sees no requires_grad flag (student and teacher: one compiled step)
    static = sampling.get("static", False)

    def decode_chunk(i):
        part = prompts[i:i + per_call]
        # the static cache is kept per row count: a call's short last chunk, padded to per_call prompts with
        # copies of its last one (their rows dropped), decodes on the live buffers instead of reallocating them
        # (and the next full chunk reallocating them again), so the CUDA graphs replay. A call in one chunk is
        # not padded: max_rows may be far above its rows
        short = per_call - len(part) if static and len(starts) > 1 else 0
        out = decode(model, part + part[-1:] * short, group_size=group_size, **sampling)
        return out.take(range(len(part) * group_size)) if short else out
    with eval_mode(model), frozen_flags(model, enabled=static), decode_weights(model, enabled=static):
        chunks = [decode_chunk(i) for i in tqdm(starts, desc="rollout", disable=None if progress and len(starts) > 1 else True,
                                                leave=False, file=sys.stdout)]
    if len(chunks) == 1:
        return chunks[0]
    return Batch(*[[x for chunk in chunks for x in getattr(chunk, f)] for f in
                   ("prompt_ids", "response_ids", "old_logprobs", "truncated")])


@torch.no_grad()
def decode(model, prompts, *, group_size, max_new_tokens, temperature, top_p, eos_ids, pad_id, generator,
           static=False, stop_check=None):
    """generate() for one set of prompts. The prompts are left-padded and prefilled once; the KV
    cache is then repeated for the group, and decoding stops once every row has produced an EOS.
    Checking that is a host-device sync, so on CUDA it happens every `stop_check` (8) steps only;
    rows that are done keep emitting pad_id, which the response mask drops.

    static=True decodes into a preallocated StaticCache through a torch.compile'd step: every
    decode step has the same shapes, so on CUDA it is captured once as a CUDA graph and replayed
    (no per-token Python or kernel-launch overhead)."""
    dev = next(model.parameters()).device
    stop_check = stop_check or (1 if dev.type == "cpu" else 8)
    eos = torch.as_tensor(eos_ids, device=dev)
    ids, mask = (t.to(dev) for t in pad_batch(prompts, pad_id, left=True))
    position = (mask.cumsum(-1) - 1).clamp(min=0) if takes_position_ids(model) else None
    cache = new_cache(model, dev)  # keys and values in the autocast dtype
    logits = forward_with_cache(model, ids, mask, position, cache, logits_to_keep=1)
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    mask = mask.repeat_interleave(group_size, 0)
    if position is not None:
        position = position[:, -1:].repeat_interleave(group_size, 0)
    rows = logits.shape[0]
    fast = static and static_decoding(model, cache, mask, max_new_tokens)  # None for sliding-window models
    cache, mask, step = fast or (cache, mask, forward_with_cache)
    tokens, logps = [], []
    done = torch.zeros(rows, dtype=torch.bool, device=dev)
    for t in range(max_new_tokens):
        token, logp = sample_top_p(logits, temperature, top_p, generator)
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        logps.append(logp)
        done |= torch.isin(token, eos)
        if t + 1 == max_new_tokens or ((t + 1) % stop_check == 0 and done.all()):
            break  # (after the last token: no forward whose logits nothing samples from)
        if not fast:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        position = position + 1 if position is not None else None
        logits = step(model, token[:, None], mask, position, cache)
    tokens, logps = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).float().cpu()
    lengths = response_mask(tokens, eos_ids).sum(-1).tolist()
    response_ids = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
    eos_set = set(torch.as_tensor(eos_ids).view(-1).tolist())
    return Batch(prompt_ids=[p for p in prompts for _ in range(group_size)], response_ids=response_ids,
                 old_logprobs=[logps[i, :n] for i, n in enumerate(lengths)],
                 truncated=[not (r and r[-1] in eos_set) for r in response_ids])


# ----------------------------------------------------------------------------- reward
# The contract: reward(kind, response, answer) -> (score in [0, 1], feedback str or None), never
# raises, bounded time on any string. `kind` picks the checker; feedback (None on success) is
# for the SDPO teacher prompt: short (code: the failing public test's input, expected and got, up to
# 1500 characters), never the reference answer or a hidden test.
REWARD_FNS = checkers.CHECKS  # kind -> checker: the table in data/checkers.py (a new kind is a line there)
_CHECKER_ERRORS = set()  # (kind, exception type) already warned about: once per process, not once per response


def reward(kind, response, answer, math_checker="builtin"):
    """(score, feedback) for one response; math_checker='math_verify' checks math with math-verify."""
    try:
        check = checkers.check_math_verify if kind == "math" and math_checker == "math_verify" else REWARD_FNS.get(kind)
        if check is None:
            return 0.0, f"could not check: unknown answer kind {kind!r}"
        return check("" if response is None else str(response), checkers.answer_text(answer))
    except Exception as e:  # RecursionError, MemoryError, ...: a checker must not stop training, nor fail unseen
        if (kind, type(e)) not in _CHECKER_ERRORS:
            _CHECKER_ERRORS.add((kind, type(e)))
            print(f"warning: the {kind!r} answer checker raised {type(e).__name__}: {str(e)[:200]}: such responses score 0 "
                  "(said once per kind and error; a checker bug in data/checkers.py, or a hostile response)",
                  file=sys.stderr, flush=True)
        return 0.0, f"could not check the response ({type(e).__name__})"


def rewards_of(tasks, responses, math_checker="builtin"):
    """[reward(...)] for responses[i] to tasks[i]; "code" responses run together on the sandbox's
    worker pool (data/sandbox.py: a rollout's programs in parallel, never in this process)."""
    return checkers.check_batch([t["kind"] for t in tasks], responses, [t["answer"] for t in tasks],
                                lambda kind, text, answer: reward(kind, text, answer, math_checker))


# ----------------------------------------------------------------------------- advantages
def group_advantages(rewards, group_size, norm_std, eps=1e-6):
    """GRPO: reward minus its group's mean (optionally / group std). rewards: [B*G]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(-1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    # a group of equal rewards has no signal, but a float mean of partial scores (0.3 × 8) is not
    # exact: its rounding (÷ a rounding-sized std, with norm_std) would train on noise
    return adv.masked_fill((r == r[:, :1]).all(-1, keepdim=True), 0.0).view(-1)


# ----------------------------------------------------------------------------- teacher context
def strip_thinking(text):
    """Drop <think>...</think> blocks from a demonstration, an unclosed trailing one, and everything
    before a </think> that has no opening tag (the chat template opened the block, as in SDPO-CL)."""
    close, open_ = text.find("</think>"), text.find("<think>")
    if close >= 0 and (open_ < 0 or close < open_):  # the first </think> closes a block the template opened
        text = "<think>" + text
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL).rsplit("</think>", 1)[-1]  # (a second stray one)
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


def teacher_contexts(tasks, texts, rewards, feedbacks, group_size, cfg):
    """Per rollout row: the teacher's chat messages, or None when it has no signal (build_batch goes on
    to tokens: template_teacher_prompts fits each prompt to the teacher's length limit)."""
    return [None if x is None else teacher_messages(tasks[i // group_size]["messages"], *x, cfg)
            for i, x in enumerate(teacher_inputs(texts, rewards, feedbacks, group_size, cfg))]


def teacher_inputs(texts, rewards, feedbacks, group_size, cfg):
    """Per rollout row: (demonstration or None, feedback or None), or None when it has no signal."""
    demos = [strip_thinking(t) if cfg["remove_thinking"] else t for t in texts]
    # a success whose answer sits in its thinking block (the checkers read it there) demonstrates nothing
    # once that is stripped: the next successful peer is the demonstration, not an empty one
    usable = [r if d.strip() else -math.inf for r, d in zip(rewards, demos)]
    out = []
    for i in range(len(texts)):
        j = pick_peer(usable, group_size, i, cfg["success_threshold"], cfg["dont_reprompt_on_self_success"])
        peer = None if j is None else demos[j]
        feedback = None
        if cfg["use_feedback"] and feedbacks[i] and not (cfg["feedback_only_without_solution"] and peer is not None):
            feedback = feedbacks[i]
        out.append(None if peer is None and feedback is None else (peer, feedback))
    return out


def teacher_messages(messages, peer, feedback, cfg):
    """The task's chat messages with the teacher's user turn in place of the last one."""
    messages = copy.deepcopy(messages)
    messages[-1]["content"] = teacher_prompt_text(messages[-1]["content"], peer, feedback, cfg["reprompt_template"],
                                                  cfg["solution_template"], cfg["feedback_template"])
    return messages


# ----------------------------------------------------------------------------- batch assembly
# global_sum adds numbers elementwise over ranks (DDP: Dist.global_sum), so each weight divides by the
# whole step's count; in one process they are the step's already: single_process_sum is a no-op.
single_process_sum = list


def build_batch(tasks, model, tokenizer, cfg, generator, dev, *, autocast=contextlib.nullcontext,
                global_sum=single_process_sum, progress=False):
    """Rollout → reward → advantages → teacher context → loss weights, for one iteration's prompts.

    Returns (Batch, metrics). For algo='sft' the responses are the reference solutions. With
    several ranks, `tasks` is this rank's share and global_sum adds numbers over ranks, so every
    loss is normalised by the whole step's token count."""
    prompts = [prompt_ids(tokenizer, t["messages"], cfg["enable_thinking"]) for t in tasks]
    if cfg["algo"] == "sft":
        responses = [tokenizer.encode(t["solution"], add_special_tokens=False) + [tokenizer.eos_token_id] for t in tasks]
        lengths = [len(r) for r in responses]
        total = global_sum([sum(lengths)])[0]
        return Batch(prompt_ids=prompts, response_ids=responses, old_logprobs=[torch.zeros(n) for n in lengths],
                     truncated=[False] * len(tasks), advantages=[0.0] * len(tasks),
                     teacher_prompt_ids=[None] * len(tasks), pg_weight=[torch.full((n,), 1.0 / total) for n in lengths],
                     distill_weight=[torch.zeros(n) for n in lengths]), {"tokens": sum(lengths)}
    G = cfg["group_size"]
    t0 = time.time()
    with autocast(), gathered(model):  # parallel=fsdp: one all-gather per rollout, none per decode step
        batch = generate(model, prompts, group_size=G, max_rows=cfg["gen_batch_size"], max_new_tokens=cfg["max_new_tokens"],
                         temperature=cfg["temperature"], top_p=cfg["top_p"], eos_ids=stop_token_ids(model, tokenizer),
                         pad_id=tokenizer.pad_token_id, generator=generator, progress=progress,
                         static=use_static_rollout(cfg["static_rollout"], dev))
    batch.texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    t_gen, t0 = time.time() - t0, time.time()
    scored = rewards_of([tasks[i // G] for i in range(len(batch.texts))], batch.texts, cfg["math_checker"])
    rewards = torch.tensor([s for s, _ in scored], dtype=torch.float32)
    # the checkers' own floats, not their float32 roundings: 0.7 (7 of 10 tests) is 0.69999998 in float32, which
    # success_threshold=0.7 would not count as a success here while the eval (sample_and_score) does
    batch.rewards, feedbacks = [float(s) for s, _ in scored], [f for _, f in scored]
    t_reward = time.time() - t0
    advantages = group_advantages(rewards, G, cfg["norm_adv_std"])
    batch.advantages = advantages.tolist()
    lengths = [len(r) for r in batch.response_ids]
    # zero-signal groups are dropped from the GRPO term (unless a KL term still needs them), and with
    # overlong_filter so are responses cut off at max_new_tokens (their reward judges no answer)
    kept = [not (cfg["overlong_filter"] and cut) for cut in batch.truncated]
    has_signal = [(a != 0 or cfg["kl_coef"] > 0) and k for a, k in zip(batch.advantages, kept)]
    # the loss's mix λ = grpo_mix goes into the weights here, beside the normalisers (make_loss_fn's formula)
    grpo_share = cfg["grpo_mix"] if cfg["algo"] == "sdpo" else 1.0
    batch.pg_weight = [w * grpo_share for w in grpo_weights(lengths, has_signal, cfg["loss_agg"], cfg["max_new_tokens"],
                                                          global_sum)]
    batch.teacher_prompt_ids, batch.distill_weight = [None] * len(lengths), [torch.zeros(n) for n in lengths]
    metrics = {}
    if cfg["algo"] == "sdpo":
        inputs = teacher_inputs(batch.texts, batch.rewards, feedbacks, G, cfg)
        # the teacher reads its prompt and then the response: both must fit the model's context
        limit = min(cfg["max_reprompt_len"], (context_length(model) or math.inf) - cfg["max_new_tokens"])
        batch.teacher_prompt_ids, cut = template_teacher_prompts(tokenizer, tasks, inputs, G, cfg, limit)
        masks = density_masks(lengths, cfg["density"], generator, cfg["density_select"])
        masks = [m if t is not None and k else torch.zeros_like(m) for m, t, k in zip(masks, batch.teacher_prompt_ids, kept)]
        n_distill = sum(int(m.sum()) for m in masks)
        batch.distill_weight = distill_weights(masks, cfg["distill_agg"], 1 - cfg["grpo_mix"], global_sum)
        metrics.update(peer_frac=sum(t is not None for t in batch.teacher_prompt_ids) / len(lengths),
                       distill_frac=n_distill / max(sum(lengths), 1), distilled=n_distill, reprompt_truncated=cut)
    successes = torch.tensor([r >= cfg["success_threshold"] for r in batch.rewards]).view(-1, G)
    metrics.update(reward=rewards.mean().item(), acc=successes.float().mean().item(),
                   group_success=successes.any(-1).float().mean().item(),
                   zero_signal_groups=(advantages.view(-1, G) == 0).all(-1).float().mean().item(),
                   resp_len=sum(lengths) / len(lengths), truncated=sum(batch.truncated) / len(lengths),
                   tokens=sum(lengths), gen_s=t_gen, reward_s=t_reward)
    return batch, metrics


def template_teacher_prompts(tokenizer, tasks, inputs, group_size, cfg, limit):
    """Each row's task (tasks[i // group_size]) and teacher inputs -> the teacher prompt's ids (None
    stays None), each distinct one templated once (a group's rows mostly share one), at most `limit`
    long (models.fit_prompt shortens the demonstration). Returns (ids per row, how many were cut)."""
    templated, out, cut = {}, [], 0
    for msgs, x in zip((tasks[i // group_size]["messages"] for i in range(len(inputs))), inputs):
        key = x and json.dumps([msgs, x])
        if key not in templated:
            templated[key] = x and _fit_teacher_prompt(tokenizer, msgs, *x, cfg, limit)
        ids, shortened = templated[key] or (None, False)
        out.append(ids)
        cut += shortened
    return out, cut


def _fit_teacher_prompt(tokenizer, msgs, peer, feedback, cfg, limit):
    """fit_prompt for one teacher prompt. Feedback (a code test's input and output can be long) too
    long for `limit` even without any demonstration is shortened as a demonstration is (to its end),
    the demonstration then left empty: fit_prompt's last resort, the prompt's last `limit` tokens,
    would cut the system turn and the question instead."""
    think = cfg["enable_thinking"]
    if feedback is not None:
        bare = lambda fb: teacher_messages(msgs, None if peer is None else "", fb, cfg)  # noqa: E731
        if len(prompt_ids(tokenizer, bare(feedback), think)) > limit:
            return fit_prompt(tokenizer, bare, feedback, limit, think)
    return fit_prompt(tokenizer, lambda demo: teacher_messages(msgs, demo, feedback, cfg), peer, limit, think)


def distill_weights(masks, agg, scale, global_sum=single_process_sum):
    """Per-token weights of the distillation term over the whole step (all micro-batches, all ranks):
    scale (the loss's 1 − grpo_mix) over the normaliser.
    token-mean: every distilled token alike, 1 / (distilled tokens in the step); seq-mean (TRL's
    SDPO): each response's mean over its distilled tokens, averaged over every response of the
    step, those without a teacher counting as 0 -- so the step shrinks with the fraction of
    responses that have a successful peer. (lasgroup/SDPO's runs take verl's token-mean over each
    micro-batch's distilled tokens; its seq-mean-token-mean would average over taught responses only.)"""
    if agg == "token-mean":
        norms = [max(global_sum([sum(int(m.sum()) for m in masks)])[0], 1)] * len(masks)
    else:
        n_seqs = global_sum([len(masks)])[0]
        norms = [max(int(m.sum()), 1) * n_seqs for m in masks]
    return [m.float() * scale / z for m, z in zip(masks, norms)]


def grpo_weights(n_tokens, has_signal, loss_agg, max_new_tokens, global_sum=single_process_sum):
    """Per-token aggregation weights of the GRPO term over the whole step.

    n_tokens: response length of each sequence; has_signal: bool per sequence."""
    kept = [n for n, k in zip(n_tokens, has_signal) if k]
    total, n_seq = global_sum([sum(kept), len(kept)])
    total, n_seq = max(total, 1), max(n_seq, 1)
    weights = []
    for n, k in zip(n_tokens, has_signal):
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


def density_masks(n_tokens, density, generator, select="random"):
    """Which response tokens get the distillation loss, about `density` of them. random: each token
    with probability density (drawn on the generator's device); last: the last round(density·n) of
    each response (where the final answer is); disagree: that many too, placed by loss_backward
    where the divergence to the teacher is largest (here: a mask with the right count)."""
    if density >= 1.0:
        return [torch.ones(n, dtype=torch.bool) for n in n_tokens]
    if select == "random":
        return [(torch.rand(n, generator=generator, device=generator.device) < density).cpu() for n in n_tokens]
    keep = [max(1, round(density * n)) if n else 0 for n in n_tokens]
    return [torch.arange(n) >= n - k if select == "last" else torch.arange(n) < k for n, k in zip(n_tokens, keep)]


# ----------------------------------------------------------------------------- loss definition
# Everything below works on flattened rows, one per response token: hidden [N, H] (final hidden
# states), weight [V, H] (LM head), tokens [N] (the token each row predicts).
TAIL_LOG_CLAMP = -1e-7  # as in the SDPO reference: keeps log(1 - sum top-k p) finite


def make_loss_fn(*, algo, old_logp, ref_logp, advantage, pg_weight, distill_weight, clip_low, clip_high, kl_coef,
                 is_clip, distill):
    """The per-token loss, called by the token loss once per chunk of rows:

        loss_fn(logp, div, teacher_logp, rows) -> scalar

    logp [c]: the student's log-prob of each token (differentiable); div [c]: the divergence to
    the teacher (differentiable, 0 outside the distillation rows); teacher_logp [c]: the teacher's
    log-prob of the token; rows: the chunk's slice of the [N] tensors given here.

    The step's loss, as the paper writes it (λ = grpo_mix for sdpo; sft and grpo: λ = 1, no D):
        L = λ · Σ_t pg_t / Z_pg  +  (1 − λ) · Σ_t min(ρ_t, is_clip) · D_t / Z_D
    pg_t: PPO-clip (+ kl_coef · k3) or the SFT cross-entropy; D_t: the divergence at distilled
    tokens; Z: the normalisers over the whole step, all micro-batches and ranks (grpo_weights by
    loss_agg, distill_weights by distill_agg). build_batch folds both factors into the weights
    given here, pg_weight = λ / Z_pg and distill_weight = (1 − λ) / Z_D, so the chunk losses add up."""
    def loss_fn(logp, div, teacher_logp, rows):
        w_pg, w_d = pg_weight[rows], distill_weight[rows]
        if algo == "sft":
            return -(w_pg * logp).sum()
        ratio = torch.exp(logp - old_logp[rows])
        adv = advantage[rows]
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
        if kl_coef > 0:
            log_r = ref_logp[rows] - logp
            pg = pg + kl_coef * (torch.exp(log_r) - log_r - 1)  # k3 estimator of KL(π‖π_ref)
        loss = (w_pg * pg).sum()
        if algo == "sdpo":
            is_w = ratio.detach().clamp(max=is_clip) if is_clip > 0 else 1.0
            if distill == "token":  # sampled-token estimator of reverse KL: advantage = log q − log p
                div = (logp - teacher_logp).detach() * logp
            loss = loss + (w_d * is_w * div).sum()
        return loss
    return loss_fn


def _divergence(s, t, alpha):
    """Divergence between row distributions given as log-probs s (student, p = exp s) and t (teacher,
    q = exp t), reduced over the last dim. alpha=0: forward KL(q‖p), alpha=1: reverse KL(p‖q), otherwise
    the generalized JSD with mixture m = (1-alpha) p + alpha q: (1-alpha) KL(p‖m) + alpha KL(q‖m)."""
    if alpha == 0:
        return (t.exp() * (t - s)).sum(-1)
    if alpha == 1:
        return (s.exp() * (s - t)).sum(-1)
    log_m = torch.logaddexp(s + math.log(1 - alpha), t + math.log(alpha))
    kl_pm = (s.exp() * (s - log_m)).sum(-1)
    kl_qm = (t.exp() * (t - log_m)).sum(-1)
    return (1 - alpha) * kl_pm + alpha * kl_qm


def _topk_buckets(s_k, t_k, tail):
    """Top-k log-probs [n, k] (gathered from full-vocab log-softmaxes) -> the bucket log-probs the
    divergence is taken over: k + 1 buckets with a tail bucket log(1 - sum_k p), or the k tokens
    renormalised."""
    if not tail:
        return torch.log_softmax(s_k, -1), torch.log_softmax(t_k, -1)

    def add_tail(lp):
        # log(1 - exp(lse)) via expm1; the clamp avoids log(0) = -inf (and NaN grads) when the
        # top-k hold (numerically) all the mass
        lse = torch.logsumexp(lp, -1, keepdim=True).clamp(max=TAIL_LOG_CLAMP)
        return torch.cat([lp, torch.log(-torch.expm1(lse))], -1)

    return add_tail(s_k), add_tail(t_k)


def distill_divergence(student_logits, teacher_logits, alpha, distill, topk, tail):
    """Per-row divergence [N] between student and teacher logits [N, V]: distill="full" over the
    whole vocab, "topk" over the student's top-k tokens (+ a tail bucket, or renormalised).
    In fp32 (fp64 for fp64 inputs). "token" is a sampled-token estimator: the loss builds it."""
    if distill not in ("full", "topk"):
        raise ValueError(f"distill_divergence takes distill='full' or 'topk', not {distill!r}")
    dt = torch.promote_types(student_logits.dtype, torch.float32)
    z, zt = student_logits.to(dt), teacher_logits.to(dt)
    s, t = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    if distill == "full":
        return _divergence(s, t, alpha)
    idx = torch.topk(z, min(topk, z.shape[-1]), dim=-1).indices
    return _divergence(*_topk_buckets(s.gather(-1, idx), t.gather(-1, idx), tail), alpha)


def _div_rows(hidden, teacher, div_rows):
    """The rows that get a divergence: all of them by default when there is a teacher, none without."""
    if teacher is None or div_rows is None:
        return torch.full((hidden.shape[0],), teacher is not None, dtype=torch.bool, device=hidden.device)
    return div_rows


def naive_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                     alpha, distill, topk, tail, temperature=1.0):
    """Reference implementation: full [N, V] logits in fp32 (fp64 for fp64 inputs), plain autograd.

    hidden [N, H] student final hidden states, weight [V, H] LM head, tokens [N] the token of each
    row. Student logits = hidden @ weight.T / T. teacher: None or [teacher.TeacherLogits(hidden [N, H],
    weight [V, H], coef)] (Teacher.logits), no grad: teacher logits = sum coef * hidden @ weight.T, / T.
    div_rows: bool [N] (None: all rows if there is a teacher, else none); rows outside get div = 0
    and teacher_logp = 0. Per row: logp (student log-prob at tokens), teacher_logp, and div =
    distill_divergence(...) for distill "full" / "topk", or the constant (logp - teacher_logp)
    for "token" (loss_fn builds the sampled-token estimator from teacher_logp).
    loss = loss_fn(logp [N], div [N], teacher_logp [N], slice(0, N)), a scalar.
    Returns (loss, stats): detached fp32 [N] logp, div, teacher_logp, and two diagnostics: the
    student's entropy and (distill="topk", distillation rows) the mass of its top-k tokens."""
    div_mask = _div_rows(hidden, teacher, div_rows)
    N = hidden.shape[0]
    dt = torch.promote_types(hidden.dtype, torch.float32)
    tokens = tokens.long()
    logits = hidden.to(dt) @ weight.to(dt).T
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1)
    logp = log_probs.gather(1, tokens[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    div, teacher_logp, topk_mass = (torch.zeros(N, dtype=dt, device=hidden.device) for _ in range(3))
    rows = div_mask.nonzero().squeeze(1)
    if rows.numel() > 0 and distill == "topk":
        topk_mass[rows] = log_probs[rows].exp().topk(min(topk, log_probs.shape[1]), dim=-1).values.sum(-1)
    if rows.numel() > 0:
        t_logits = sum(part.coef * (part.hidden.detach()[rows].to(dt) @ part.weight.detach().to(dt).T) for part in teacher)
        t_logits = t_logits / temperature if temperature != 1.0 else t_logits
        t_lp = torch.log_softmax(t_logits, -1).gather(1, tokens[rows, None]).squeeze(1)
        teacher_logp = teacher_logp.index_put((rows,), t_lp)
        if distill == "token":
            d = (logp[rows] - t_lp).detach()
        else:
            d = distill_divergence(logits[rows], t_logits, alpha, distill, topk, tail)
        div = div.index_put((rows,), d)
    loss = loss_fn(logp, div, teacher_logp, slice(0, N))
    stats = {"logp": logp, "div": div, "teacher_logp": teacher_logp, "entropy": entropy, "topk_mass": topk_mass}
    return loss, {k: v.detach().float() for k, v in stats.items()}


@torch.no_grad()
def sampled_logprobs(hidden, weight, tokens, temperature=1.0, chunk_size=128, matmul_dtype=None):
    """log-softmax(hidden @ weight.T / T) at tokens, [N] fp32, chunked, no grad (e.g. the
    reference model's log-probs for the KL term)."""
    mm = matmul_dtype or hidden.dtype
    dt = torch.promote_types(mm, torch.float32)
    w = weight.to(mm)
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for a in range(0, hidden.shape[0], chunk_size):
        z = (hidden[a:a + chunk_size].to(mm) @ w.T).to(dt)
        if temperature != 1.0:
            z.div_(temperature)
        lse = torch.logsumexp(z, 1)
        out[a:a + chunk_size] = (z.gather(1, tokens[a:a + chunk_size, None].long()).squeeze(1) - lse).float()
    return out


# ----------------------------------------------------------------------------- loss and backward
def select_by_divergence(h, weight, tokens, teacher_logits, distill_weight, *, lengths, cfg, token_loss, options):
    """density_select='disagree': each response keeps its number of distilled tokens, moved to the
    tokens where the divergence to the teacher is largest (one no-grad pass of the token loss)."""
    starts = [0, *itertools.accumulate(lengths)]
    weights = distill_weight.cpu()  # counts and flags from one host copy, not a sync per response
    counts = [int((weights[a:a + n] > 0).sum()) for a, n in zip(starts, lengths)]
    has_teacher = torch.cat([torch.full((n,), k > 0) for n, k in zip(lengths, counts)]).to(h.device)
    with torch.no_grad():  # detached weight: the fused loss then builds no weight gradient
        _, stats = token_loss(h.detach(), weight.detach(), tokens, lambda logp, div, t_logp, rows: logp.sum(),
                              teacher=teacher_logits, div_rows=has_teacher, alpha=cfg["alpha"], distill=cfg["distill"],
                              topk=cfg["topk"], tail=cfg["tail"], temperature=cfg["temperature"], **options)
    selected = torch.zeros_like(distill_weight)
    for a, n, k in zip(starts, lengths, counts):
        if k:
            selected[a + stats["div"][a:a + n].abs().topk(k).indices] = float(weights[a:a + n].max())
    return selected


def loss_chunk_size(cfg, dev):
    return cfg["loss_chunk"] or (128 if dev.type == "cpu" else 512)


def loss_backward(model, batch, cfg, dev, *, teacher=None, initial_model=None, lockstep=None):
    """Forward + backward over the sequences of one optimizer step, in micro-batches.

    batch: a Batch with its loss weights set (build_batch). Sequences with no weight anywhere are
    skipped. teacher: the run's Teacher (None: one of cfg's kind without its own copy, e.g. live);
    initial_model: the KL reference; lockstep (parallel=fsdp: Dist.max_over_ranks): every rank runs
    as many micro-batches, weightless ones where it has fewer. Returns the loss, the phase times and
    the token diagnostics (metrics.TokenSums' fields), summed over the micro-batches."""
    teacher = teacher or Teacher(cfg["teacher"], cfg["teacher_rate"], initial=initial_model)  # (read by sdpo only)
    amp, autocast = amp_dtype(dev, cfg["dtype"]), make_autocast(dev, cfg["dtype"])
    in_loss = [i for i, (p, d) in enumerate(zip(batch.pg_weight, batch.distill_weight)) if p.any() or d.any()]
    in_loss.sort(key=lambda i: len(batch.prompt_ids[i]) + len(batch.response_ids[i]), reverse=True)  # less padding
    sums, diagnostics = dict.fromkeys(("loss", "reference_s", "teacher_s", "student_s"), 0.0), metrics.TokenSums()
    token_loss = fused_token_loss if cfg["fused_loss"] else naive_token_loss
    chunk = loss_chunk_size(cfg, dev)
    options = dict(chunk_size=chunk, matmul_dtype=amp) if cfg["fused_loss"] else {}
    temperature = 1.0 if cfg["algo"] == "sft" else cfg["temperature"]
    n_micro = -(-len(in_loss) // cfg["micro_batch_size"])
    for k in range(lockstep(n_micro) if lockstep else n_micro):  # (fsdp: each pass runs collectives on every rank)
        rows = in_loss[k * cfg["micro_batch_size"]:(k + 1) * cfg["micro_batch_size"]]
        mb = batch.take(rows or [0])
        if not rows:  # a pass without weight, to keep step with the other ranks
            mb.pg_weight, mb.distill_weight = [w * 0 for w in mb.pg_weight], [w * 0 for w in mb.distill_weight]
        tokens = torch.tensor([t for r in mb.response_ids for t in r], device=dev)
        lengths = [len(r) for r in mb.response_ids]
        distill_weight = torch.cat(mb.distill_weight).to(dev)
        div_rows = distill_weight > 0
        ref_logp, teacher_logits, t0 = None, None, time.time()
        with autocast():
            if cfg["kl_coef"] > 0 and cfg["algo"] != "sft":
                with torch.no_grad(), eval_mode(initial_model):
                    w0, s0 = lm_head(initial_model)
                    h0 = response_hidden(initial_model, mb.prompt_ids, mb.response_ids, dev)
                    ref_logp = sampled_logprobs(h0 * s0 if s0 != 1 else h0, w0, tokens, cfg["temperature"], chunk, amp)
            t1 = time.time()
            if cfg["algo"] == "sdpo" and div_rows.any():  # teacher forwards only for responses with a signal
                prompts = [t if w.any() else None for t, w in zip(mb.teacher_prompt_ids, mb.distill_weight)]
                teacher_logits = teacher.logits(model, prompts, mb.response_ids, dev)
            t2 = time.time()
            h = response_hidden(model, mb.prompt_ids, mb.response_ids, dev)
            weight, scale = lm_head(model)  # logits = scale · (h @ weight.T): the scale goes on h
            h = h * scale if scale != 1 else h
        if teacher_logits and cfg["density_select"] == "disagree":
            distill_weight = select_by_divergence(h, weight, tokens, teacher_logits, distill_weight, lengths=lengths, cfg=cfg,
                                                  token_loss=token_loss, options=options)
            div_rows = distill_weight > 0
        old_logp = torch.cat(mb.old_logprobs).to(dev)
        loss_fn = make_loss_fn(
            algo=cfg["algo"], old_logp=old_logp, ref_logp=ref_logp,
            advantage=torch.cat([torch.full((n,), float(a)) for n, a in zip(lengths, mb.advantages)]).to(dev),
            pg_weight=torch.cat(mb.pg_weight).to(dev), distill_weight=distill_weight, clip_low=cfg["clip_low"],
            clip_high=cfg["clip_high"], kl_coef=cfg["kl_coef"], is_clip=cfg["is_clip"], distill=cfg["distill"])
        loss, stats = token_loss(h, weight, tokens, loss_fn, teacher=teacher_logits,
                                 div_rows=div_rows if teacher_logits else None, alpha=cfg["alpha"], distill=cfg["distill"],
                                 topk=cfg["topk"], tail=cfg["tail"], temperature=temperature, **options)
        loss.backward()
        success = None if mb.rewards is None else torch.cat(
            [torch.full((n,), r >= cfg["success_threshold"]) for n, r in zip(lengths, mb.rewards)]).to(dev)
        mb_diagnostics = metrics.token_sums(stats, old_logp, div_rows, success, cfg["clip_low"], cfg["clip_high"])
        mb_diagnostics, (mb_loss,) = mb_diagnostics.on_host(loss.detach().float())  # one host sync per micro-batch
        diagnostics.add(mb_diagnostics if rows else metrics.TokenSums())
        sums["loss"] += mb_loss
        sums["reference_s"] += t1 - t0
        sums["teacher_s"] += t2 - t1
        sums["student_s"] += time.time() - t2
    return {**sums, **asdict(diagnostics)}


# ----------------------------------------------------------------------------- step
def lr_at(it, *, learning_rate, warmup_iters, total_iters, decay_lr, min_lr):
    """Linear warmup, then constant, or a cosine from learning_rate to min_lr at the last iteration."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    if decay_lr:
        progress = (it + 1 - warmup_iters) / max(1, total_iters - warmup_iters)
        return min_lr + 0.5 * (learning_rate - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
    return learning_rate


def set_lr(optimizer, it, **schedule):
    """The optimizer's learning rate at iteration it (lr_at), returned."""
    lr = lr_at(it, **schedule)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def optimizer_step(model, optimizer, grad_clip):
    """Clip and step; raise Collapse on a non-finite gradient (no step taken) or when the step left
    non-finite weights (an overflowing learning rate): sampling from them would fail next."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise Collapse(f"gradient norm is {norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(torch.stack(torch._foreach_norm(list(model.parameters())))).all():
        raise Collapse("the weights are not finite after the optimizer step (the update overflowed)")
    return norm.item()


# ----------------------------------------------------------------------------- eval
@torch.no_grad()
def sample_and_score(model, tokenizer, tasks, *, n, temperature, top_p, max_new_tokens, batch_prompts, generator,
             enable_thinking=False, success_threshold=1.0, progress=False, static=False, max_rows=0,
             math_checker="builtin"):
    """Sample n responses per task; return mean@n, pass@n, mean length, the fraction cut off at
    max_new_tokens, and per-task scores/texts."""
    scores, texts, lengths, cut = [], [], [], []
    eos_ids = stop_token_ids(model, tokenizer)
    # progress bars only on a terminal (disable=None): a log file gets the eval line, not the bar
    for start in tqdm(range(0, len(tasks), batch_prompts), desc="eval", disable=None if progress else True, leave=False,
                      file=sys.stdout):
        chunk = tasks[start:start + batch_prompts]
        prompts = [prompt_ids(tokenizer, t["messages"], enable_thinking) for t in chunk]
        out = generate(model, prompts, group_size=n, max_rows=max_rows, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id,
                       generator=generator, static=static)
        decoded = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        scored = rewards_of([task for task in chunk for _ in range(n)], decoded, math_checker)
        for i, task in enumerate(chunk):
            rows = range(i * n, (i + 1) * n)
            scores.append([scored[r][0] for r in rows])
            texts.append([decoded[r] for r in rows])
            lengths.extend(len(out.response_ids[r]) for r in rows)
            cut.extend(out.truncated[r] for r in rows)
    # a rank's share of a set smaller than the ranks may be empty: score_across_ranks summarises them all
    return {**(accuracy_summary(scores, threshold=success_threshold) if scores else {}),
            "mean_len": sum(lengths) / max(len(lengths), 1), "truncated": sum(cut) / max(len(cut), 1),
            "scores": scores, "texts": texts}


# ----------------------------------------------------------------------------- main
@dataclass
class Run:
    """What a run holds from setup to its end; train_loop and its helpers read it as run.model, ..."""
    model: torch.nn.Module  # the student
    tokenizer: object
    optimizer: torch.optim.Optimizer
    teacher: Teacher  # None unless algo='sdpo'
    initial_model: torch.nn.Module  # frozen; None unless the KL term, the teacher or a stage reset reads it
    state: checkpoint.TrainState
    stages: list  # [(dataset name, iterations)]
    eval_names: list  # the eval sets, in the accuracy matrix's column order
    train_tasks: dict  # stage dataset name -> tasks
    eval_tasks: dict  # eval set -> tasks
    eval_demos: dict  # eval set -> tasks whose prompt is the teacher's (reference solution as demonstration)
    log: metrics.RunLog
    ckpt_dir: str


def setup(cfg, ddp, stack):
    """Everything before the first iteration: data, model, teacher copies, optimizer, resumed state.
    A fresh run's every input is checked (config, data files, model, optional packages) before out_dir
    is touched, and an earlier run's outputs are only replaced with --overwrite=True, after all checks;
    a resume takes the folder's lock (and mends what a crash left) before it reads the checkpoint."""
    dev, out_dir = ddp.device, cfg["out_dir"]
    ckpt_dir, resume = os.path.join(out_dir, "ckpt"), cfg["init_from"] == "resume"
    stages = parse_stages(cfg["stages"], cfg["dataset"], cfg["max_iters"])
    eval_names = list(dict.fromkeys([s.strip() for s in cfg["eval_sets"].split(",") if s.strip()] or
                                    [n for name, _ in stages for n in name.split("+")]))
    train_tasks = {name: load_tasks(name, "train", cfg["data_dir"], need_solution=cfg["algo"] == "sft") for name, _ in stages}
    eval_tasks = {name: load_tasks(name, "test", cfg["data_dir"])[:cfg["eval_max_prompts"] or None] for name in eval_names}
    ddp.check_same(task_files.fingerprint(train_tasks, eval_tasks), f"the task files under data_dir={cfg['data_dir']}")
    wandb = require("wandb", "wandb_log=True") if cfg["wandb_log"] and ddp.master else None  # optional packages
    if cfg["math_checker"] == "math_verify":
        require("math_verify", "math_checker=math_verify", "math-verify")
    data = checkpoint.fingerprints(task_files.resolve(cfg["data_dir"]),
                                   [(n, "train") for n in train_tasks] + [(n, "test") for n in eval_tasks])
    log = metrics.RunLog(out_dir, cfg["log_jsonl"], None, ddp.master)
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    if resume and checkpoint.newest_complete(ckpt_dir) is None:  # before take_over creates out_dir
        checkpoint.read_state(ckpt_dir)  # its one line: not a checkpoint
    teacher_init = base_print = None
    if not resume:
        checkpoint.check_init_outside(cfg["init_from"], out_dir, cfg["overwrite"])
        model, tokenizer = load_student(cfg["init_from"], ddp.load_device, cfg)  # fsdp: on the CPU, until sharded
        eval_demos = fit_prompts(train_tasks, eval_tasks, model, tokenizer, cfg, log)
        teacher_init = load_teacher_init(cfg, model, ddp.load_device)
        if not cfg["lora_rank"]:  # a resume rereading it and eval.py's base are checked against this (LoRA: the adapter's)
            base_print = base_fingerprint(model)
    if ddp.master:  # from here on, this run owns out_dir (a fresh run's inputs are all checked by now)
        for note in stack.enter_context(checkpoint.take_over(out_dir, resume, cfg["overwrite"])):
            log.say(note)
    ddp.barrier()
    if resume:
        saved = checkpoint.read_state(ckpt_dir)  # a damaged or foreign state.json is one line, before any change
        checkpoint.check_same_run(saved, ddp.world, data)
        saved_stages = parse_stages(saved["config"]["stages"], saved["config"]["dataset"], saved["config"]["max_iters"])
        checkpoint.check_resume(saved["config"], cfg, saved_stages, stages, saved)  # may reopen the last stage in `saved`
        for note in resume_notes(saved["config"], cfg, saved_stages, stages, saved["iter"]):
            log.say(note)
        if ddp.master:  # a crash between saving ckpt/ and linking it as ckpt_good/
            checkpoint.redo_keep_as_good(ckpt_dir, ckpt_dir + "_good", saved)
        eval_names = checkpoint.kept_eval_sets(saved["accuracy_matrix"], eval_names, log.say)
        eval_tasks = {n: eval_tasks[n] for n in eval_names}
        model, tokenizer = load_student(saved["base_init"] if cfg["lora_rank"] else ckpt_dir, ddp.load_device, cfg)  # LoRA: + adapter/
        eval_demos = fit_prompts(train_tasks, eval_tasks, model, tokenizer, cfg, log)
    # the guard's memory starts at the first eval (train_loop); a resumed run's comes with the rest
    state = checkpoint.TrainState(generator=make_generator(stream_seed(cfg["seed"], ddp.rank, 0), dev), data_rng=random.Random(cfg["seed"]),
                                  base_init=saved["base_init"] if resume else cfg["init_from"], world=ddp.world,
                                  data=data, base_fingerprint=saved.get("base_fingerprint") if resume else base_print)
    note = None if resume else checkpoint.source_note(cfg["init_from"])  # another run's checkpoint: which iteration
    if note:
        log.say(note)
    if not has_chat_template(tokenizer):
        log.say(f"note: {cfg['init_from']}'s tokenizer has no chat template: prompts are the messages' text, one per line")
    for note in unused_settings(cfg, defaults={k: v for k, v in globals().items() if k in cfg},
                                vocab=model.get_output_embeddings().weight.shape[0]):
        log.say(note)
    disable_dropout(model).train()  # dropout off (the RL references' choice): ρ = 1 before any update
    if cfg["grad_checkpointing"]:
        enable_grad_checkpointing(model)
    # parallel=fsdp: each model loaded on the CPU and sharded as soon as it exists, so that no model is ever whole
    # on the device (shard_model moves it there a block at a time; its copies are born sharded: frozen_copy)
    param_dtype = amp_dtype(dev, cfg["dtype"])
    ddp.shard(model, param_dtype=param_dtype)
    initial_model = None  # the initial model: KL reference, frozen / trust-region teacher, 'initial' stage reset
    if needs_initial_model(cfg):  # under LoRA the base view: the student with its adapter left out, nothing copied
        initial_model = (base_view(model) if cfg["lora_rank"] else
                         load_model(state.base_init, ddp.load_device, scratch=cfg)[0].eval().requires_grad_(False) if resume
                         else frozen_copy(model))  # resume: reread base_init; fresh: copy the student just loaded
    if resume and initial_model is not None and not cfg["lora_rank"]:
        checkpoint.check_base(state, initial_model)  # the model base_init names now is the one the run started from
    ddp.shard(initial_model, param_dtype=param_dtype)  # (a resumed run's, loaded on the CPU)
    teacher = Teacher.create(cfg, model, initial_model, teacher_init)
    del teacher_init
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg["learning_rate"],  # LoRA: adapters
                                  betas=(cfg["beta1"], cfg["beta2"]), weight_decay=cfg["weight_decay"])
    if resume:
        rng = checkpoint.load_trainer(ckpt_dir, saved, model, optimizer, teacher and teacher.checkpointed)
        if not state.restore(saved, rng[f"sampling.{ddp.rank}"]):  # moved between a CPU and a GPU
            state.generator.manual_seed(stream_seed(cfg["seed"], ddp.rank, 3 + state.iter))
            log.say(f"note: the checkpoint's sampling RNG is another device type's than {dev.type}'s: reseeded, so "
                    "the rollouts from here on differ from those an uninterrupted run would sample")
        if ddp.master:
            for name in ("log.jsonl", "samples.jsonl"):  # the iterations after the checkpoint are redone
                checkpoint.truncate_log(os.path.join(out_dir, name), state.iter)
        where = (f"stage {state.stage + 1}/{len(stages)}, step {state.stage_iter}" if state.stage < len(stages)
                 else "every stage done")
        log.say(f"resumed from {ckpt_dir} at iteration {state.iter} ({where})")
    if wandb:
        log.wandb = wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"], config=cfg)
    return Run(model=model, tokenizer=tokenizer, optimizer=optimizer, teacher=teacher, initial_model=initial_model,
               state=state, stages=stages, eval_names=eval_names, train_tasks=train_tasks, eval_tasks=eval_tasks,
               eval_demos=eval_demos, log=log, ckpt_dir=ckpt_dir)


def resume_notes(saved_cfg, cfg, saved_stages, stages, it):
    """What a resume allowed to change (checkpoint.RESUMABLE) does to the run: a key that changes its
    numbers (checkpoint.NOT_BIT_FOR_BIT), a cosine stretched over a longer run."""
    notes = []
    changed = [f"{k} {saved_cfg[k]!r} -> {cfg[k]!r}" for k in checkpoint.NOT_BIT_FOR_BIT
               if k in saved_cfg and saved_cfg[k] != cfg[k]]
    if changed:
        notes.append(f"note: {', '.join(changed)} since the checkpoint: the run goes on, but its numbers from here on "
                     "may differ from an uninterrupted run's (other random draws in the rollouts, or another floating-point order)")
    old, new = (sum(n for _, n in s) for s in (saved_stages, stages))
    if cfg["decay_lr"] and new != old and it >= cfg["warmup_iters"]:
        schedule = dict(learning_rate=cfg["learning_rate"], warmup_iters=cfg["warmup_iters"], decay_lr=True,
                        min_lr=cfg["min_lr"])
        was, now = lr_at(it - 1, total_iters=old, **schedule), lr_at(it, total_iters=new, **schedule)
        notes.append(f"note: decay_lr: the cosine now spans {new} iterations, not {old}: the learning rate goes from "
                     f"{was:.3g} at iteration {it} to {now:.3g} at iteration {it + 1} (a run planned at {new} decays smoothly)")
    return notes


def needs_initial_model(cfg):
    """Whether the run keeps the initial model: the KL reference, a frozen / trust-region teacher, an
    'initial' stage reset (tests/bench/memory_estimate.py counts its copy from this too)."""
    return (cfg["algo"] != "sft" and cfg["kl_coef"] > 0) or (cfg["algo"] == "sdpo" and (
        Teacher.needs_initial(cfg["teacher"]) or cfg["teacher_stage_reset"] == "initial"))


def fit_prompts(train_tasks, eval_tasks, model, tokenizer, cfg, log):
    """The tasks that fit the model's context (models.fit_tasks), the others left out and counted:
    prompts up to max_prompt_len (default: the context minus max_new_tokens), SFT solutions whole.
    Returns an SDPO run's eval-time teacher prompts per eval set (each task that has a solution,
    with it as the demonstration), those that fit as the training teacher's must."""
    cap, context = prompt_budget(model, cfg["max_new_tokens"], cfg["max_prompt_len"])
    fit = functools.partial(fit_tasks, tokenizer=tokenizer, enable_thinking=cfg["enable_thinking"], say=log.say)
    for sets, whole in ((train_tasks, context if cfg["algo"] == "sft" else None), (eval_tasks, None)):
        for name in sets:
            sets[name] = fit(sets[name], name, cap=cap, context=whole)
    demos = {name: [dict(t, messages=teacher_messages(t["messages"], t["solution"], None, cfg)) for t in tasks
                    if t.get("solution")] for name, tasks in eval_tasks.items()} if cfg["algo"] == "sdpo" else {}
    limit = min(cfg["max_reprompt_len"], context - cfg["max_new_tokens"])
    return {name: fit(d, f"{name} (eval teacher prompts)", cap=limit, required=False) for name, d in demos.items() if d}


def score_and_log_eval_sets(run, cfg, ddp, tag):
    """Score every eval set (tasks sharded over ranks), log one record with a key per set (eval/<set>/
    mean@n, so wandb keeps every curve), and return {set: mean@n}, {set: mean response length}. An SDPO
    run also scores its teacher reading each prompt with the reference solution as the demonstration
    (eval/<set>/teacher_mean@n): it shows when the teacher stops being better than the student."""
    state, n = run.state, cfg["eval_n"]
    teacher = run.teacher and run.teacher.eval_model(run.model)
    # the same samples each eval; the sets share one stream, so a set's samples depend on the sets before it in
    # eval_sets (one generator per set would change every accuracy matrix RESULTS.md reports)
    generators = [make_generator(stream_seed(cfg["seed"], ddp.rank, k), ddp.device) for k in (1, 2)]
    row, lengths, record = {}, {}, {"iter": state.iter, "eval_tag": tag}
    for name, tasks in run.eval_tasks.items():
        acc, lengths[name] = score_across_ranks(run, cfg, ddp, run.model, tasks, generators[0])
        row[name] = acc[f"mean@{n}"]
        record.update({f"eval/{name}/{k}": v for k, v in acc.items()}, **{f"eval/{name}/mean_len": lengths[name]})
        if cfg["algo"] != "sdpo" or teacher is None:
            continue
        demos = run.eval_demos.get(name)
        if demos:
            record[f"eval/{name}/teacher_mean@{n}"] = score_across_ranks(run, cfg, ddp, teacher, demos, generators[1])[0][f"mean@{n}"]
            record[f"eval/{name}/teacher_prompts"] = len(demos)  # those with a solution that fit: maybe a subset
    run.log.record(record)
    taught = {name: record.get(f"eval/{name}/teacher_mean@{n}") for name in row}

    def teacher_note(name):
        m, of = record[f"eval/{name}/teacher_prompts"], len(run.eval_tasks[name])
        return f" (teacher {taught[name]:.3f}" + (f" on {m} of its {of} prompts)" if m < of else ")")

    def cut_note(name):  # an answer format longer than max_new_tokens scores 0 without another sign
        cut = record[f"eval/{name}/truncated"]
        return f" ({cut:.0%} cut off at max_new_tokens={cfg['max_new_tokens']})" if cut > 0 else ""
    run.log.say(f"eval @ iter {state.iter} ({tag}): " + ", ".join(
        f"{k} mean@{n} {v:.3f}" + cut_note(k) + (teacher_note(k) if taught[k] is not None else "") for k, v in row.items()))
    return row, lengths


def score_across_ranks(run, cfg, ddp, model, tasks, generator):
    """mean@n / pass@n and the mean response length of `model` on one eval set, over every rank."""
    n = cfg["eval_n"]
    with make_autocast(ddp.device, cfg["dtype"])(), gathered(model):  # ranks may score unequal shares
        res = sample_and_score(model, run.tokenizer, tasks[ddp.rank::ddp.world], n=n, temperature=cfg["eval_temperature"],
                               top_p=cfg["eval_top_p"], max_new_tokens=cfg["max_new_tokens"],
                               batch_prompts=max(1, cfg["batch_prompts"] * cfg["group_size"] // n), generator=generator,
                               enable_thinking=cfg["enable_thinking"], success_threshold=cfg["success_threshold"],
                               static=use_static_rollout(cfg["static_rollout"], ddp.device), max_rows=cfg["gen_batch_size"],
                               progress=ddp.master, math_checker=cfg["math_checker"])
    rows = n * len(res["scores"])  # this rank's responses; the means are over every rank's
    per_rank = ddp.gather((res["scores"], res["mean_len"] * rows, res["truncated"] * rows))
    scores = [row for rank_scores, _, _ in per_rank for row in rank_scores]
    total = n * len(scores)
    acc = accuracy_summary(scores, threshold=cfg["success_threshold"])
    acc["truncated"] = sum(c for _, _, c in per_rank) / total  # cut off at max_new_tokens
    return acc, sum(t for _, t, _ in per_rank) / total


def save_checkpoint(run, cfg, ddp, passed=None):
    """Save model, optimizer, teacher, every rank's sampling RNG, the data order and the guard (rank 0
    writes); passed: this iteration's eval row when it passed the collapse guard -- ckpt_good/ becomes
    this checkpoint too."""
    model, state = run.model, run.state
    # ranks must hold identical weights (same init, same all-reduced steps): check cheaply
    if ddp.world > 1 and cfg["parallel"] == "ddp":
        sums = ddp.gather(sum(p.detach().sum(dtype=torch.float64).item() for p in model.parameters()))
        run.log.record({"iter": state.iter, "rank_param_sums": sums})
        if len(set(sums)) > 1:
            raise UserError(f"ranks diverged: parameter sums {sums}")
    rng_states = ddp.gather(state.generator.get_state())
    full = checkpoint.gather_full(model, run.optimizer, run.teacher and run.teacher.checkpointed)  # fsdp: on rank 0
    if passed is not None:
        state.guard.good = {"iter": state.iter, "acc": passed}
    if ddp.master:
        checkpoint.save(run.ckpt_dir, model=model, tokenizer=run.tokenizer, optimizer=run.optimizer,
                        teacher_model=run.teacher and run.teacher.checkpointed, save_dtype=cfg["save_dtype"],
                        state=state.to_json(cfg), full=full,
                        rng_tensors={f"sampling.{r}": g for r, g in enumerate(rng_states)})
        if passed is not None:
            checkpoint.keep_as_good(run.ckpt_dir, run.ckpt_dir + "_good")
    ddp.barrier()


def start_stage(run, cfg):
    """A stage boundary: optionally a fresh optimizer, and the teacher per teacher_stage_reset."""
    if cfg["reset_optimizer"]:
        run.optimizer.state.clear()
    if run.teacher is not None:
        run.teacher.start_stage(cfg["teacher_stage_reset"], run.model, run.initial_model)


def end_stage(run, cfg, ddp, stage, name):
    """A row of the accuracy matrix (every eval set), a model snapshot, a checkpoint."""
    state = run.state
    row, lengths = score_and_log_eval_sets(run, cfg, ddp, f"end of stage {stage + 1}")
    passed = row if metrics.check_eval(state.guard, row, lengths, cfg, metrics.trained_sets(run.stages, name)) else None
    state.accuracy_matrix["stages"].append(name)
    state.accuracy_matrix["rows"].append([row[s] for s in run.eval_names])
    if ddp.master:
        checkpoint.write_json(os.path.join(cfg["out_dir"], "accuracy_matrix.json"), state.accuracy_matrix)
    if len(run.stages) > 1:
        save_stage_snapshot(run, cfg, ddp, stage)
    state.stage, state.stage_iter = stage + 1, 0
    save_checkpoint(run, cfg, ddp, passed=passed)


def stage_snapshot_dir(cfg, stage, name):
    return os.path.join(cfg["out_dir"], f"stage{stage + 1}_{name.replace('/', '_').replace('+', '_')}")


def save_stage_snapshot(run, cfg, ddp, stage, only_if_missing=False):
    """The model after stage `stage` as a plain HF folder (eval.py's drift per stage reads it).
    only_if_missing: rank 0's view of the folder decides for every rank (fsdp gathers the weights)."""
    snap = stage_snapshot_dir(cfg, stage, run.stages[stage][0])
    if only_if_missing and ddp.gather(os.path.isdir(snap))[0]:
        return
    weights = full_state_dict(run.model) if cfg["parallel"] == "fsdp" else None  # every rank takes part
    if ddp.master:
        checkpoint.save_snapshot(snap, run.ckpt_dir, run.model, run.tokenizer, state_dict=weights)


def main(cfg):
    check_config(cfg)
    ddp = Dist(cfg["device"], cfg["parallel"])
    if cfg["batch_prompts"] % ddp.world:
        raise UserError(f"batch_prompts={cfg['batch_prompts']} must be divisible by the {ddp.world} ranks")
    with ddp.lost_rank_is_one_line(), contextlib.ExitStack() as stack:  # stack: out_dir's lock, until the run ends
        run = setup(cfg, ddp, stack)
        try:
            train_loop(run, cfg, ddp)
        except Collapse as e:
            raise UserError(metrics.collapse_message(run.ckpt_dir, run.state.iter, run.state.guard.good, e)) from None
    run.log.say(f"done: {run.state.iter} iterations; model in {run.ckpt_dir}")
    if run.log.wandb:
        run.log.wandb.finish()
    if ddp.world > 1:
        dist.destroy_process_group()


def train_loop(run, cfg, ddp):
    """The stages, each a loop of iterations: rollout -> loss -> step -> log -> eval / checkpoint."""
    model, optimizer, state, dev = run.model, run.optimizer, run.state, ddp.device
    detokenize = functools.partial(run.tokenizer.decode, skip_special_tokens=False)  # (decode() is the rollout's)
    total_iters = sum(iters for _, iters in run.stages)
    share = cfg["batch_prompts"] // ddp.world
    autocast = make_autocast(dev, cfg["dtype"])
    # stuck: consecutive iterations per warning (metrics.stuck_warnings); step_memory: the train step's peak (CUDA)
    step_memory, batch, my_tasks, stuck = StepMemory(), None, None, {}
    log_vocab = math.log(model.get_output_embeddings().weight.shape[0])  # the runaway-loss guard's scale
    grpo_in_loss = cfg["algo"] == "grpo" or (cfg["algo"] == "sdpo" and cfg["grpo_mix"] > 0)  # for the stuck warnings
    if cfg["stages"]:  # the stages name their datasets and iterations: a max_iters or dataset given beside them is unused
        run.log.say(f"stages {', '.join(f'{n}:{i}' for n, i in run.stages)}: {total_iters} iterations "
                    f"(with stages set, max_iters={cfg['max_iters']} and dataset={cfg['dataset']} are not used)")
    if state.accuracy_matrix is None:  # the initial model: the guard's first bests, and ckpt_good until an eval passes
        base = score_and_log_eval_sets(run, cfg, ddp, "start")[0]
        state.accuracy_matrix = {"eval_sets": run.eval_names, "stages": [], "rows": [], "base": base}
        state.guard = metrics.Guard(best=dict(base))
        save_checkpoint(run, cfg, ddp, passed=base)
    for stage in range(state.stage, len(run.stages)):
        name, iters = run.stages[stage]
        tasks, trained = run.train_tasks[name], metrics.trained_sets(run.stages, name)  # trained: the guard's judged sets
        if stage > 0 and state.stage_iter == 0:
            # a one-stage run extended by stages (a resume) wrote no snapshot at its end: its weights are these
            save_stage_snapshot(run, cfg, ddp, stage - 1, only_if_missing=True)
            start_stage(run, cfg)
        stage_desc = f"stage {stage + 1}/{len(run.stages)} {name}" if len(run.stages) > 1 else name
        while state.stage_iter < iters:
            t0 = time.time()
            lr = set_lr(optimizer, state.iter, learning_rate=cfg["learning_rate"], warmup_iters=cfg["warmup_iters"],
                        total_iters=total_iters, decay_lr=cfg["decay_lr"], min_lr=cfg["min_lr"])
            # this step's prompts: the same global batch on every rank, whole groups per rank
            step_tasks = [state.data_rng.choice(tasks) for _ in range(cfg["batch_prompts"])]
            my_tasks = step_tasks[ddp.rank * share:(ddp.rank + 1) * share]
            # rollout, reward, advantages, teacher context, loss weights
            batch, rollout_metrics = build_batch(my_tasks, model, run.tokenizer, cfg, state.generator, dev,
                                                 autocast=autocast, global_sum=ddp.global_sum, progress=ddp.master)
            t1 = time.time()
            step_memory.before_step(dev)  # CUDA: the decode state goes unless it fits beside the step
            # student (and teacher) forward and backward, in micro-batches; a diverging loss stops the run
            with gathered(run.teacher and run.teacher.own, run.initial_model if cfg["kl_coef"] > 0 else None):  # fsdp
                loss_metrics = loss_backward(model, batch, cfg, dev, teacher=run.teacher, initial_model=run.initial_model,
                                             lockstep=ddp.max_over_ranks if cfg["parallel"] == "fsdp" else None)
            # the whole step's loss (every rank's share), so that every rank takes the same decision
            metrics.check_loss(state.guard, ddp.global_sum([loss_metrics["loss"]])[0], log_vocab=log_vocab,
                               stop=cfg["stop_on_collapse"])
            ddp.all_reduce_grads(model)
            t2 = time.time()
            # optimizer step, then the EMA teacher follows the student
            grad_norm = optimizer_step(model, optimizer, cfg["grad_clip"])
            if run.teacher is not None:
                run.teacher.after_step(model)
            step_memory.after_step(dev)
            t3 = time.time()
            state.iter += 1
            state.stage_iter += 1
            # log
            record = {"iter": state.iter, "stage": name, "lr": lr, "grad_norm": grad_norm,
                      "optimizer_s": t3 - t2, "train_s": t3 - t1, "iter_s": t3 - t0}
            metrics.iteration_record(record, rollout_metrics, loss_metrics, algo=cfg["algo"], distill=cfg["distill"],
                                     world=ddp.world, global_sum=ddp.global_sum,
                                     ratio_max=max(ddp.gather(loss_metrics["ratio_max"])))
            run.log.record(record)
            run.log.say(metrics.console_line(stage_desc, record, total_iters))
            for warning in metrics.stuck_warnings(record, stuck, cfg["algo"], grpo_in_loss=grpo_in_loss):
                run.log.say(warning)
            # periodic eval (the collapse guard) and checkpoint; the end of a stage has its own
            last, passed = state.stage_iter == iters, None
            eval_due = not last and cfg["eval_interval"] and state.stage_iter % cfg["eval_interval"] == 0
            if eval_due:
                run.log.samples(metrics.sample_rows(batch, my_tasks, cfg["group_size"], detokenize, state.iter))
                row, lengths = score_and_log_eval_sets(run, cfg, ddp, "periodic")
                passed = row if metrics.check_eval(state.guard, row, lengths, cfg, trained) else None  # may stop
            if (eval_due and not cfg["save_interval"]) or (
                    cfg["save_interval"] and state.stage_iter % cfg["save_interval"] == 0 and not last):
                save_checkpoint(run, cfg, ddp, passed=passed)
        # end of stage: a few rollouts, a row of the accuracy matrix, a snapshot, a checkpoint
        if batch is not None:
            run.log.samples(metrics.sample_rows(batch, my_tasks, cfg["group_size"], detokenize, state.iter))
        end_stage(run, cfg, ddp, stage, name)


# ============================================================================= appendix: the fused loss
# The same loss as naive_token_loss, computed in chunks (fused_loss=True, the default): nothing above
# needs reading it to follow the algorithm. fused_token_loss (at the end) is called where
# naive_token_loss is, with the same arguments and result; tests/test_loss.py holds the two to each
# other. Products in the matmul dtype (bf16 under autocast), softmax and divergence maths in fp32.

def _logits_into(buf, parts, transposed=False):
    """sum_i h_i @ w_i.T over parts [(h_i [c, H], w_i [V, H])] as fp32 (the buffer's dtype) [c, V],
    written into the flat buffer buf. Same-dtype products write straight into it, bf16 ones too where
    torch has fp32-output GEMMs (CUDA; else taken in bf16 and copied in). transposed=True (same dtype
    only) computes w @ h.T (MKL is ~1.4x faster at it for few rows) and returns its transpose, a
    strided view: fine for elementwise ops, reductions and gathers, slow for topk."""
    c, V = parts[0][0].shape[0], parts[0][1].shape[0]
    out = buf[: c * V].view(V, c) if transposed else buf[: c * V].view(c, V)
    for i, (h, w) in enumerate(parts):
        a, b = (w, h.T) if transposed else (h, w.T)
        if a.dtype != out.dtype:
            if not fp32_out_mm(out, a, b, accumulate=i > 0):  # no fp32-output GEMM here: a bf16 product
                out.add_(a @ b) if i else out.copy_(a @ b)
        elif i == 0:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
    return out.T if transposed else out


def _add_product(acc, a, b, rows_per_slice=16384):
    """acc += a @ b. When a, b are bf16 and acc fp32: one fp32-output GEMM where torch has it
    (no read-modify-write of acc through a bf16 temporary), else the product in bf16 (tensor cores)
    a slice of acc's rows at a time, so the bf16 temporary stays small."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if fp32_out_mm(acc, a, b, accumulate=True):
        return
    for r in range(0, acc.shape[0], rows_per_slice):
        acc[r:r + rows_per_slice] += a[r:r + rows_per_slice] @ b


def _gathered_logits(parts, idx, max_elems):
    """sum_i <h_i[r], w_i[idx[r, j]]> for parts [(h_i [n, H], w_i [V, H])] and idx [n, k]: logits
    at a few vocab entries per row without the [n, V] product; row blocks keep the gathered
    [rows, k, H] weights under max_elems (or 32 rows). Taken as _logits_into takes the full row they
    are set against (the teacher's max and log-normaliser): fp32-output GEMMs where torch has them,
    else bf16 products summed in fp32. A bf16-rounded top-k beside an exact normaliser is off by up
    to ~0.06 at logit 20 and can put the teacher's top-k mass above 1."""
    n, k = idx.shape
    V, H = parts[0][1].shape
    dt = torch.promote_types(parts[0][0].dtype, torch.float32)
    if 4 * k >= V:  # k is a large share of the vocab: one [n, V] product is cheaper than gathering w rows
        return _logits_into(torch.empty(n * V, dtype=dt, device=idx.device), parts).gather(1, idx)
    out = torch.empty(n, k, dtype=dt, device=idx.device)
    step = max(32, max_elems // (k * H))  # at least 32 rows per bmm: never a loop over single rows
    for r in range(0, n, step):
        acc = 0
        for h, w in parts:
            a, b = w[idx[r:r + step]], h[r:r + step, :, None]
            product = fp32_out_bmm(a, b) if a.dtype != dt else None
            acc = acc + (torch.bmm(a, b) if product is None else product).squeeze(2).to(dt)
        out[r:r + step] = acc
    return out


def _full_divergence_and_grad(s, t, p, alpha):
    """Full-vocab divergence [n] of student log-probs s from teacher log-probs t (student p = exp(s),
    teacher q = exp(t)) and its gradient w.r.t. the student logits [n, V], in closed form. s is scratch."""
    if alpha == 0:  # KL(q||p); grad p - q
        q = t.exp()
        d = (q * (t - s)).sum(1)
        return d, q.neg_().add_(p)
    if alpha == 1:  # KL(p||q); grad p (log p - log q - KL)
        r = s.sub_(t)
        d = (p * r).sum(1)
        return d, r.sub_(d[:, None]).mul_(p)
    # JSD; grad (1 - alpha) p (log p - log m - KL(p||m))
    log_m = torch.logaddexp(s + math.log(1 - alpha), t + math.log(alpha))
    kl_qm = (t.exp() * (t - log_m)).sum(1)
    s_m = s.sub_(log_m)
    del log_m
    kl_pm = (p * s_m).sum(1)
    d = (1 - alpha) * kl_pm + alpha * kl_qm
    return d, s_m.sub_(kl_pm[:, None]).mul_(p).mul_(1 - alpha)


def _teacher_chunk(t_parts, buf, y, full, transposed):
    """The teacher's log-normaliser pieces for a chunk's distillation rows: (log-prob at y [nd],
    row max [nd], log-normaliser [nd], full log-probs [nd, V] or None). Log-probs are computed as
    (z - max) - log_norm, in that order, so they are precise near the max (top-k buckets need it)."""
    zt = _logits_into(buf, t_parts, transposed)
    zt_y = zt.gather(1, y).squeeze(1)
    t_max = zt.amax(1)
    zt.sub_(t_max[:, None])
    if full:
        t_log_norm = torch.logsumexp(zt, 1)
        return zt_y - t_max - t_log_norm, t_max, t_log_norm, zt.sub_(t_log_norm[:, None])
    t_log_norm = zt.exp_().sum(1).log()
    return zt_y - t_max - t_log_norm, t_max, t_log_norm, None


def _loss_grads(loss_fn, logp, div, tlogp, *, rows, d_idx, distill, topk_graph):
    """The caller's loss on a chunk's [c] vectors, and by a tiny local autograd: d loss / d logp [c],
    d loss / d div at the distillation rows [nd] (None for "token", where div is a constant), and
    back through the top-k buckets d loss / d s_k [nd, k] (topk_graph: the divergence and s_k)."""
    with torch.enable_grad():
        logp_leaf = logp.clone().requires_grad_()
        div_leaf = div.clone().requires_grad_(distill != "token")
        out = loss_fn(logp_leaf, div_leaf, tlogp, rows)
        leaves = [logp_leaf, div_leaf] if distill != "token" else [logp_leaf]
        grads = torch.autograd.grad(out, leaves, allow_unused=True) if out.requires_grad else [None] * len(leaves)
        g_logp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
        g_div = grads[1][d_idx] if distill != "token" and grads[1] is not None else None
        g_sk = None
        if topk_graph is not None and g_div is not None:
            (g_sk,) = torch.autograd.grad(topk_graph[0], topk_graph[1], grad_outputs=g_div)
    return out, g_logp, g_div, g_sk


def _logit_grads(p, *, log_norm, y, g_logp, d_idx, all_div, g_sk, top_idx, ddiv_dz, g_div):
    """d loss / d z for a chunk, in place in the probability buffer p (normalised, or exp(z - max)
    with its log_norm). With s = log_softmax(z): dL/dz = G - p * sum(G), G = dL/ds, which is sparse
    but for "full": nonzero at y (from logp) and at the top-k (g_sk); "full" adds its closed-form
    divergence gradient ddiv_dz, scaled by g_div."""
    g_sum = g_logp.clone()
    if g_sk is not None:
        g_sum[d_idx] += g_sk.sum(1)
    scale = -g_sum if log_norm is None else -g_sum * torch.exp(-log_norm)
    dz = p.mul_(scale[:, None])
    dz.scatter_add_(1, y, g_logp[:, None])
    if g_sk is not None and all_div:
        dz.scatter_add_(1, top_idx, g_sk)
    elif g_sk is not None:
        dz.index_put_((d_idx[:, None].expand_as(top_idx), top_idx), g_sk, accumulate=True)
    if ddiv_dz is not None:
        ddiv_dz.mul_(g_div[:, None])
        if all_div:
            dz.add_(ddiv_dz)
        else:
            dz.index_add_(0, d_idx, ddiv_dz)
    return dz


class _FusedTokenLoss(torch.autograd.Function):
    """Chunked forward that also computes d loss / d hidden and d loss / d weight (the output is a
    scalar, so the backward only has to scale them). Per chunk of rows, in order: the teacher's
    logits (distillation rows only), the student's logits and softmax, the divergence, the
    caller's loss and its gradient w.r.t. log-probs and divergence, then d loss / d logits and
    the two products that carry it to hidden and weight."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, loss_fn, teacher, div_mask, alpha, distill, topk, tail, temperature,
                chunk_size, matmul_dtype):
        N, H = hidden.shape
        V, dev = weight.shape[0], hidden.device
        mm = matmul_dtype or hidden.dtype  # matmul dtype
        dt = torch.promote_types(mm, torch.float32)  # softmax / divergence dtype
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = tokens.long()
        full = distill == "full"
        k = min(topk, V) if distill == "topk" else 0
        w = weight.detach().to(mm)  # no copy when weight is already in mm
        # teacher parts (hidden, weight, coef / T): the scale goes on the [rows, H] hidden states
        teacher = [(h_t.detach(), w_t.detach().to(mm), float(coef) / temperature) for h_t, w_t, coef in teacher or []]
        grad_h = torch.empty(N, H, dtype=dt, device=dev) if need_gh else None
        grad_w = torch.zeros(V, H, dtype=torch.promote_types(weight.dtype, dt), device=dev) if need_gw else None
        logp_all, div_all, tlogp_all, ent_all, mass_all = (torch.zeros(N, dtype=dt, device=dev) for _ in range(5))
        total = torch.zeros((), dtype=dt, device=dev)
        div_mask_cpu = div_mask.cpu()  # one host sync; per-chunk row lists are then free
        # One [chunk, V] logits buffer reused by every chunk (no allocation and, on CPU, no page
        # faults of freshly mapped memory per chunk): the teacher's pass runs first, then the
        # student's logits overwrite it ("full" keeps the teacher's log-probs in a second buffer).
        c_max = min(chunk_size, N)
        z_buf = torch.empty(c_max * V, dtype=dt, device=dev)
        t_buf = torch.empty(c_max * V, dtype=dt, device=dev) if full and div_mask_cpu.any() else z_buf
        # on CPU the teacher's logits are computed transposed (faster): fine for all it needs
        t_transposed = dev.type == "cpu" and not full and mm == dt

        for a in range(0, N, chunk_size):
            b = min(a + chunk_size, N)
            c = b - a
            h = hidden[a:b].detach()
            h = (h / temperature if temperature != 1.0 else h).to(mm)  # the division in the input's precision
            y = tokens[a:b, None]
            d_local = div_mask_cpu[a:b].nonzero().squeeze(1)
            nd = d_local.numel()
            all_div = nd == c
            d_idx = d_local.to(dev)  # rows of this chunk that get a divergence
            tlogp = torch.zeros(c, dtype=dt, device=dev)
            div = torch.zeros(c, dtype=dt, device=dev)

            # ---- teacher (distillation rows only)
            t = None
            if nd:
                t_parts = [((h_t[d_idx + a] * s).to(mm), w_t) for h_t, w_t, s in teacher]  # scaled in fp32
                tlogp[d_idx], t_max, t_log_norm, t = _teacher_chunk(t_parts, t_buf, y[d_idx], full, t_transposed)

            # ---- student: logits / T [c, V] -> p, in place in the buffer
            z = _logits_into(z_buf, [(h, w)])
            z_y = z.gather(1, y).squeeze(1)
            if k and nd:  # top-k of every row (cheaper than copying out the rows of a mixed chunk)
                z_k, top_idx = torch.topk(z, k, dim=1)
                z_max = z_k[:, 0]  # the top-1 is the row max: saves a pass
                if not all_div:
                    z_k, top_idx = z_k[d_idx], top_idx[d_idx]
                zt_k = _gathered_logits(t_parts, top_idx, max_elems=c_max * V // 8)  # teacher logits at the top-k
            else:
                z_max = z.amax(1)
            z.sub_(z_max[:, None])
            if full:
                log_norm = torch.logsumexp(z, 1)
                s_all = z.sub_(log_norm[:, None])  # log-probs, needed over the whole vocab
                p = s_all.exp()
                ent_all[a:b] = -(p * s_all).sum(1)
            else:
                p = z.exp_()  # unnormalised probs exp(z - max): p / exp(log_norm)
                p_sum = p.sum(1)
                log_norm = p_sum.log()
                ent_all[a:b] = log_norm - torch.xlogy(p, p).sum(1) / p_sum
            del z
            logp = z_y - z_max - log_norm

            # ---- divergence (and what its gradient needs)
            ddiv_dz = d = s_k = None
            if nd and distill == "topk":  # a small [nd, k] graph: the divergence of the top-k log-probs s_k
                with torch.enable_grad():
                    s_k = (z_k - z_max[d_idx, None] - log_norm[d_idx, None]).requires_grad_()
                    t_k = zt_k - t_max[:, None] - t_log_norm[:, None]
                    d = _divergence(*_topk_buckets(s_k, t_k, tail), alpha)
                div[d_idx] = d.detach()
                mass_all[a + d_idx] = s_k.detach().exp().sum(1)
            elif nd and full:
                d, ddiv_dz = _full_divergence_and_grad(s_all if all_div else s_all[d_idx], t, p if all_div else p[d_idx], alpha)
                div[d_idx] = d
            elif nd and distill == "token":
                div[d_idx] = logp[d_idx] - tlogp[d_idx]
            s_all = t = None

            # ---- the caller's loss on the [c] vectors, and its gradients
            out, g_logp, g_div, g_sk = _loss_grads(loss_fn, logp, div, tlogp, rows=slice(a, b), d_idx=d_idx, distill=distill,
                                                   topk_graph=(d, s_k) if nd and distill == "topk" else None)
            total += out.detach().to(dt)
            logp_all[a:b], div_all[a:b], tlogp_all[a:b] = logp, div, tlogp
            if not (need_gh or need_gw):
                continue

            # ---- d loss / d z, in place in the p buffer
            dz = _logit_grads(p, log_norm=None if full else log_norm, y=y, g_logp=g_logp, d_idx=d_idx, all_div=all_div,
                              g_sk=g_sk, top_idx=top_idx if g_sk is not None else None,
                              ddiv_dz=ddiv_dz if g_div is not None else None, g_div=g_div)
            ddiv_dz = None

            # ---- chain through z = (h / T) @ W.T (the weight grad accumulates in fp32)
            dz_mm = dz.to(mm)
            if need_gh:
                if mm == dt:
                    torch.mm(dz_mm, w, out=grad_h[a:b])
                else:
                    grad_h[a:b] = dz_mm @ w
            if need_gw:
                _add_product(grad_w, dz_mm.T, h)
            del p, dz, dz_mm

        if need_gh:
            grad_h = grad_h.div_(temperature).to(hidden.dtype)
        if need_gw:
            grad_w = grad_w.to(weight.dtype)
        ctx.grads = (grad_h, grad_w)
        stats = tuple(x.float() for x in (logp_all, div_all, tlogp_all, ent_all, mass_all))
        ctx.mark_non_differentiable(*stats)
        return (total,) + stats

    @staticmethod
    def backward(ctx, grad_out, *_):
        if ctx.grads is None:
            raise RuntimeError("fused_token_loss: backward can only run once (the gradients are handed over)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # drop our references so autograd can take the tensors over without a copy
        if grad_out.ne(1).item():
            grad_h = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
            grad_w = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return (grad_h, grad_w) + (None,) * 11


def fused_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                     alpha, distill, topk, tail, temperature=1.0, chunk_size=128, matmul_dtype=None):
    """Same arguments, semantics and result as naive_token_loss, without any [N, V] tensor: rows
    are processed in chunks of chunk_size, and the gradients for hidden and weight are computed
    during the forward (the backward only scales them, and can run once). loss_fn is called once
    per chunk with rows = slice(a, b); the loss is the sum of those calls. matmul_dtype (default:
    hidden's dtype) is the dtype of the products, e.g. bfloat16 under autocast: the softmax and
    divergence maths stays fp32. Extra memory: ~one [chunk_size, V] fp32 buffer (two for "full")
    besides the weight gradient; on a GPU a larger chunk (512-1024) keeps the products efficient."""
    div_mask = _div_rows(hidden, teacher, div_rows)
    loss, *stats = _FusedTokenLoss.apply(hidden, weight, tokens, loss_fn, teacher, div_mask, alpha, distill, topk, tail,
                                         temperature, chunk_size, matmul_dtype)
    return loss, dict(zip(("logp", "div", "teacher_logp", "entropy", "topk_mass"), stats))



if __name__ == "__main__":
    from configurator import configure
    one_of_ranks = os.environ.get("WORLD_SIZE", "").strip() not in ("", "1")  # under torchrun
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except UserError as e:  # a LostRank (another rank died) too
        print(f"error: {e}", file=sys.stderr, flush=True)
        if one_of_ranks:
            leave(1)
        sys.exit(1)
    if one_of_ranks:  # past the gloo threads' race with the interpreter's shutdown (runtime.leave)
        leave(0)
