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
                The teacher forward (no grad) prefills each distinct teacher prompt once and reads
                each distinct (teacher prompt, response) pair once: exact, and cheap when short
                answers repeat.
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
  - Token-mean losses divide by the token count of the whole step (all micro-batches), so the
    step size does not depend on how the batch is split.
  - Generation is plain HF forward calls with a DynamicCache; no vLLM, no paged attention.
    static_rollout=True moves the prefilled cache into a StaticCache and decodes through a
    torch.compile'd step (CUDA graphs on a GPU): a fixed-shape fast path, not a serving engine.
"""
import ast
import cmath
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
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

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
static_rollout = False  # decode into a static KV cache through a torch.compile'd step (CUDA graphs on GPU; compiles once per shape)
gen_batch_size = 0  # rows (prompts x samples) decoded at once in rollouts and evals (0 = all; lower it when the KV cache OOMs)
grad_checkpointing = False  # recompute each block's activations in the backward: less memory, a slower student step
# optimizer
learning_rate = 1e-5  # AdamW lr after warmup
warmup_iters = 10  # linear warmup steps
decay_lr = False  # cosine-decay the lr from learning_rate to min_lr over the run (else constant)
min_lr = 0.0  # the lr at the last iteration when decay_lr
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
loss_chunk = 128  # tokens per chunk of the fused loss (one [chunk, vocab] fp32 buffer)
# continual training
teacher_stage_reset = "keep"  # at a stage boundary the teacher: 'keep', 'student' (copy) or 'initial'
reset_optimizer = False  # fresh AdamW state at each stage
stop_on_collapse = True  # stop (keeping the last good checkpoint) on a collapse; NaN/inf always stops
collapse_patience = 3  # evals in a row with zero training-set accuracy or empty responses that count as a collapse
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
NON_NEGATIVE = ("gen_batch_size", "warmup_iters", "eval_interval", "eval_max_prompts", "save_interval", "weight_decay",
                "grad_clip", "clip_low", "clip_high", "kl_coef", "is_clip", "collapse_patience")


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
    for key in NON_NEGATIVE:
        if cfg[key] < 0:
            raise UserError(f"{key}={cfg[key]} must be >= 0")
    if not 0 <= cfg["min_lr"] <= cfg["learning_rate"]:
        raise UserError(f"min_lr={cfg['min_lr']} must be in [0, learning_rate={cfg['learning_rate']}]")
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
# Rewards: reward(kind, response, answer) -> (score in [0, 1], feedback str or None)
#
#   math   the last \boxed{...} (or \fbox{}), normalised and compared for equivalence
#   mcq    the letter in the last <answer>...</answer> (else \boxed{X}, else "the answer is (X)")
#   tool   ReAct "Action: name / Action Input: {json}": the multiset of action names and the
#          merged Action Input dicts must equal the reference (as in the SDPO paper's ToolAlpaca)
#   exact  the stripped content of the last <answer>...</answer> equals the answer (toy suite)
#
# feedback is None on success, else one sentence for the SDPO teacher prompt. It never reveals
# the reference answer. The checkers never raise and take bounded time on any string: they only
# look at the end of a response (TAIL_CHARS), compare answers structurally only when they are
# short (MAX_ANSWER_CHARS), and decide symbolic equivalence by evaluating both sides at fixed
# sample points with a tiny AST evaluator over complex floats (no eval, no sympy, no big-int
# power towers). The common case (an exact or a plain-number answer) takes microseconds.
# Standard library only.
TAIL_CHARS = 20_000       # final answers sit at the end of a response: look no further back
MAX_ANSWER_CHARS = 400    # longer "answers" are compared verbatim (minus spaces), not parsed
TOOL_CHARS = 100_000      # tool calls: parse at most this many leading characters
MAX_TOOL_CALLS = 64
TRUNCATED_FEEDBACK = "The response was cut off before a final answer."


def reward(kind, response, answer):
    """(score, feedback) for one response; never raises."""
    try:
        response = "" if response is None else str(response)
        answer = _reward_answer_str(answer)
        if kind == "math":
            return _math_reward(response, answer)
        if kind == "exact":
            return _exact_reward(response, answer)
        if kind == "mcq":
            return _mcq_reward(response, answer)
        if kind == "tool":
            return _tool_reward(response, answer)
        return 0.0, f"could not check: unknown answer kind {kind!r}"
    except Exception as e:  # RecursionError, MemoryError, ...: a checker must not stop training
        return 0.0, f"could not check the response ({type(e).__name__})"


def final_answer(kind, response):
    """The final answer reward() reads for `kind`, or None when there is none (or it is blank).

    math: the last \\boxed{}; exact: the last <answer>…</answer>; mcq: that tag, else a
    \\boxed{}, else "the answer is (X)"; tool: the Action names. Used to measure empty answers."""
    try:
        text = "" if response is None else str(response)
        if kind == "math":
            got = _last_boxed(text)[0]
        elif kind == "exact":
            got = _last_tag(text)[0]
        elif kind == "mcq":
            got = _last_tag(text)[0]
            if got is None:
                got = _last_boxed(text)[0]
            if got is None:
                got = _answer_is_letter(text)
        elif kind == "tool":
            got = " ".join(name for name, _ in _parse_tool_calls(text)[0])
        else:
            got = text
    except Exception:  # like reward(): hostile text never raises
        return None
    return got if got is not None and got.strip() else None


def _reward_answer_str(answer):
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))  # AMC answers come as 27.0
    if isinstance(answer, (list, dict)):
        return json.dumps(answer)
    return "" if answer is None else str(answer)


def _clip_text(s, n=80):
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n] + "..."


# --- locating the final answer -----------------------------------------------------------------

_BRACE_RE = re.compile(r"[{}]")
_BARE_ARG_RE = re.compile(r"[^\s$]+")


def _match_brace(s, i):
    """Index of the '}' closing the '{' at s[i], or None (unbalanced). Linear time."""
    depth = 0
    for m in _BRACE_RE.finditer(s, i):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


def _last_boxed(text):
    """(content of the last \\boxed{}/\\fbox{}, status): status is 'ok', 'none' or 'unclosed'."""
    tail = text[-TAIL_CHARS:]
    start, cmd = max((tail.rfind(c), c) for c in ("\\boxed", "\\fbox", "\\framebox"))
    if start < 0:
        return None, "none"
    i = start + len(cmd)
    while i < len(tail) and tail[i] == " ":
        i += 1
    if i < len(tail) and tail[i] == "{":
        end = _match_brace(tail, i)
        return (None, "unclosed") if end is None else (tail[i + 1:end], "ok")
    m = _BARE_ARG_RE.match(tail, i)  # the "\boxed 5" form
    return (m.group(), "ok") if m else (None, "unclosed")


def extract_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, or None."""
    try:
        return _last_boxed(str(text))[0]
    except Exception:
        return None


def _last_tag(text, tag="answer"):
    """(stripped content of the last <tag>...</tag>, status 'ok' | 'none' | 'unclosed')."""
    tail = text[-TAIL_CHARS:]
    spellings = (tag, tag.capitalize(), tag.upper())  # not tail.lower(): it can change the length
    i = max(tail.rfind(f"<{t}>") for t in spellings)
    if i < 0:
        return None, "none"
    ends = [j for j in (tail.find(f"</{t}>", i) for t in spellings) if j >= 0]
    if not ends:
        return None, "unclosed"
    return tail[i + len(tag) + 2:min(ends)].strip(), "ok"


# --- math ----------------------------------------------------------------------------------------

def _math_reward(response, answer):
    pred, status = _last_boxed(response)
    if status == "unclosed":
        return 0.0, TRUNCATED_FEEDBACK
    if not pred or not pred.strip():
        return 0.0, "No final answer found: put it in \\boxed{}."
    if math_equal(pred, answer):
        return 1.0, None
    return 0.0, f"Your final answer {_clip_text(pred)} is wrong."


_REWRITES = {"\u2212": "-", "\u2013": "-", "\u03c0": "\\pi", "\u221a": "\\sqrt", "\u00d7": "\\times",
            "\u00b7": "\\cdot", "\u00f7": "\\div", "\u221e": "\\infty", "\u00b0": "", "\u00a0": " ",
            "\u222a": "\\cup", "\\lbrace": "\\{", "\\rbrace": "\\}", "\\dfrac": "\\frac",
            "\\tfrac": "\\frac", "\\displaystyle": "", "\\left": "", "\\right": "",
            "^{\\circ}": "", "^\\circ": "", "\\circ": "", "\\degree": "", "\\%": "", "%": "",
            "\\$": "", "$": ""}
_SPACING_RE = re.compile(r"\\[!,;:>]|\\q?quad(?![a-zA-Z])|~|(?<!\\)\\ |\n|\t")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textsf|mathrm|mathbf|mathit|mathsf|"
                          r"mbox|boldsymbol|bm|operatorname)\s*\{")
_UNITS = (r"dollars?|cents?|units?|degrees?|radians?|cm|mm|km|meters?|metres?|inch(?:es)?|feet|"
          r"foot|ft|yards?|miles?|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|"
          r"years?|mph|kg|grams?|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|gallons?|people|"
          r"persons?|students?|times|points?|percent")
# units after a number: "5.4 \text{ cents}", "864 \mbox{ inches}^2", "18 dollars", "15 cm^2"
_UNIT_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm|textrm)\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?[23]\}?)?$")
_UNIT_WORD_RE = re.compile(rf"\s(?:(?:square|sq\.?|cubic)\s+)?(?:{_UNITS})\.?(?:\^\{{?[23]\}}?)?$")
_SPACE_RE = re.compile(r" (?![a-zA-Z])|(?<![a-zA-Z]) ")   # keep a space only between two letters
_LHS_RE = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?(?:\([a-zA-Z]\))?(?:=|\\in(?![a-zA-Z]))")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CMD_RE = re.compile(r"\\[a-zA-Z]+")
_WORD_RE = re.compile(r"[a-zA-Z]{2,}")


def normalize_math_answer(s):
    """A canonical string for a final answer (with or without \\boxed): the cheap part of
    equivalence. Strips $, spacing, \\left/\\right, \\text{}, units, degrees, percent,
    "x =", thousands separators, redundant parentheses; fixes \\frac12 and \\sqrt2."""
    s = "" if s is None else str(s)
    if len(s) > MAX_ANSWER_CHARS:
        return "".join(s.split())
    try:
        return _normalize_answer(s)
    except Exception:
        return "".join(s.split())


@functools.lru_cache(maxsize=1 << 14)   # reference answers are normalised over and over
def _normalize_answer(s):
    s = s.strip()
    if "box" in s:  # \boxed, \fbox, \framebox
        inner = extract_boxed(s)
        if inner is not None:
            s = inner
    for k, v in _REWRITES.items():
        if k in s:
            s = s.replace(k, v)
    s = _SPACING_RE.sub(" ", s).strip()
    for rx in (_UNIT_TEXT_RE, _UNIT_WORD_RE):  # units only after a number: "5 \text{ cm}", not "\text{east}"
        m = rx.search(s)
        if m and any(c.isdigit() for c in s[:m.start()]):
            s = s[:m.start()].strip()
    s = _unwrap_cmds(s, _TEXT_CMD_RE)
    s = _SPACE_RE.sub("", " ".join(s.split()))
    s = _fix_shorthand(s)
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    s = re.sub(r"_\{(\w+)\}", r"_\1", s)
    s = s.rstrip(".").strip()
    s = _strip_lhs(s)
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return _unparen(s)


def _unwrap_cmds(s, rx):
    """\\text{X} -> X for every command matched by rx."""
    i = 0
    while True:
        m = rx.search(s, i)
        if not m:
            return s
        end = _match_brace(s, m.end() - 1)
        if end is None:
            return s
        s = s[:m.start()] + s[m.end():end] + s[end + 1:]
        i = m.start()


def _read_arg(s, i):
    """One LaTeX argument at s[i:]: a {group}, a \\command or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] == "{":
        end = _match_brace(s, i)
        if end is None:
            raise ValueError("unbalanced")
        return s[i + 1:end], end + 1
    m = _CMD_RE.match(s, i)
    if m:
        return m.group(), m.end()
    return s[i], i + 1


def _fix_shorthand(s):
    """\\frac12 -> \\frac{1}{2}, \\frac9{19} -> \\frac{9}{19}, \\sqrt2 -> \\sqrt{2}."""
    if "\\frac" not in s and "\\sqrt" not in s:
        return s
    try:
        out, i = [], 0
        while i < len(s):
            if s.startswith("\\frac", i) and not s[i + 5:i + 6].isalpha():
                a, i = _read_arg(s, i + 5)
                b, i = _read_arg(s, i)
                out.append("\\frac{%s}{%s}" % (_fix_shorthand(a), _fix_shorthand(b)))
            elif s.startswith("\\sqrt", i) and not s[i + 5:i + 6].isalpha():
                i, index = i + 5, ""
                if s[i:i + 1] == "[":
                    close = s.index("]", i)
                    index, i = s[i:close + 1], close + 1
                a, i = _read_arg(s, i)
                out.append("\\sqrt%s{%s}" % (index, _fix_shorthand(a)))
            else:
                out.append(s[i])
                i += 1
        return "".join(out)
    except ValueError:
        return s


def _strip_lhs(s):
    """'x=5' -> '5', 'f(x)=x^2' -> 'x^2', 'x\\in[-2,7]' -> '[-2,7]' (not '5x-7y=0')."""
    m = _LHS_RE.match(s)
    if m and m.end() < len(s) and "=" not in s[m.end():]:
        return s[m.end():]
    return s


def _close_of(s, i):
    """Index of the bracket closing the one at s[i] (any of ( [ { vs ) ] }), or None."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _unparen(s):
    """'(5)' -> '5', '\\text{(C)}' -> 'C'; a tuple '(1,2)' or a product '(a+1)(b+2)' stays."""
    while len(s) >= 2 and s[0] == "(" and _close_of(s, 0) == len(s) - 1 and len(_split_top(s[1:-1], ",")) == 1:
        s = s[1:-1]
    return s


def _split_top(s, sep):
    """Split s at sep where it is outside every bracket."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _expand_pm(items):
    """'1\\pm\\sqrt{19}' -> ['1+\\sqrt{19}', '1-\\sqrt{19}']."""
    out = []
    for x in items:
        parts = _split_top(x, "\\pm")
        out.extend([parts[0] + "+" + parts[1], parts[0] + "-" + parts[1]] if len(parts) == 2 else [x])
    return [_unparen(_strip_lhs(x)) for x in out]


_MATRIX_RE = re.compile(r"\\begin\{([pbvBV]?matrix)\}(.*)\\end\{\1\}", re.S)


def _math_structure(s):
    """(kind, elements): 'atom', a tuple/interval by its brackets '()' '(]' '[)' '[]', an
    unordered 'list' / 'set' / 'union', a column vector 'vec' or 'matrix<r>x<c>'."""
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return "union", parts
    m = _MATRIX_RE.fullmatch(s)
    if m:
        rows = [r.split("&") for r in m.group(2).split("\\\\") if r.strip()]
        if rows and all(len(r) == 1 for r in rows):
            return "vec", [r[0] for r in rows]
        return f"matrix{len(rows)}x{len(rows[0]) if rows else 0}", [c for r in rows for c in r]
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", _expand_pm(_split_top(s[2:-2], ","))
    if s[:1] in "([" and s[-1:] in ")]" and _close_of(s, 0) == len(s) - 1:
        items = _split_top(s[1:-1], ",")
        if len(items) > 1:
            return s[0] + s[-1], [_unparen(_strip_lhs(x)) for x in items]
    items = _expand_pm(_split_top(s, ","))
    return ("list", items) if len(items) > 1 else ("atom", [s])


_UNORDERED = ("list", "set", "union")
_SAME_KIND = ({"list", "set"}, {"()", "vec"})
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)|[+-]?\d+/\d+")
_FRAC_RE = re.compile(r"([+-]?)(\d*)\\frac\{([+-]?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}")


def _as_fraction(s):
    """An exact rational for a plain number: 27, 27.0, .5, 3/4, \\frac{3}{4}, -\\frac34, 1\\frac{4}{5}."""
    try:
        if _PLAIN_NUMBER_RE.fullmatch(s):
            return Fraction(s)
        m = _FRAC_RE.fullmatch(s)
        if m:
            sign, whole, a, b = m.groups()
            v = Fraction(a) / Fraction(b) + (int(whole) if whole else 0)  # 1\frac{4}{5} is a mixed number
            return -v if sign == "-" else v
    except (ValueError, ZeroDivisionError):
        pass
    return None


def math_equal(pred, ref):
    """True when two final answers (either may be wrapped in \\boxed) are equivalent."""
    try:
        pred, ref = str(pred).strip(), str(ref).strip()
        if pred == ref and pred:
            return True
        a, b = normalize_math_answer(pred), normalize_math_answer(ref)
        if not a or not b:
            return False
        if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
            return a == b
        return _math_equal_norm(a, b, 0)
    except Exception:
        return False


def _math_equal_norm(a, b, depth):
    if a == b:
        return True
    if depth > 3:
        return False
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb  # exact: 0.5 == 1/2, 27.0 == 27, but 0.33 != 1/3
    ka, ea = _math_structure(a)
    kb, eb = _math_structure(b)
    if ka != "atom" or kb != "atom":
        if not (ka == kb or any({ka, kb} <= k for k in _SAME_KIND)) or len(ea) != len(eb) or len(ea) > 32:
            return False
        if ka in _UNORDERED:  # solutions "1,-2" == "-2,1": greedy matching
            left = list(eb)
            for x in ea:
                j = next((j for j, y in enumerate(left) if _math_equal_norm(x, y, depth + 1)), None)
                if j is None:
                    return False
                del left[j]
            return True
        return all(_math_equal_norm(x, y, depth + 1) for x, y in zip(ea, eb))
    if _is_word(a) or _is_word(b):  # "\text{Evelyn}": compare as text, never as e*v*e*l*y*n
        return a.lower() == b.lower()
    return _numeric_equal(a, b)


def _is_word(s):
    return _WORD_RE.search(_CMD_RE.sub(" ", s)) is not None


# Symbolic equivalence: translate the (normalised) LaTeX into a small Python expression, parse it
# with ast (never eval) and evaluate both sides at a few fixed points with complex arithmetic.
# Overflow or a domain error at a point just skips that point.
_MATH_FUNCS = {"sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan, "cot": lambda z: 1 / cmath.tan(z),
               "sec": lambda z: 1 / cmath.cos(z), "csc": lambda z: 1 / cmath.sin(z), "arcsin": cmath.asin,
               "arccos": cmath.acos, "arctan": cmath.atan, "sinh": cmath.sinh, "cosh": cmath.cosh,
               "tanh": cmath.tanh, "ln": cmath.log, "log": cmath.log, "exp": cmath.exp, "sqrt": cmath.sqrt}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "kappa",
          "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi", "varphi", "chi", "psi", "omega"}
_SAMPLE_POINTS = (0.5772156649, 1.4142135623, 0.8346268416, 1.2020569031, 0.3183098861, 1.6180339887,
                  0.9159655941, 0.6931471805, 1.7320508075, 0.2614972128, 1.3063778838)
_DIGITS_RE = re.compile(r"\d+\.?\d*|\.\d+")


def _latex_to_py(s):
    """Python expression text for a LaTeX expression, or None when out of scope."""
    out, i, prev = [], 0, False  # prev: the last token ends an operand (juxtaposition = product)

    def operand(tok):
        nonlocal prev
        if prev:
            out.append("*")
        out.append(tok)
        prev = True

    while i < len(s):
        c = s[i]
        if c in "0123456789" or (c == "." and s[i + 1:i + 2].isdigit()):
            m = _DIGITS_RE.match(s, i)
            operand(repr(float(m.group())))
            i = m.end()
        elif c.isalpha():
            operand({"e": "c_e", "i": "c_i"}.get(c, "v_" + c))
            i += 1
        elif c == "\\":
            m = _CMD_RE.match(s, i)
            if not m:
                return None
            name, i = m.group()[1:], m.end()
            if name == "frac":
                a, i = _read_arg(s, i)
                b, i = _read_arg(s, i)
                pa, pb = _latex_to_py(a), _latex_to_py(b)
                if pa is None or pb is None:
                    return None
                operand(f"(({pa})/({pb}))")
            elif name == "sqrt":
                index = None
                if s[i:i + 1] == "[":
                    close = s.index("]", i)
                    index, i = _latex_to_py(s[i + 1:close]), close + 1
                a, i = _read_arg(s, i)
                pa = _latex_to_py(a)
                if pa is None:
                    return None
                operand(f"f_sqrt({pa})" if index is None else f"(({pa})**(1/({index})))")
            elif name in ("cdot", "times", "div"):
                out.append("/" if name == "div" else "*")
                prev = False
            elif name == "pi":
                operand("c_pi")
            elif name in _GREEK:
                operand("v_" + name)
            elif name in _MATH_FUNCS:
                while s[i:i + 1] == " ":
                    i += 1
                if s[i:i + 1] == "(":
                    operand("f_" + name)
                    prev = False  # the "(" that follows is its argument list
                else:
                    a, i = _read_arg(s, i)
                    pa = _latex_to_py(a)
                    if pa is None:
                        return None
                    operand(f"f_{name}({pa})")
            else:
                return None
        elif c in "+-*/":
            out.append(c)
            prev, i = False, i + 1
        elif c == "^":
            a, i = _read_arg(s, i + 1)
            pa = _latex_to_py(a)
            if pa is None or not out:
                return None
            out.append(f"**({pa})")
            prev = True
        elif c == "{":
            a, i = _read_arg(s, i)
            pa = _latex_to_py(a)
            if pa is None:
                return None
            operand(f"({pa})")
        elif c == "(":
            operand("(")
            prev, i = False, i + 1
        elif c == ")":
            out.append(")")
            prev, i = True, i + 1
        elif c == " ":
            i += 1
        else:
            return None
    return " ".join(out)


def _eval_expr(node, env):
    t = type(node)
    if t is ast.Constant and type(node.value) in (int, float):
        return complex(node.value)
    if t is ast.Name:
        return env[node.id]
    if t is ast.UnaryOp and type(node.op) in (ast.USub, ast.UAdd):
        v = _eval_expr(node.operand, env)
        return -v if type(node.op) is ast.USub else v
    if t is ast.BinOp:
        a, b, op = _eval_expr(node.left, env), _eval_expr(node.right, env), type(node.op)
        if op is ast.Add:
            return a + b
        if op is ast.Sub:
            return a - b
        if op is ast.Mult:
            return a * b
        if op is ast.Div:
            return a / b
        if op is ast.Pow:
            return a ** b  # complex floats: OverflowError, never a huge integer
    if t is ast.Call and type(node.func) is ast.Name and node.func.id[2:] in _MATH_FUNCS and len(node.args) == 1:
        return _MATH_FUNCS[node.func.id[2:]](_eval_expr(node.args[0], env))
    raise ValueError("unsupported expression")


def _compile_expr(s):
    """(ast, variable names) for a side of an (in)equation, or None."""
    py = _latex_to_py(s)
    if not py:
        return None
    tree = ast.parse(py, mode="eval").body
    return tree, {n.id for n in ast.walk(tree) if type(n) is ast.Name and n.id.startswith("v_")}


def _sample_values(trees, names):
    """Each tree evaluated at 3 fixed points; None where any evaluation failed."""
    names = sorted(names)
    if len(names) > len(_SAMPLE_POINTS):
        return None
    rows = []
    for p in range(3):
        env = {"c_pi": cmath.pi, "c_e": cmath.e, "c_i": 1j}
        env.update({n: _SAMPLE_POINTS[(k + 4 * p) % len(_SAMPLE_POINTS)] + 0.1 * p for k, n in enumerate(names)})
        try:
            vals = [_eval_expr(t, env) for t in trees]
            rows.append(vals if all(cmath.isfinite(v) for v in vals) else None)
        except (ArithmeticError, ValueError, KeyError, TypeError):
            rows.append(None)
    return rows


def _close_num(x, y):
    return abs(x - y) <= 1e-9 * max(abs(x), abs(y)) + 1e-12


@functools.lru_cache(maxsize=1 << 14)
def _numeric_equal(a, b):
    try:
        sides_a, sides_b = _split_top(a, "="), _split_top(b, "=")
        if len(sides_a) != len(sides_b) or len(sides_a) > 2:
            return False
        parsed = [_compile_expr(x) for x in sides_a + sides_b]
        if any(p is None for p in parsed):
            return False
        names = set().union(*(p[1] for p in parsed))
        rows = [r for r in _sample_values([p[0] for p in parsed], names) or [] if r is not None]
        if len(rows) < 2:
            return False
        if len(sides_a) == 1:
            return all(_close_num(r[0], r[1]) for r in rows)
        # equations: equivalent when lhs - rhs are proportional ("5x-7y=3" == "14y-10x=-6")
        diffs = [(r[0] - r[1], r[2] - r[3]) for r in rows]
        if any(abs(d2) < 1e-12 for _, d2 in diffs):
            return all(abs(d1) < 1e-12 and abs(d2) < 1e-12 for d1, d2 in diffs)
        ratios = [d1 / d2 for d1, d2 in diffs]
        return abs(ratios[0]) > 1e-12 and all(_close_num(q, ratios[0]) for q in ratios)
    except (ValueError, SyntaxError, RecursionError, MemoryError, ArithmeticError, TypeError):
        return False


# --- multiple choice -----------------------------------------------------------------------------

_LETTER_RE = re.compile(r"[\s(\[{*]*([A-Za-z])[\s)\]}*.:]*")
_ANSWER_IS_RE = re.compile(r"(?i:answer)[\s*:]*(?:(?i:is)[\s*:]*)?\(?([A-Z])\)?(?![A-Za-z0-9])")


def _answer_is_letter(text):
    """The letter of the last "the answer is (X)" near the end of text, or None."""
    m = None
    for m in _ANSWER_IS_RE.finditer(text[-3000:]):
        pass
    return m.group(1) if m else None


def _mcq_letter(s):
    m = _LETTER_RE.fullmatch(_unwrap_cmds(s.strip(), _TEXT_CMD_RE)) if s is not None and len(s) < 100 else None
    return m.group(1).upper() if m else None


def _mcq_reward(response, answer):
    ref = _mcq_letter(answer) or answer.strip().upper()
    content, status = _last_tag(response)
    if status == "unclosed":
        return 0.0, TRUNCATED_FEEDBACK
    if status == "ok":
        got = _mcq_letter(content)
        if got is None:
            return 0.0, "The answer must be a single letter inside <answer></answer>."
    else:
        boxed, status = _last_boxed(response)
        if status == "unclosed":
            return 0.0, TRUNCATED_FEEDBACK
        got = _mcq_letter(boxed) if boxed is not None else None
        if got is None:
            got = _answer_is_letter(response)
        if got is None:
            return 0.0, "No final answer found: put the letter of your choice inside <answer></answer>."
    if got == ref:
        return 1.0, None
    return 0.0, f"Your final answer {got} is wrong."


# --- exact (toy suite) ---------------------------------------------------------------------------

def _exact_reward(response, answer):
    got, status = _last_tag(response)
    if status == "unclosed":
        return 0.0, TRUNCATED_FEEDBACK
    if status == "none":
        return 0.0, "No final answer found: put it inside <answer></answer>."
    if got == answer.strip():
        return 1.0, None
    if not got:
        return 0.0, "The <answer></answer> tags are empty."
    return 0.0, f"Your final answer {_clip_text(got)} is wrong."


# --- tool use (ReAct) ----------------------------------------------------------------------------

_ACTION_RE = re.compile(r"^[ \t*]*Action[ \t*]*:[ \t*]*(.*)$", re.M)  # "Action Input:" does not match
_INPUT_RE = re.compile(r"Action[ \t*]*Input[ \t*]*:[ \t*]*\s*")
_JSON_DECODER = json.JSONDecoder()


def _json_dict(value):
    if isinstance(value, str):  # the reference stores Action_Input as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _parse_tool_calls(text):
    """([(action name, input dict)], truncated): every Action with its Action Input."""
    text = text[:TOOL_CHARS]
    matches = []
    for m in _ACTION_RE.finditer(text):
        matches.append(m)
        if len(matches) >= MAX_TOOL_CALLS:
            break
    calls, truncated = [], False
    for k, m in enumerate(matches):
        name = m.group(1).split("Action Input")[0].strip().strip("`*\"' ")
        end = matches[k + 1].start() if k + 1 < len(matches) else len(text)
        im = _INPUT_RE.search(text, m.start(), end)
        args = {}
        if im:
            try:
                args = _json_dict(_JSON_DECODER.raw_decode(text, im.end())[0])
            except (ValueError, RecursionError):
                seg = text[im.end():end]
                truncated = k == len(matches) - 1 and seg.count("{") > seg.count("}")
        calls.append((name, args))
    return calls, truncated


@functools.lru_cache(maxsize=4096)
def _tool_reference(answer):
    ref = json.loads(answer)
    ref = [ref] if isinstance(ref, dict) else ref
    names, merged = [], {}
    for item in ref:
        names.append(str(item.get("Action", "")).strip())
        merged.update(_json_dict(item.get("Action_Input", item.get("Action Input", {}))))
    return tuple(names), json.dumps(merged, sort_keys=True)


def _tool_reward(response, answer):
    ref_names, ref_merged = _tool_reference(answer)
    ref_merged = json.loads(ref_merged)
    calls, truncated = _parse_tool_calls(response)
    names = [n for n, _ in calls]
    merged = {}
    for _, args in calls:
        merged.update(args)
    if calls and Counter(names) == Counter(ref_names) and merged == ref_merged:
        return 1.0, None
    if truncated:
        return 0.0, TRUNCATED_FEEDBACK
    if not calls:
        return 0.0, "No tool call found: write 'Action: <tool name>' then 'Action Input: <JSON object>'."
    if Counter(names) != Counter(ref_names):
        called = _clip_text(", ".join(names), 200)
        return 0.0, f"Action names do not match the tool calls the question needs (you called: {called})."
    missing = sorted(set(ref_merged) - set(merged))
    extra = sorted(set(merged) - set(ref_merged))
    wrong = sorted(k for k in set(merged) & set(ref_merged) if merged[k] != ref_merged[k])
    parts = [f"{what}: {', '.join(map(str, keys))}" for what, keys in
             (("missing arguments", missing), ("unexpected arguments", extra), ("wrong values for", wrong)) if keys]
    return 0.0, _clip_text("The Action Input arguments do not match (" + "; ".join(parts) + ").", 300)

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


def left_pad(prompts, pad_id):
    """Token-id lists -> (ids [B, T], attention mask [B, T]), padded on the left so that every
    prompt ends at the last column, where generation continues."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def generate(model, prompts, group_size, max_new_tokens, temperature, top_p, eos_id, pad_id, generator,
             static=False, max_rows=0):
    """Sample `group_size` responses to each prompt (list of token-id lists).

    Prompts are left-padded and prefilled once; the KV cache is then repeated for the group, and
    decoding stops as soon as every row has produced EOS. static=True decodes into a preallocated
    StaticCache through a torch.compile'd step: every decode step has the same shapes, so on CUDA
    the step is captured once as a CUDA graph and replayed (no per-token Python/launch overhead).
    max_rows > 0 decodes at most that many rows (prompts × group_size) at once, whole groups at a
    time: the KV cache is what runs out first at long max_new_tokens."""
    per_call = max(1, max_rows // group_size) if max_rows > 0 else len(prompts)
    if len(prompts) > per_call:
        parts = [generate(model, prompts[i:i + per_call], group_size, max_new_tokens, temperature, top_p, eos_id,
                          pad_id, generator, static) for i in range(0, len(prompts), per_call)]
        return Rollout(texts=None, **{f: [x for part in parts for x in getattr(part, f)]
                                      for f in ("prompt_ids", "response_ids", "old_logprobs", "truncated")})
    from transformers import DynamicCache
    dev = next(model.parameters()).device
    ids, mask = (t.to(dev) for t in left_pad(prompts, pad_id))
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = model(ids, mask, position, cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    mask = mask.repeat_interleave(group_size, 0)
    position = position[:, -1:].repeat_interleave(group_size, 0)
    rows = logits.shape[0]
    step = decode_step
    if static:
        cache, mask, step = static_decoding(model, cache, mask, max_new_tokens)
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
        if not static:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        position = position + 1
        logits = step(model, token, mask, position, cache)
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


def decode_step(model, token, mask, position, cache):
    """One decoding step: the next-token logits [rows, V] for the last sampled tokens."""
    return model(token[:, None], mask, position, cache, use_cache=True).logits[:, -1]


_static_caches, _compiled_steps = {}, {}


def static_decoding(model, prefill_cache, mask, max_new_tokens, round_to=64):
    """Move a prefilled DynamicCache into a StaticCache; return (cache, attention mask, step).

    The cache length is rounded up to a multiple of `round_to` and cache buffers are kept per
    shape, so a run compiles a handful of shapes once and then reuses them. The mask already
    covers every future position (the causal mask hides the unwritten ones): one shape per decode."""
    from transformers import StaticCache
    rows, width = mask.shape
    length = -(-(width + max_new_tokens) // round_to) * round_to
    k = prefill_cache.layers[0].keys
    key = (rows, length, len(prefill_cache.layers), k.shape[1], k.shape[3], k.dtype, k.device)
    if key not in _static_caches:
        _static_caches[key] = StaticCache(config=model.config, max_cache_len=length)
    cache = _static_caches[key]
    cache.reset()
    for static_layer, layer in zip(cache.layers, prefill_cache.layers):
        static_layer.update(layer.keys, layer.values)  # writes positions 0..width-1
    mask = torch.cat([mask, mask.new_ones(rows, length - width)], dim=1)
    cuda = mask.device.type == "cuda"
    if cuda not in _compiled_steps:  # CUDA: capture each step shape once as a CUDA graph
        _compiled_steps[cuda] = torch.compile(decode_step, mode="reduce-overhead" if cuda else "default")

    def step(*args):
        if cuda:  # the previous step's graph outputs are consumed; let the next replay reuse them
            torch.compiler.cudagraph_mark_step_begin()
        return _compiled_steps[cuda](*args)
    return cache, mask, step


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
# ----------------------------------------------------------------------------- the fused loss
# Token loss: LM head + log-softmax + (GRPO / self-distillation) loss, naive
# and fused. Everything works on flattened rows: hidden [N, H] (final hidden
# states), weight [V, H] (LM head), tokens [N] (the sampled token of each row).
# The fused version never materialises an [N, V] tensor: it walks the rows in
# chunks and computes the gradients for hidden and weight during the forward.
# Maths in fp32 whatever the input dtype (fp64 stays fp64, for the tests).
DISTILL_MODES = ("full", "topk", "token")
TAIL_LOG_CLAMP = -1e-7  # as in the SDPO reference: keeps log(1 - sum top-k p) finite


def _compute_dtype(dtype):
    # fp32 maths for fp32/bf16/fp16 inputs, fp64 for fp64 inputs (used by the tests)
    return torch.promote_types(dtype, torch.float32)


def _divergence(s, t, alpha):
    """Divergence between row distributions given as log-probs s (student) and t
    (teacher), reduced over the last dim. alpha=0: KL(q||p), alpha=1: KL(p||q),
    otherwise the generalized JSD with mixture m = (1-alpha) p + alpha q."""
    if alpha == 0:
        return (t.exp() * (t - s)).sum(-1)
    if alpha == 1:
        return (s.exp() * (s - t)).sum(-1)
    log_m = torch.logaddexp(s + math.log(1 - alpha), t + math.log(alpha))
    kl_pm = (s.exp() * (s - log_m)).sum(-1)
    kl_qm = (t.exp() * (t - log_m)).sum(-1)
    return (1 - alpha) * kl_pm + alpha * kl_qm


def _topk_buckets(s_k, t_k, tail):
    """Top-k log-probs [n, k] (gathered from full-vocab log-softmaxes) -> the
    bucket log-probs the divergence is taken over: k + 1 buckets with a tail
    bucket log(1 - sum_k p), or the k tokens renormalised."""
    if not tail:
        return torch.log_softmax(s_k, -1), torch.log_softmax(t_k, -1)

    def add_tail(lp):
        # log(1 - exp(lse)) via expm1; the clamp avoids log(0) = -inf (and NaN
        # grads) when the top-k hold (numerically) all the mass
        lse = torch.logsumexp(lp, -1, keepdim=True).clamp(max=TAIL_LOG_CLAMP)
        return torch.cat([lp, torch.log(-torch.expm1(lse))], -1)

    return add_tail(s_k), add_tail(t_k)


def distill_divergence(student_logits, teacher_logits, alpha, distill, topk, tail):
    """Per-row divergence [N] between student and teacher logits [N, V].
    distill="full": over the whole vocab; "topk": over the student's top-k tokens
    (+ a tail bucket, or renormalised). Computed in fp32 (fp64 for fp64 inputs)."""
    if distill not in ("full", "topk"):
        raise ValueError(f"distill_divergence: distill must be 'full' or 'topk', got {distill!r}"
                         " ('token' is a sampled-token estimator, handled in the loss)")
    dt = _compute_dtype(student_logits.dtype)
    z, zt = student_logits.to(dt), teacher_logits.to(dt)
    s, t = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    if distill == "full":
        return _divergence(s, t, alpha)
    idx = torch.topk(z, min(topk, z.shape[-1]), dim=-1).indices
    s_b, t_b = _topk_buckets(s.gather(-1, idx), t.gather(-1, idx), tail)
    return _divergence(s_b, t_b, alpha)


def _check_args(hidden, weight, tokens, teacher, div_rows, distill):
    if distill not in DISTILL_MODES:
        raise ValueError(f"distill must be one of {DISTILL_MODES}, got {distill!r}")
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    assert tokens.shape == (hidden.shape[0],)
    # rows that get a divergence: all rows by default when there is a teacher, none without
    N = hidden.shape[0]
    if teacher is None:
        return torch.zeros(N, dtype=torch.bool, device=hidden.device)
    if div_rows is None:
        return torch.ones(N, dtype=torch.bool, device=hidden.device)
    assert div_rows.shape == (N,) and div_rows.dtype == torch.bool
    return div_rows


def _teacher_logits(teacher, rows, dt, temperature):
    """sum_i coef_i * (hidden_i[rows] @ weight_i.T) / temperature, no grad."""
    z = None
    for h_t, w_t, coef in teacher:
        part = h_t.detach()[rows].to(dt) @ w_t.detach().to(dt).T
        if coef != 1:
            part = coef * part
        z = part if z is None else z + part
    return z if temperature == 1.0 else z / temperature


def naive_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                     alpha, distill, topk, tail, temperature=1.0):
    """Reference implementation: full [N, V] logits and plain autograd.

    hidden [N, H] student final hidden states, weight [V, H] LM head, tokens [N]
    the sampled token of each row. Student logits = hidden @ weight.T / T (fp32).
    teacher: None or [(hidden_t [N, H], weight_t [V, H], coef)], no grad:
    teacher logits = sum coef * hidden_t @ weight_t.T, / T.
    div_rows: bool [N] (None: all rows if there is a teacher, else none); rows
    outside get div = 0 and teacher_logp = 0.
    Per row: logp (student log-prob at tokens), teacher_logp, and div =
    distill_divergence(...) for distill "full" / "topk", or the constant
    (logp - teacher_logp).detach() for "token" (the caller's loss_fn builds the
    sampled-token estimator sg(logp - teacher_logp) * logp from teacher_logp).
    loss = loss_fn(logp [N], div [N], teacher_logp [N], slice(0, N)), a scalar.
    Returns (loss, {"logp", "div", "teacher_logp"}: detached fp32 [N])."""
    div_mask = _check_args(hidden, weight, tokens, teacher, div_rows, distill)
    N = hidden.shape[0]
    dt = _compute_dtype(hidden.dtype)
    tokens = tokens.long()
    logits = hidden.to(dt) @ weight.to(dt).T
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    div = torch.zeros(N, dtype=dt, device=hidden.device)
    teacher_logp = torch.zeros(N, dtype=dt, device=hidden.device)
    rows = div_mask.nonzero().squeeze(1)
    if rows.numel() > 0:
        t_logits = _teacher_logits(teacher, rows, dt, temperature)
        t_lp = torch.log_softmax(t_logits, -1).gather(1, tokens[rows, None]).squeeze(1)
        teacher_logp = teacher_logp.index_put((rows,), t_lp)
        if distill == "token":
            d = (logp[rows] - t_lp).detach()
        else:
            d = distill_divergence(logits[rows], t_logits, alpha, distill, topk, tail)
        div = div.index_put((rows,), d)
    loss = loss_fn(logp, div, teacher_logp, slice(0, N))
    stats = {"logp": logp.detach().float(), "div": div.detach().float(),
             "teacher_logp": teacher_logp.detach().float()}
    return loss, stats


def _logits_into(buf, parts, transposed=False):
    """sum_i h_i @ w_i.T over parts [(h_i [c, H], w_i [V, H])], written into the
    flat buffer buf and returned as a [c, V] view. transposed=True computes the
    [V, c] product w @ h.T instead (MKL is ~1.4x faster at it for few rows) and
    returns its transpose, a [c, V] view with strides (1, c): fine for
    elementwise ops, reductions and gathers, slow for topk."""
    c, V = parts[0][0].shape[0], parts[0][1].shape[0]
    out = buf[: c * V].view(V, c) if transposed else buf[: c * V].view(c, V)
    for i, (h, w) in enumerate(parts):
        a, b = (w, h.T) if transposed else (h, w.T)
        if i == 0:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
    return out.T if transposed else out


def _gathered_logits(parts, idx, max_elems):
    """sum_i <h_i[r], w_i[idx[r, j]]> for parts [(h_i [n, H], w_i [V, H])] and
    idx [n, k]: logits at a few vocab entries per row without the [n, V]
    product; row blocks keep the gathered [rows, k, H] weights under max_elems
    (or 32 rows)."""
    n, k = idx.shape
    V, H = parts[0][1].shape
    if 4 * k >= V:  # k is a large share of the vocab: one [n, V] product is cheaper than gathering w rows
        return sum(h @ w.T for h, w in parts).gather(1, idx)
    out = torch.empty(n, k, dtype=parts[0][0].dtype, device=idx.device)
    step = max(32, max_elems // (k * H))  # at least 32 rows per bmm: never a loop over single rows
    for r in range(0, n, step):
        acc = 0
        for h, w in parts:
            acc = acc + torch.bmm(w[idx[r:r + step]], h[r:r + step, :, None]).squeeze(2)
        out[r:r + step] = acc
    return out


def _full_divergence_and_grad(s, t, p, alpha):
    """Full-vocab divergence [n] of student log-probs s from teacher log-probs t
    (p = exp(s)) and its gradient w.r.t. the student logits [n, V], in closed
    form. s is used as scratch."""
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


class _FusedTokenLoss(torch.autograd.Function):
    """Chunked forward that also computes d loss / d hidden and d loss / d weight
    (the output is a scalar, so the backward only has to scale them)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, loss_fn, teacher, div_mask,
                alpha, distill, topk, tail, temperature, chunk_size):
        N, H = hidden.shape
        V = weight.shape[0]
        dev, dt = hidden.device, _compute_dtype(hidden.dtype)
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = tokens.long()
        full = distill == "full"
        k = min(topk, V) if distill == "topk" else 0
        w = weight.detach().to(dt)  # no copy when weight is already in dt
        # teacher parts (hidden, weight, coef / T): the scale goes on the
        # [rows, H] hidden states, not on [rows, V] logits
        teacher = [(h_t.detach(), w_t.detach().to(dt), float(coef) / temperature)
                   for h_t, w_t, coef in teacher or []]

        grad_h = torch.empty(N, H, dtype=dt, device=dev) if need_gh else None
        grad_w = torch.zeros(V, H, dtype=dt, device=dev) if need_gw else None
        logp_all, div_all, tlogp_all = (torch.zeros(N, dtype=dt, device=dev) for _ in range(3))
        total = torch.zeros((), dtype=dt, device=dev)
        div_mask_cpu = div_mask.cpu()  # one host sync; per-chunk row lists are then free
        # One [chunk, V] logits buffer reused by every chunk (no allocation and,
        # on CPU, no page faults of freshly mmapped memory per chunk): the
        # teacher's full-vocab pass runs first, then the student's logits
        # overwrite it ("full" keeps the teacher's log-probs in a second buffer).
        c_max = min(chunk_size, N)
        z_buf = torch.empty(c_max * V, dtype=dt, device=dev)
        t_buf = torch.empty(c_max * V, dtype=dt, device=dev) if full and div_mask_cpu.any() else z_buf
        # on CPU the teacher's logits are computed transposed (faster); the
        # strided view is fine for all the teacher needs (gathers, max, exp, sum)
        t_transposed = dev.type == "cpu" and not full

        for a in range(0, N, chunk_size):
            b = min(a + chunk_size, N)
            c = b - a
            h = hidden[a:b].detach().to(dt) / temperature
            y = tokens[a:b, None]
            d_local = div_mask_cpu[a:b].nonzero().squeeze(1)
            nd = d_local.numel()
            all_div = nd == c
            d_idx = d_local.to(dev)  # rows of this chunk that get a divergence
            tlogp = torch.zeros(c, dtype=dt, device=dev)
            div = torch.zeros(c, dtype=dt, device=dev)

            # ---- teacher, div rows only: log-normaliser and log-prob at y.
            # Log-probs are computed as (z - max) - log_norm, in that order, so
            # they are precise near the max (the top-k / tail buckets need it).
            if nd:
                t_parts = [(h_t[d_idx + a].to(dt) * s, w_t) for h_t, w_t, s in teacher]
                zt = _logits_into(t_buf, t_parts, t_transposed)
                zt_y = zt.gather(1, y[d_idx]).squeeze(1)
                t_max = zt.amax(1)
                zt.sub_(t_max[:, None])
                if full:
                    t_log_norm = torch.logsumexp(zt, 1)
                    t = zt.sub_(t_log_norm[:, None])  # teacher log-probs [nd, V], kept
                else:
                    t_log_norm = zt.exp_().sum(1).log()
                del zt
                tlogp[d_idx] = zt_y - t_max - t_log_norm

            # ---- student: logits / T [c, V] -> p, in place in the buffer
            z = _logits_into(z_buf, [(h, w)])
            z_y = z.gather(1, y).squeeze(1)
            if k and nd:
                # topk of every row (cheaper than copying out the div rows of a
                # mixed chunk); its top-1 is the row max, which saves a pass
                z_k, top_idx = torch.topk(z, k, dim=1)
                z_max = z_k[:, 0]
                if not all_div:
                    z_k, top_idx = z_k[d_idx], top_idx[d_idx]
                # the teacher's logits at the student's top-k, by dot products
                zt_k = _gathered_logits(t_parts, top_idx, max_elems=c_max * V // 8)
            else:
                z_max = z.amax(1)
            z.sub_(z_max[:, None])
            if full:
                log_norm = torch.logsumexp(z, 1)
                s_all = z.sub_(log_norm[:, None])  # log-probs, needed over the whole vocab
                p = s_all.exp()
            else:
                p = z.exp_()  # unnormalised probs exp(z - max): p / exp(log_norm)
                log_norm = p.sum(1).log()
            del z
            logp = z_y - z_max - log_norm

            # ---- divergence (and what its gradient needs)
            if nd and distill == "topk":
                # small [nd, k] local graph: the divergence as a function of the
                # student's top-k log-probs s_k
                with torch.enable_grad():
                    s_k = (z_k - z_max[d_idx, None] - log_norm[d_idx, None]).requires_grad_()
                    t_k = zt_k - t_max[:, None] - t_log_norm[:, None]
                    d = _divergence(*_topk_buckets(s_k, t_k, tail), alpha)
                div[d_idx] = d.detach()
            elif nd and full:
                d, ddiv_dz = _full_divergence_and_grad(
                    s_all if all_div else s_all[d_idx], t, p if all_div else p[d_idx], alpha)
                div[d_idx] = d
                del t
            elif nd and distill == "token":
                div[d_idx] = logp[d_idx] - tlogp[d_idx]
            if full:
                del s_all

            # ---- the caller's loss on the [c] vectors; tiny local autograd for
            # d loss / d logp and d loss / d div ("token": div is a constant)
            with torch.enable_grad():
                logp_leaf = logp.clone().requires_grad_()
                div_leaf = div.clone().requires_grad_(distill != "token")
                out = loss_fn(logp_leaf, div_leaf, tlogp, slice(a, b))
                leaves = [logp_leaf, div_leaf] if distill != "token" else [logp_leaf]
                grads = (torch.autograd.grad(out, leaves, allow_unused=True)
                         if out.requires_grad else [None] * len(leaves))
                g_logp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
                g_div = grads[1][d_idx] if distill != "token" and grads[1] is not None else None
                # back through the top-k buckets: d loss / d s_k, [nd, k]
                g_sk = None
                if nd and distill == "topk" and g_div is not None:
                    (g_sk,) = torch.autograd.grad(d, s_k, grad_outputs=g_div)
            total += out.detach().to(dt)
            logp_all[a:b] = logp
            div_all[a:b] = div
            tlogp_all[a:b] = tlogp
            if not (need_gh or need_gw):
                continue

            # ---- d loss / d z, in place in the p buffer. With s = log_softmax(z):
            # dL/dz = G - p * sum(G), G = dL/ds, which is sparse except for
            # "full": nonzero at y (from logp) and at the top-k (from div).
            g_sum = g_logp.clone()
            if g_sk is not None:
                g_sum[d_idx] += g_sk.sum(1)
            scale = -g_sum if full else -g_sum * torch.exp(-log_norm)  # p unnormalised
            dz = p.mul_(scale[:, None])
            dz.scatter_add_(1, y, g_logp[:, None])
            if g_sk is not None:
                if all_div:
                    dz.scatter_add_(1, top_idx, g_sk)
                else:
                    dz.index_put_((d_idx[:, None].expand_as(top_idx), top_idx), g_sk, accumulate=True)
            if full and nd and g_div is not None:
                ddiv_dz.mul_(g_div[:, None])
                if all_div:
                    dz.add_(ddiv_dz)
                else:
                    dz.index_add_(0, d_idx, ddiv_dz)
            ddiv_dz = None

            # ---- chain through z = (h / T) @ W.T; the weight grad accumulates in dt
            if need_gh:
                torch.mm(dz, w, out=grad_h[a:b])
            if need_gw:
                grad_w.addmm_(dz.T, h)
            del p, dz

        if need_gh:
            grad_h = grad_h.div_(temperature).to(hidden.dtype)
        if need_gw:
            grad_w = grad_w.to(weight.dtype)
        ctx.grads = (grad_h, grad_w)
        stats = (logp_all.float(), div_all.float(), tlogp_all.float())
        ctx.mark_non_differentiable(*stats)
        return (total,) + stats

    @staticmethod
    def backward(ctx, grad_out, *_):
        if ctx.grads is None:
            raise RuntimeError("fused_token_loss: backward can only run once (the gradients are handed over)")
        grad_h, grad_w = ctx.grads
        # drop our references so autograd can take the tensors over without a copy
        ctx.grads = None
        if grad_out.ne(1).item():
            grad_h = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
            grad_w = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return (grad_h, grad_w) + (None,) * 10


def fused_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                     alpha, distill, topk, tail, temperature=1.0, chunk_size=128):
    """Same arguments, semantics and result as naive_token_loss, without any
    [N, V] tensor: rows are processed in chunks of chunk_size, and the
    gradients for hidden and weight are computed during the forward (the
    backward only scales them, and can run once). loss_fn is called once per
    chunk with rows = slice(a, b); the loss is the sum of those calls.
    chunk_size=128 keeps the extra memory to ~one [128, V] fp32 buffer (~78 MB
    at V=152k) besides the weight gradient; on a GPU a larger chunk (e.g.
    1024) makes the matmuls more efficient."""
    div_mask = _check_args(hidden, weight, tokens, teacher, div_rows, distill)
    loss, logp, div, tlogp = _FusedTokenLoss.apply(
        hidden, weight, tokens, loss_fn, teacher, div_mask,
        alpha, distill, topk, tail, temperature, chunk_size)
    return loss, {"logp": logp, "div": div, "teacher_logp": tlogp}


@torch.no_grad()
def sampled_logprobs(hidden, weight, tokens, temperature=1.0, chunk_size=128):
    """log-softmax(hidden @ weight.T / T) at tokens, [N] fp32, chunked, no grad
    (e.g. reference-model log-probs)."""
    dt = _compute_dtype(hidden.dtype)
    w = weight.to(dt)
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for a in range(0, hidden.shape[0], chunk_size):
        z = hidden[a:a + chunk_size].to(dt) @ w.T
        if temperature != 1.0:
            z.div_(temperature)
        lse = torch.logsumexp(z, 1)
        out[a:a + chunk_size] = (z.gather(1, tokens[a:a + chunk_size, None].long()).squeeze(1) - lse).float()
    return out




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


def grpo_weights(n_tokens, keep, loss_agg, max_new_tokens, global_sum=list):
    """Per-token aggregation weights of the GRPO term over the whole step.

    n_tokens: response length of each sequence; keep: bool per sequence (has signal).
    global_sum adds a list of numbers elementwise over ranks (in one process: `list`, a no-op)."""
    kept = [n for n, k in zip(n_tokens, keep) if k]
    total, n_seq = global_sum([sum(kept), len(kept)])
    total, n_seq = max(total, 1), max(n_seq, 1)
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
    return model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False).last_hidden_state


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


def load_model(init, cfg, dev, torch_dtype):
    """Return (model, tokenizer) for 'scratch', or an HF folder / hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    if init == "scratch":
        if not os.path.exists(os.path.join(cfg["tokenizer_path"], "tokenizer_config.json")):
            raise UserError(f"{cfg['tokenizer_path']} has no tokenizer: run `python data/toy/prepare.py` first")
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
        if not os.path.isdir(init) and init.count("/") != 1:
            raise UserError(f"model {init} not found: no such folder, and not a hub id like Qwen/Qwen3-8B "
                            "(for the toy base: python train.py config/toy_base.py)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(init)
            model = AutoModelForCausalLM.from_pretrained(init, dtype=torch_dtype)
        except (OSError, ValueError) as e:  # not a folder, and not reachable on the hub
            raise UserError(f"cannot load model {init!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(dev, torch_dtype), tokenizer


# ----------------------------------------------------------------------------- evaluation
def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def accuracy_summary(scores, success_threshold=1.0):
    """Per-task lists of n scores -> mean@n (mean score) and pass@n (any sample correct)."""
    n = len(scores[0])
    correct = [sum(s >= success_threshold for s in row) for row in scores]
    return {f"mean@{n}": sum(map(sum, scores)) / (n * len(scores)),
            f"pass@{n}": sum(pass_at_k(n, c, n) for c in correct) / len(correct)}


@torch.no_grad()
def evaluate(model, tokenizer, tasks, n, temperature, top_p, max_new_tokens, batch_prompts, generator,
             enable_thinking=False, success_threshold=1.0, progress=False, static=False, max_rows=0):
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
                           tokenizer.eos_token_id, tokenizer.pad_token_id, generator, static, max_rows)
        decode_responses(tokenizer, rollout)
        for i, task in enumerate(chunk):
            rows = range(i * n, (i + 1) * n)
            scores.append([reward(task["kind"], rollout.texts[r], task["answer"])[0] for r in rows])
            texts.append([rollout.texts[r] for r in rows])
            lengths.extend(len(rollout.response_ids[r]) for r in rows)
    model.train(was_training)
    return {
        **accuracy_summary(scores, success_threshold),
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


@torch.no_grad()
def shared_prompt_hidden(model, prompts, responses, dev):
    """response_hidden without grad, computing each distinct input once: a group's responses share
    one teacher prompt (its first successful peer), so each distinct prompt is prefilled once and
    its KV cache reused; and identical (prompt, response) pairs, common when answers are short
    (several peers write the same correct answer), are read once.

    Prompts are left-padded into one prefill; the distinct responses (right-padded) continue from
    their prompt's cache row at positions len(prompt), len(prompt)+1, ..."""
    from transformers import DynamicCache
    keys = list(zip(map(tuple, prompts), map(tuple, responses)))
    unique = {p: k for k, p in enumerate(dict.fromkeys(p for p, _ in keys))}
    pairs = {pr: k for k, pr in enumerate(dict.fromkeys(keys))}
    ids, mask = (t.to(dev) for t in left_pad(list(unique), 0))
    cache = DynamicCache()
    last = model.model(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, use_cache=True).last_hidden_state[:, -1:]
    which = torch.tensor([unique[p] for p, _ in pairs], device=dev)
    hidden = last[which]  # [pairs, 1, H]: predicts each pair's first response token
    rest_width = max(len(r) for r in responses) - 1  # the last response token predicts nothing
    if rest_width > 0:
        cache.batch_select_indices(which)
        rest_ids = torch.zeros(len(pairs), rest_width, dtype=torch.long)
        rest_mask = torch.zeros_like(rest_ids)
        for k, (_, r) in enumerate(pairs):
            rest_ids[k, :len(r) - 1] = torch.tensor(r[:-1])
            rest_mask[k, :len(r) - 1] = 1
        position = mask.sum(-1)[which, None] + torch.arange(rest_width, device=dev)[None]
        full_mask = torch.cat([mask[which], rest_mask.to(dev)], dim=1)
        rest = model.model(rest_ids.to(dev), full_mask, position, cache, use_cache=True).last_hidden_state
        hidden = torch.cat([hidden, rest], 1)  # [pairs, 1 + rest_width, H]: position t predicts token t
    width = hidden.shape[1]
    index = [pairs[key] * width + t for key in keys for t in range(len(key[1]))]
    return hidden.flatten(0, 1)[torch.tensor(index, device=dev)]


def teacher_parts(mode, rate, model, teacher_model, initial_model, teacher_prompts, responses, dev):
    """Teacher logits as [(hidden [N,H], lm weight, coef)], rows of samples without a teacher
    prompt left at zero (they are outside div_rows, so never read). No grad."""
    has = [i for i, t in enumerate(teacher_prompts) if t is not None]
    lengths = [len(r) for r in responses]
    offsets = [0] + list(itertools.accumulate(lengths))

    def rows(m):
        h = shared_prompt_hidden(m, [teacher_prompts[i] for i in has], [responses[i] for i in has], dev)
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
    metrics = {"loss": 0.0, "div_sum": 0.0, "teacher_minus_student_sum": 0.0, "distill_tokens": 0,
               "reference_s": 0.0, "teacher_s": 0.0, "student_s": 0.0}
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
        t0 = time.time()
        with autocast():
            if cfg["kl_coef"] > 0 and cfg["algo"] != "sft":
                with torch.no_grad():
                    h0 = response_hidden(initial_model, prompts, responses, dev)
                    tb.ref_logp = sampled_logprobs(h0, lm_head_weight(initial_model), tokens, cfg["temperature"], cfg["loss_chunk"])
            t1 = time.time()
            div_rows = tb.distill_weight > 0
            if cfg["algo"] == "sdpo" and div_rows.any():  # teacher forwards only for samples with a signal
                tprompts = [t if w.any() else None for t, w in zip(pick("teacher_prompts"), pick("distill_weight"))]
                parts = teacher_parts(cfg["teacher"], cfg["teacher_rate"], model, teacher_model, initial_model,
                                      tprompts, responses, dev)
            t2 = time.time()
            h = response_hidden(model, prompts, responses, dev)
        temperature = 1.0 if cfg["algo"] == "sft" else cfg["temperature"]
        loss_fn = make_loss_fn(tb, cfg["algo"], cfg["clip_low"], cfg["clip_high"], cfg["kl_coef"], cfg["is_clip"], cfg["distill"])
        loss, stats = loss_impl(h, weight, tokens, loss_fn, teacher=parts, div_rows=div_rows if parts else None,
                                alpha=cfg["alpha"], distill=cfg["distill"], topk=cfg["topk"], tail=cfg["tail"],
                                temperature=temperature)
        loss.backward()
        metrics["reference_s"] += t1 - t0
        metrics["teacher_s"] += t2 - t1
        metrics["student_s"] += time.time() - t2
        metrics["loss"] += loss.item()
        if parts:
            metrics["div_sum"] += stats["div"][div_rows].sum().item()
            metrics["teacher_minus_student_sum"] += (stats["teacher_logp"] - stats["logp"])[div_rows].sum().item()
            metrics["distill_tokens"] += int(div_rows.sum())
    return metrics


# ----------------------------------------------------------------------------- one iteration
def build_batch(tasks, model, tokenizer, cfg, generator, dev, autocast=contextlib.nullcontext, global_sum=list):
    """Rollout → reward → advantage → teacher context for one iteration's prompts.

    Returns (batch for loss_backward, metrics). For algo='sft' the "responses" are the
    reference solutions. With several ranks, `tasks` is this rank's share and global_sum
    adds numbers over ranks, so every loss is normalised by the whole step's token count."""
    eos = tokenizer.eos_token_id
    prompts = [prompt_ids(tokenizer, t["messages"], cfg["enable_thinking"]) for t in tasks]
    if cfg["algo"] == "sft":
        responses = [tokenizer.encode(t["solution"], add_special_tokens=False) + [eos] for t in tasks]
        lengths = [len(r) for r in responses]
        total = global_sum([sum(lengths)])[0]
        return ({"prompts": prompts, "responses": responses, "old_logp": [torch.zeros(n) for n in lengths],
                 "advantage": [0.0] * len(tasks), "pg_weight": [torch.full((n,), 1.0 / total) for n in lengths],
                 "distill_weight": [torch.zeros(n) for n in lengths], "teacher_prompts": [None] * len(tasks)},
                {"tokens": total})
    G = cfg["group_size"]
    t0 = time.time()
    with autocast():
        rollout = generate(model, prompts, G, cfg["max_new_tokens"], cfg["temperature"], cfg["top_p"],
                           eos, tokenizer.pad_token_id, generator, cfg["static_rollout"], cfg["gen_batch_size"])
    decode_responses(tokenizer, rollout)
    t_gen = time.time() - t0
    t0 = time.time()
    scored = [reward(tasks[i // G]["kind"], text, tasks[i // G]["answer"]) for i, text in enumerate(rollout.texts)]
    rewards = torch.tensor([s for s, _ in scored], dtype=torch.float32)
    feedbacks = [f for _, f in scored]
    t_reward = time.time() - t0
    advantages = group_advantages(rewards, G, cfg["norm_adv_std"])
    lengths = [len(r) for r in rollout.response_ids]
    # zero-signal groups are dropped from the GRPO term (unless a KL term still needs them)
    keep = [bool(a != 0) or cfg["kl_coef"] > 0 for a in advantages.tolist()]
    pg_scale = cfg["grpo_mix"] if cfg["algo"] == "sdpo" else 1.0
    pg_weight = [w * pg_scale for w in grpo_weights(lengths, keep, cfg["loss_agg"], cfg["max_new_tokens"], global_sum)]
    teacher_prompts, distill_weight = [None] * len(lengths), [torch.zeros(n) for n in lengths]
    metrics = {}
    if cfg["algo"] == "sdpo":
        contexts = teacher_contexts(tasks, rollout, rewards.tolist(), feedbacks, G, cfg)
        teacher_prompts, truncated, templated = [], 0, {None: None}
        for ctx in contexts:
            key = ctx and json.dumps(ctx)  # a group's rows mostly share one context: template it once
            if key not in templated:
                templated[key] = prompt_ids(tokenizer, ctx, cfg["enable_thinking"])
            ids = templated[key]
            if ids is not None and len(ids) > cfg["max_reprompt_len"]:
                ids, truncated = ids[-cfg["max_reprompt_len"]:], truncated + 1
            teacher_prompts.append(ids)
        masks = density_masks(lengths, cfg["density"], generator)
        masks = [m if t is not None else torch.zeros_like(m) for m, t in zip(masks, teacher_prompts)]
        n_distill = sum(int(m.sum()) for m in masks)
        step_distill = global_sum([n_distill])[0]
        distill_weight = [m.float() * (1 - cfg["grpo_mix"]) / max(step_distill, 1) for m in masks]
        metrics.update(peer_frac=sum(t is not None for t in teacher_prompts) / len(lengths),
                       distill_frac=n_distill / max(sum(lengths), 1), reprompt_truncated=truncated)
    successes = (rewards >= cfg["success_threshold"]).view(-1, G)
    metrics.update(reward=rewards.mean().item(), acc=successes.float().mean().item(),
                   group_success=successes.any(-1).float().mean().item(),
                   zero_signal_groups=(advantages.view(-1, G) == 0).all(-1).float().mean().item(),
                   resp_len=sum(lengths) / len(lengths), truncated=sum(rollout.truncated) / len(lengths),
                   tokens=sum(lengths), gen_s=t_gen, reward_s=t_reward)
    batch = {"prompts": rollout.prompt_ids, "responses": rollout.response_ids, "old_logp": rollout.old_logprobs,
             "advantage": advantages.tolist(), "pg_weight": pg_weight, "distill_weight": distill_weight,
             "teacher_prompts": teacher_prompts}
    return batch, metrics


def set_lr(optimizer, it, learning_rate, warmup_iters, total_iters, decay_lr, min_lr):
    """Linear warmup, then constant, or a cosine from learning_rate to min_lr at the last iteration."""
    if it < warmup_iters:
        lr = learning_rate * (it + 1) / warmup_iters
    elif decay_lr:
        progress = (it + 1 - warmup_iters) / max(1, total_iters - warmup_iters)
        lr = min_lr + 0.5 * (learning_rate - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
    else:
        lr = learning_rate
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


def enable_grad_checkpointing(model):
    """Recompute each decoder block in the backward instead of keeping its activations. Only
    forwards with grad recompute: rollouts and teacher forwards (no grad) keep their KV cache."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # renamed in transformers 5.x
    enable()


def frozen_copy(model):
    m = copy.deepcopy(model).eval()
    m.requires_grad_(False)
    return m


class Dist:
    """torchrun's process group, or a single process. Ranks hold whole prompt groups; they
    add token counts (global_sum) and gradients (all_reduce_grads); rank 0 writes."""

    def __init__(self, device_name):
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.device = pick_device(device_name)
        if self.world > 1:
            import torch.distributed as dist
            self.dist = dist
            if self.device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.master = self.rank == 0

    def global_sum(self, numbers):
        if self.world == 1:
            return list(numbers)
        t = torch.tensor(numbers, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return [int(x) if float(x).is_integer() else float(x) for x in t.tolist()]

    def all_reduce_grads(self, model):
        """Sum gradients over ranks (each rank's loss is already / the global token count)."""
        if self.world == 1:
            return
        params = list(model.parameters())
        for p in params:
            if p.grad is None:  # this rank had no signal for it: contribute zeros
                p.grad = torch.zeros_like(p)
        flat = torch._utils._flatten_dense_tensors([p.grad for p in params])
        self.dist.all_reduce(flat)
        for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(g)

    def gather(self, obj):
        """A list of every rank's obj (in rank order)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self):
        if self.world > 1:
            self.dist.barrier()


def main(cfg):
    check_config(cfg)
    ddp = Dist(cfg["device"])
    if cfg["batch_prompts"] % ddp.world:
        raise UserError(f"batch_prompts={cfg['batch_prompts']} must be divisible by the {ddp.world} ranks")
    dev, say = ddp.device, (print if ddp.master else (lambda *a, **k: None))
    autocast = make_autocast(dev, cfg["dtype"])
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    stage_list = parse_stages(cfg["stages"], cfg["dataset"], cfg["max_iters"])
    total_iters = sum(iters for _, iters in stage_list)
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
    model.train()
    if cfg["grad_checkpointing"]:
        enable_grad_checkpointing(model)
    # the initial model: KL reference, frozen / trust-region teacher, 'initial' stage reset
    needs_initial = (cfg["algo"] != "sft" and cfg["kl_coef"] > 0) or (cfg["algo"] == "sdpo" and (
        cfg["teacher"] in ("frozen", "trust_region") or cfg["teacher_stage_reset"] == "initial"))
    initial_model = None
    if needs_initial:
        initial_model = frozen_copy(load_model(state["base_init"], cfg, dev, torch.float32)[0] if resume else model)
    teacher_model = None
    if cfg["algo"] == "sdpo" and cfg["teacher"] in ("frozen", "ema"):
        teacher_model = frozen_copy(initial_model if initial_model is not None else model)
        if cfg["teacher_init"] and not resume:
            # θ_T ← (1 − a)·θ_T + a·θ_init: the EMA update's formula, applied once
            ema_update(teacher_model, load_model(cfg["teacher_init"], cfg, dev, torch.float32)[0], cfg["teacher_init_alpha"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                                  weight_decay=cfg["weight_decay"])
    generator = torch.Generator().manual_seed(cfg["seed"] + ddp.rank)  # sampling and density masks, per rank
    data_rng = random.Random(cfg["seed"])  # the global prompt order, the same on every rank
    if resume:
        saved, rng = load_trainer_state(ckpt_dir, optimizer, teacher_model)
        state.update(saved)
        generator.set_state(rng[f"sampling.{ddp.rank}"])
        data_rng.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["data_rng"]))
        say(f"resumed from {ckpt_dir} at iteration {state['iter']} (stage {state['stage']}, step {state['stage_iter']})")
    if ddp.master:
        os.makedirs(out_dir, exist_ok=True)
        if not resume:  # a fresh run replaces an earlier run's outputs (its checkpoint is overwritten anyway)
            earlier_outputs = r"log\.jsonl|accuracy_matrix\.json|eval(_\w+)?\.(json|md|png)|stage\d+_.+"
            stale = sorted(f for f in os.listdir(out_dir) if re.fullmatch(earlier_outputs, f))
            for f in stale:
                path = os.path.join(out_dir, f)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            if stale:
                say(f"fresh run in {out_dir}: removed the earlier run's {', '.join(stale)}")
    eval_names = [s for s in cfg["eval_sets"].split(",") if s] or [n for n, _ in stage_list for n in n.split("+")]
    eval_names = list(dict.fromkeys(eval_names))
    eval_tasks = {}
    for name in eval_names:
        tasks = load_tasks(name, "test", cfg["data_dir"])
        eval_tasks[name] = tasks[:cfg["eval_max_prompts"]] if cfg["eval_max_prompts"] > 0 else tasks
    wandb = None
    if cfg["wandb_log"] and ddp.master:
        try:
            import wandb
        except ImportError:
            raise UserError("wandb_log=True but wandb is not installed: pip install wandb") from None
        wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"], config=cfg)

    def log(record):
        if cfg["log_jsonl"] and ddp.master:
            with open(os.path.join(out_dir, "log.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        if wandb:
            wandb.log(record, step=record["iter"])

    def run_eval(tag):
        """Score every eval set (tasks sharded over ranks); returns {set: mean@n}."""
        eval_gen = torch.Generator().manual_seed(cfg["seed"] + 1 + ddp.rank)  # same samples each time: comparable
        row, n = {}, cfg["eval_n"]
        state["eval_len"] = {}
        for name, tasks in eval_tasks.items():
            with autocast():
                res = evaluate(model, tokenizer, tasks[ddp.rank::ddp.world], n, cfg["eval_temperature"], cfg["eval_top_p"],
                               cfg["max_new_tokens"], max(1, cfg["batch_prompts"] * cfg["group_size"] // n), eval_gen,
                               cfg["enable_thinking"], cfg["success_threshold"], static=cfg["static_rollout"],
                               max_rows=cfg["gen_batch_size"])
            parts = ddp.gather((res["scores"], res["mean_len"] * n * len(res["scores"])))
            scores = [row_scores for p in parts for row_scores in p[0]]
            acc = accuracy_summary(scores, cfg["success_threshold"])
            row[name] = acc[f"mean@{n}"]
            state["eval_len"][name] = sum(p[1] for p in parts) / (n * len(scores))
            log({"iter": state["iter"], "eval": name, "tag": tag, **acc, "mean_len": state["eval_len"][name]})
        say(f"eval @ iter {state['iter']} ({tag}): " + ", ".join(f"{k} mean@{n} {v:.3f}" for k, v in row.items()), flush=True)
        return row

    def checkpoint():
        # ranks must hold identical weights (same init, same all-reduced steps): check cheaply
        sums = ddp.gather(sum(p.detach().double().sum().item() for p in model.parameters()))
        if ddp.world > 1:
            log({"iter": state["iter"], "rank_param_sums": sums})
            if len(set(sums)) > 1:
                raise UserError(f"ranks diverged: parameter sums {sums}")
        rng_states = ddp.gather(generator.get_state())
        if ddp.master:
            state["data_rng"] = data_rng.getstate()
            save_checkpoint(ckpt_dir, model, tokenizer, optimizer, teacher_model, {**state, "config": cfg},
                            {f"sampling.{r}": g for r, g in enumerate(rng_states)})
        ddp.barrier()

    if state["iter"] == 0:
        state["accuracy_matrix"] = {"eval_sets": eval_names, "stages": [], "base": run_eval("start"), "rows": []}
    share = cfg["batch_prompts"] // ddp.world
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
            stage_desc = f"stage {stage + 1}/{len(stage_list)} {name}" if len(stage_list) > 1 else name
            while state["stage_iter"] < iters:
                t0 = time.time()
                lr = set_lr(optimizer, state["iter"], cfg["learning_rate"], cfg["warmup_iters"], total_iters,
                            cfg["decay_lr"], cfg["min_lr"])
                step_tasks = [data_rng.choice(tasks) for _ in range(cfg["batch_prompts"])]  # the global batch
                my_tasks = step_tasks[ddp.rank * share:(ddp.rank + 1) * share]  # whole groups per rank
                batch, metrics = build_batch(my_tasks, model, tokenizer, cfg, generator, dev, autocast, ddp.global_sum)
                t1 = time.time()
                m = loss_backward(model, batch, cfg, dev, teacher_model, initial_model, autocast)
                if not math.isfinite(m["loss"]):
                    raise Collapse(f"loss is {m['loss']}")
                ddp.all_reduce_grads(model)
                t2 = time.time()
                grad_norm = optimizer_step(model, optimizer, cfg["grad_clip"])
                if teacher_model is not None and cfg["teacher"] == "ema":
                    ema_update(teacher_model, model, cfg["teacher_rate"])  # identical on every rank
                t3 = time.time()
                state["iter"] += 1
                state["stage_iter"] += 1
                # rank-mean of the rollout metrics, step sums of the loss pieces
                keys = sorted(metrics)
                sums = ddp.global_sum([metrics[k] for k in keys] + [m[k] for k in ("loss", "div_sum", "teacher_minus_student_sum",
                                                                                   "distill_tokens")])
                metrics = {k: v / ddp.world for k, v in zip(keys, sums)}
                metrics["tokens"] *= ddp.world
                loss, div_sum, tms_sum, distill_tokens = sums[len(keys):]
                if distill_tokens:
                    metrics.update(div=div_sum / distill_tokens, teacher_minus_student=tms_sum / distill_tokens)
                record = {"iter": state["iter"], "stage": name, "loss": loss, "lr": lr, "grad_norm": grad_norm, **metrics,
                          "reference_s": m["reference_s"], "teacher_s": m["teacher_s"], "student_s": m["student_s"],
                          "optimizer_s": t3 - t2, "train_s": t3 - t1, "iter_s": t3 - t0}
                log(record)
                shown = " | ".join(f"{k} {record[k]:.4g}" for k in ("loss", "reward", "acc", "resp_len", "div", "peer_frac")
                                   if k in record)
                say(f"{stage_desc} iter {state['iter']} | {shown} | tok/s {record['tokens'] / record['iter_s']:.0f}"
                    + (f" | gen {record['gen_s']:.2f}s" if "gen_s" in record else "") + f" train {t3 - t1:.2f}s", flush=True)
                last = state["stage_iter"] == iters
                if not last and cfg["eval_interval"] and state["stage_iter"] % cfg["eval_interval"] == 0:
                    row = run_eval("periodic")
                    check_collapse(row, name, state, cfg)
                    if not cfg["save_interval"]:
                        checkpoint()
                if cfg["save_interval"] and state["iter"] % cfg["save_interval"] == 0 and not last:
                    checkpoint()
            # end of stage: a row of the accuracy matrix, a snapshot, a checkpoint
            row = run_eval(f"end of stage {stage + 1}")
            state["accuracy_matrix"]["stages"].append(name)
            state["accuracy_matrix"]["rows"].append([row[s] for s in eval_names])
            if ddp.master:
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
    say(f"done: {state['iter']} iterations; model in {ckpt_dir}")
    if ddp.world > 1:
        ddp.dist.destroy_process_group()


def check_collapse(row, name, state, cfg):
    """A collapse: for collapse_patience evals in a row, zero accuracy on the training set(s),
    or responses that are (nearly) empty -- the signs of a policy that stopped answering."""
    own = [n for n in name.split("+") if n in row]
    dead = own and (max(row[n] for n in own) == 0 or max(state["eval_len"][n] for n in own) < 2)
    state["zero_acc_evals"] = state["zero_acc_evals"] + 1 if dead else 0
    if cfg["stop_on_collapse"] and state["zero_acc_evals"] >= cfg["collapse_patience"]:
        raise Collapse(f"{name}: zero accuracy or empty responses for {state['zero_acc_evals']} evals in a row")


if __name__ == "__main__":
    from configurator import configure
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except UserError as e:
        sys.exit(f"error: {e}")
