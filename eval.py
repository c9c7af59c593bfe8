"""
Evaluate a trained model against the model it started from: accuracy, continual metrics, drift.

    python eval.py --run_dir=out/grpo_toy                                  # the run's final checkpoint vs its base
    python eval.py --run_dir=out/continual_sdpo --eval_sets=toy/add,toy/mul,toy/sort --plots=True
    python eval.py --model=out/sdpo_math/ckpt --base_model=Qwen/Qwen3-4B --eval_sets=math --n=16 --k=1,4,16

What it reports (JSON at `out`, default run_dir/eval.json, and a markdown table beside it):
  accuracy    per eval set, for the model and the base model: mean@n (mean reward of n samples per
              prompt at temperature/top_p) and the unbiased pass@k for each k (Chen et al. 2021),
              plus delta = model − base, and the macro average over sets.
  continual   from run_dir/accuracy_matrix.json: average final accuracy, forgetting per set,
              backward and forward transfer, in-domain gain per stage (see continual_metrics).
  drift       parameter drift ‖θ−θ0‖/‖θ0‖ (overall, per layer, per module type); spectral drift
              (how far the top-k singular subspaces of each weight matrix rotated and its top-k
              singular values changed, after arXiv 2511.08567; see spectral_drift); response drift
              on fixed prompts (MMD² of base-model embeddings of the two models' responses, and
              text similarity of paired responses); format artifacts (another domain's answer
              format, repetition loops, missing final answers, mean length) -- for the model and,
              when run_dir holds per-stage snapshots, for every stage (a curve over stages).
Response drift uses the first `drift_prompts` test prompts of each set, one response per prompt
sampled at temperature/top_p with a generator seeded by `seed` (not greedy), for both models; the
responses are embedded by the *base* model (mean-pooled final hidden states over the response
tokens, read after the prompt), so both sides live in one embedding space.

JSON keys: config, model, base_model, eval_sets, ks,
  accuracy      {set: {n_prompts, model: {mean@n, pass@k...}, base: {...}, delta: {...}}}
  accuracy_avg  {model, base, delta} macro-averaged over sets
  continual     the accuracy matrix (eval_sets, stages, base, rows) + continual_metrics(), or null
  drift         param {overall, by_layer, by_module}; spectral {k, overall, by_module} (each group: n, k,
                nss_left, nss_right, max_angle_left, max_angle_right, sv_change; null when spectral_k=-1);
                response {set: {mmd2, mmd2_floor, bandwidth, text_similarity, identical, n_prompts}};
                artifacts {set: {model, base}} (every eval sample); drift_artifacts / base_drift_artifacts
                {set: ...} (the drift responses);
                examples {set: [{prompt, model, base}]}
  stage_drift   [{stage, name, path, param, spectral, response, artifacts}] per stage snapshot of run_dir
  plots         the PNG paths (plots=True)
Same configurator as train.py: `python eval.py --help` lists every key.
"""
import contextlib
import difflib
import json
import math
import os
import re
import sys

import torch

import checkpoint
import runtime
import models
import train
from configurator import check_seed, configure, require
from data import checkers
from data import tasks as task_files

run_dir = ""  # a training run folder (train.py's out_dir): accuracy matrix, per-stage snapshots, base model
model = ""  # checkpoint folder or HF id to score ('' = run_dir/ckpt)
base_model = ""  # the reference model ('' = the run's base_init, refused if it changed since the run began; 'none' = no base)
eval_sets = ""  # comma list of test sets and/or presets from data/common.py (math, science, tool, general, paper); '' = the run's
n = 16  # samples per prompt for mean@n and pass@k (the paper: 16)
k = "1,4,16"  # comma list of k for pass@k (values above n are dropped)
temperature = 0.6  # sampling temperature
top_p = 0.95  # nucleus sampling
max_new_tokens = 0  # response length cap (0 = the run's max_new_tokens, else 2048)
success_threshold = 0.0  # reward at which a sample counts as solved for pass@k (0 = the run's success_threshold, else 1.0)
math_checker = ""  # 'builtin' or 'math_verify' ('' = the run's math_checker, else builtin): scored as train.py scored it
max_prompts = 0  # test prompts per set (0 = all)
drift_prompts = 32  # the first prompts of each set used for response drift (0 = skip response drift)
batch_prompts = 8  # prompts per generation batch (each with n samples); sampled scores depend on it: a batch's rows draw from one generator
stage_drift = True  # drift metrics for every per-stage snapshot in run_dir (a curve over stages)
spectral_k = 0  # top-k singular directions per matrix for spectral drift (0 = auto: min(m,n)//8 clipped to 1..64; -1 = skip)
out = ""  # JSON output path, ending in .json ('' = run_dir/eval.json, else eval.json); the markdown goes beside it (.md)
seed = 1337  # sampling seed (each set and each model starts from the same generator state)
device = "auto"  # 'auto', 'cpu', 'cuda', ...
dtype = "auto"  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU), 'float32', 'bfloat16'
static_rollout = "auto"  # decode on a static KV cache through a compiled step: 'auto' (on for CUDA), 'on', 'off' (as train.py)
data_dir = "data"  # datasets live in data_dir/<name>/{train,test}.jsonl
enable_thinking = False  # passed to the chat template (Qwen3: thinking off, the paper's setting)
plots = False  # also write PNGs: the accuracy-matrix heatmap and drift curves (needs matplotlib)


# ----------------------------------------------------------------------------- accuracy
def delta(a, b):
    """a − b for every key the two dicts share (values None when either is)."""
    return {key: (a[key] - b[key] if a[key] is not None and b[key] is not None else None) for key in a if key in b}


# ----------------------------------------------------------------------------- continual metrics
def stage_columns(stages, eval_sets):
    """For each stage name, the eval-set columns it trained on: 'a+b' -> [col of a, col of b].

    A stage whose dataset is not among the eval sets gets [] and is left out of BWT/FWT."""
    return [[eval_sets.index(p) for p in stage.split("+") if p in eval_sets] for stage in stages]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def continual_metrics(matrix):
    """Continual-learning summary of an accuracy matrix (train.py's accuracy_matrix.json).

    a[i][j] = accuracy after stage i (0..T−1) on eval set j; base[j] = before training;
    J(i) = the columns of the sets stage i trained on (stage 'a+b' trains on a and b).
      avg_final     = mean_j a[T−1][j], over every eval set (held-out ones included)
      avg_acc       = mean_{j trained in some stage} a[T−1][j]: GEM's average accuracy ACC (Lopez-Paz &
                      Ranzato 2017), the trained sets only (None if no eval set was trained on)
      forgetting[j] = max_{i < T−1} a[i][j] − a[T−1][j], for the sets trained on in some stage
                      before the last one ("seen"); None for the others (trained only in the last
                      stage, or never trained on: held-out sets), where forgetting is undefined
      avg_forgetting = mean of forgetting over the seen sets (None if there are none)
      max_drop[j]   = max(base[j], a[0..T−2][j]) − a[T−1][j], for every set (the best score ever
                      held minus the final one; covers held-out sets and T = 1)
      BWT = mean_{i < T−1} [ mean_{j∈J(i)} a[T−1][j] − a[i][j] ]   (< 0: later stages undid it)
      FWT = mean_{i > 0} [ mean_{j∈J(i)} a[i−1][j] − base[j] ]     (> 0: earlier stages helped)
      gain[i] = mean_{j∈J(i)} a[i][j] − a[i−1][j], a[−1] = base   (in-domain learning per stage)
    Stages with J(i) = [] are skipped in BWT/FWT (gain None); a mean over nothing is None.
    """
    sets, stages, rows = matrix["eval_sets"], matrix["stages"], matrix["rows"]
    base = matrix.get("base") or {}
    base_row = [base.get(s) for s in sets]
    T = len(rows)
    if T == 0:
        return {"avg_final": None, "avg_acc": None, "forgetting": {}, "avg_forgetting": None, "max_drop": {}, "bwt": None,
                "fwt": None, "gain": [], "stage_columns": []}
    cols = stage_columns(stages, sets)
    final = rows[-1]
    seen = {j for i in range(T - 1) for j in cols[i]}
    forgetting = {s: (max(rows[i][j] for i in range(T - 1)) - final[j] if j in seen else None)
                  for j, s in enumerate(sets)}
    max_drop = {s: max([v for v in [base_row[j]] + [rows[i][j] for i in range(T - 1)] if v is not None]
                       or [final[j]]) - final[j] for j, s in enumerate(sets)}
    bwt = _mean([_mean([final[j] - rows[i][j] for j in cols[i]]) for i in range(T - 1)])
    fwt = _mean([_mean([rows[i - 1][j] - base_row[j] for j in cols[i] if base_row[j] is not None])
                 for i in range(1, T)])
    gain = [_mean([rows[i][j] - (rows[i - 1][j] if i else base_row[j]) for j in cols[i]
                   if i or base_row[j] is not None]) for i in range(T)]
    trained = sorted({j for c in cols for j in c})
    return {"avg_final": sum(final) / len(final), "avg_acc": _mean([final[j] for j in trained]), "forgetting": forgetting,
            "avg_forgetting": _mean([forgetting[s] for s in sets if forgetting[s] is not None]),
            "max_drop": max_drop, "bwt": bwt, "fwt": fwt, "gain": gain, "stage_columns": cols}


# ----------------------------------------------------------------------------- parameter drift
MODULE_TYPES = ("attn_q", "attn_k", "attn_v", "attn_o", "mlp", "norm", "embed", "other")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def module_type(name):
    """Parameter name -> one of MODULE_TYPES (Qwen/Llama naming; 'other' for anything else)."""
    if "norm" in name:  # input/post_attention_layernorm, final norm, Qwen3's q_norm/k_norm
        return "norm"
    for proj, kind in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_o")):
        if proj in name:
            return kind
    if ".mlp." in name or any(p in name for p in ("gate_proj", "up_proj", "down_proj")):
        return "mlp"
    if "embed" in name or "lm_head" in name or "wte" in name:  # input embeddings and the LM head
        return "embed"
    return "other"


def paired_tensors(state, state0):
    """Yield (name, θ tensor, θ0 tensor) for every floating-point tensor of two state dicts of one
    architecture (θ = state, θ0 = state0). A tensor that shares storage with one already yielded, in
    either state dict (tied embedding / LM head), is skipped: counted once. Different names or shapes
    raise one train.UserError naming the first mismatch."""
    missing = sorted(set(state0) ^ set(state))
    if missing:
        raise train.UserError(f"the two models have different parameters ({', '.join(missing[:3])}...): "
                              "parameter drift needs the same architecture")
    seen = set()
    for name, t0 in state0.items():
        t = state[name]
        if not torch.is_floating_point(t0):
            continue
        if tuple(t.shape) != tuple(t0.shape):
            raise train.UserError(f"{name} has shape {tuple(t.shape)} vs {tuple(t0.shape)} in the base: "
                                  "parameter drift needs the same architecture")
        if ("base", t0.data_ptr()) in seen or ("model", t.data_ptr()) in seen:
            continue  # tied to a tensor already counted (in either model)
        seen.update((("base", t0.data_ptr()), ("model", t.data_ptr())))
        yield name, t, t0


@torch.no_grad()
def param_drift(state, state0):
    """Relative parameter drift ‖θ−θ0‖ / ‖θ0‖ between two state dicts (θ = state, θ0 = state0).

    Returns {"overall", "by_layer": {layer index (str): ...}, "by_module": {module type: ...}},
    each the norm of the difference over that group's tensors concatenated, divided by the norm
    of the group's θ0. Floating-point tensors only; a tensor that shares storage with one already
    counted, in either state dict (tied embedding / LM head), is counted once. 0 for an unchanged model. Parameters
    outside a numbered block (embeddings, final norm) appear only in overall and by_module."""
    diff2, ref2 = {}, {}
    for name, t, t0 in paired_tensors(state, state0):
        d = (t.detach().double().to(t0.device) - t0.detach().double()).pow(2).sum().item()
        r = t0.detach().double().pow(2).sum().item()
        layer = _LAYER_RE.search(name)
        for group in ("overall", "module:" + module_type(name)) + (("layer:" + layer.group(1),) if layer else ()):
            diff2[group] = diff2.get(group, 0.0) + d
            ref2[group] = ref2.get(group, 0.0) + r

    def rel(g):
        return math.sqrt(diff2[g]) / math.sqrt(ref2[g]) if ref2[g] > 0 else (0.0 if diff2[g] == 0 else math.inf)

    layers = sorted((g for g in diff2 if g.startswith("layer:")), key=lambda g: int(g[6:]))
    return {"overall": rel("overall") if "overall" in diff2 else 0.0,
            "by_layer": {g[6:]: rel(g) for g in layers},
            "by_module": {m: rel("module:" + m) for m in MODULE_TYPES if "module:" + m in diff2}}


# ----------------------------------------------------------------------------- spectral drift
SPECTRAL_METRICS = ("nss_left", "nss_right", "max_angle_left", "max_angle_right", "sv_change")


def spectral_k_for(shape, k):
    """The k used for a weight matrix of this shape: k itself when k > 0 (at most min(m, n)); for
    k = 0, min(64, max(1, min(m, n) // 8)): the top eighth of the directions, capped at 64 so that
    "principal" keeps meaning the leading directions of a large matrix (2560 x 9728 -> 64; the toy
    model's 128 x 128 and 512 x 128 -> 16)."""
    r = min(shape)
    return min(k, r) if k > 0 else min(64, max(1, r // 8))


def top_singular(w, k):
    """(s, U, V): the top-k singular values of a 2-D tensor, descending, and orthonormal bases
    (columns) of its top-k left and right singular subspaces; float64 on the CPU.

    Computed from the Gram matrix of the smaller side rather than a full SVD: for W (m x n, m <= n),
    W Wᵀ = U Σ² Uᵀ, so torch.linalg.eigh gives σ_i² and U; the right subspace span(V_k) equals
    span(Wᵀ U_k) = span(V_k Σ_k), orthonormalised by QR (the bases are compared as subspaces, so
    the signs and order within them do not matter). In float64 this matches torch.linalg.svd to
    roundoff (about ε·σ1² / (σk² − σk+1²) in the vectors) at a fraction of the cost: m²n for the Gram
    product plus an m x m eigh, against gesdd's QR + SVD (one thread here: 1024 x 3891 0.7 s vs
    6.1 s, 2560 x 9728 14 s vs 50 s). Not torch.svd_lowrank: its top-k subspace is approximate (on
    1024 x 3891 with σ_i ∝ i^-0.5, q = 2k = 128 and niter = 4 still leave a 3° largest angle to the
    exact one), far above the sub-degree rotations being measured."""
    w = w.detach().to("cpu", torch.float64)
    wide = w.shape[0] <= w.shape[1]
    a = w if wide else w.T  # a: the matrix with the smaller side first (m <= n)
    evals, evecs = torch.linalg.eigh(a @ a.T)  # ascending
    s = evals.flip(0)[:k].clamp_min(0).sqrt()
    left = evecs.flip(1)[:, :k]
    right, _ = torch.linalg.qr(a.T @ left)
    return (s, left, right) if wide else (s, right, left)


def subspace_similarity(a, b):
    """(NSS, largest principal angle in degrees) between span(a) and span(b), a and b n x k with
    orthonormal columns.

    The principal angles θ_1 <= ... <= θ_k have cos θ_i = the singular values of aᵀb. NSS =
    ‖aᵀb‖_F² / k = mean_i cos² θ_i: 1 for the same subspace, 0 for orthogonal ones, k/n on average
    for a random k-dimensional subspace of R^n. The largest angle is taken from its sine,
    sin θ_k = ‖b − a aᵀb‖₂ (the part of span(b) outside span(a)), which stays accurate for the tiny
    angles RL fine-tuning produces, where arccos of a cosine near 1 would lose digits."""
    k = a.shape[1]
    ab = a.T @ b
    nss = min(1.0, ab.pow(2).sum().item() / k)
    sin_max = torch.linalg.matrix_norm(b - a @ ab, ord=2).item()
    return nss, math.degrees(math.asin(min(1.0, sin_max)))


@torch.no_grad()
def spectral_drift(state, state0, k=0, base_cache=None):
    """How far training rotated and rescaled the principal directions of each weight matrix
    (θ = state, θ0 = state0), after "The Path Not Taken" (arXiv 2511.08567): RL updates leave the
    top singular subspaces and spectrum of the base weights nearly intact, SFT rotates and
    rescales them. ‖θ−θ0‖/‖θ0‖ cannot tell these apart: W = 2·W0 drifts by 1 but keeps every
    direction, while a small update aimed along the top singular vectors rotates them. The
    paper's exact formulas could not be checked here (only its abstract was reachable); these are
    the standard definitions of subspace similarity and principal angles (Björck & Golub 1973).

    For every 2-D floating-point weight W0 (base) and W (model), with k = spectral_k_for(shape, k)
    and U0, U (V0, V) orthonormal bases of the top-k left (right) singular subspaces (top_singular):
      nss_left         ‖U0ᵀU‖_F² / k = mean cos² of the principal angles (1 = same subspace, 0 = orthogonal)
      max_angle_left   the largest principal angle between span(U0) and span(U), in degrees
      nss_right, max_angle_right   the same for V0, V
      sv_change        ‖σ − σ0‖₂ / ‖σ0‖₂ over the top-k singular values (each sorted descending):
                       the relative spectrum drift (W = 2·W0 gives 1.0, a rotation gives 0)
    Each is the unweighted mean over matrices: "overall", and "by_module" per module_type, each
    group with "n" (matrices) and "k" (the distinct k used). Skipped: 1-D tensors (norms, biases),
    embeddings and the LM head (module type "embed": a lookup table / readout indexed by vocabulary,
    the largest matrix by far, and not one of the block's linear maps that the principal-direction
    argument is about), and a W0 that is all zeros (no principal directions); tied tensors count
    once and mismatched architectures raise param_drift's train.UserError (paired_tensors).

    Caveat: the top-k subspace is well defined only when σ_k > σ_k+1. Where the spectrum has no
    gap at k (e.g. a randomly initialised matrix), directions near the cut can swap under a tiny
    update: the largest angle reacts first, NSS (an average over k) much less.

    Cost: two float64 eighs (base and model) of the smaller Gram matrix per matrix, on the CPU
    (top_singular). Toy model (4 layers, width 128: 28 matrices of 128 x 128 and 512 x 128): ~0.4 s
    on one thread. Qwen3-4B (252 matrices, 180 of them with a 2560 side, up to 2560 x 9728): ~14 s
    per 2560 x 9728 decomposition on one thread (torch.linalg.svd: ~50 s), so ~1.5 h on one thread
    or perhaps 15-30 min on 16 cores for every model compared (the final model and each stage
    snapshot; an estimate, not measured; eigh does not scale linearly with cores); spectral_k = -1
    in eval.py skips it. base_cache: a dict kept across calls against the same state0, so the base's
    decompositions are computed once for the final model and every stage snapshot."""
    sums, ks, cache = {}, {}, {} if base_cache is None else base_cache
    for name, t, t0 in paired_tensors(state, state0):
        kind = module_type(name)
        if t0.dim() != 2 or kind == "embed" or not t0.any():
            continue
        kk = spectral_k_for(t0.shape, k)
        if (name, kk) not in cache:
            cache[(name, kk)] = top_singular(t0, kk)
        s0, u0, v0 = cache[(name, kk)]
        s, u, v = top_singular(t, kk)
        values = (*subspace_similarity(u0, u), *subspace_similarity(v0, v))
        row = dict(zip(("nss_left", "max_angle_left", "nss_right", "max_angle_right"), values),
                   sv_change=(s - s0).norm().item() / s0.norm().item())
        for group in ("overall", kind):
            acc = sums.setdefault(group, dict.fromkeys(SPECTRAL_METRICS, 0.0) | {"n": 0})
            for key in SPECTRAL_METRICS:
                acc[key] += row[key]
            acc["n"] += 1
            ks.setdefault(group, set()).add(kk)

    def mean(group):
        acc = sums[group]
        return {"n": acc["n"], "k": sorted(ks[group]), **{key: acc[key] / acc["n"] for key in SPECTRAL_METRICS}}

    return {"k": k, "overall": mean("overall") if "overall" in sums else None,
            "by_module": {m: mean(m) for m in MODULE_TYPES if m in sums}}


# ----------------------------------------------------------------------------- response drift
def median_heuristic(x):
    """Median pairwise Euclidean distance between distinct rows of x [N, D] (the RBF bandwidth σ);
    for an even number of pairs the lower of the two middle ones (torch.median's).

    None when there are fewer than two rows or that median is 0 (at least half the pairs coincide:
    the callers then fall back to another bandwidth)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.shape[0] < 2:
        return None
    d = torch.cdist(x, x)
    i, j = torch.triu_indices(x.shape[0], x.shape[0], 1)
    med = d[i, j].median().item()
    return med if med > 0 else None


def mmd_rbf(x, y, sigma=None):
    """Unbiased MMD² (Gretton et al. 2012) between samples x [m, D] and y [n, D] (m, n >= 2) with
    the RBF kernel k(a, b) = exp(−‖a−b‖² / (2σ²)):

        MMD²_u = Σ_{i≠i'} k(x_i, x_i') / m(m−1) + Σ_{j≠j'} k(y_j, y_j') / n(n−1) − 2·cross
        cross  = Σ_{i≠j} k(x_i, y_j) / m(m−1)   when m = n (eq. 3 of the paper: the U-statistic over
                                                 pairs z_i = (x_i, y_i), so rows i are pairs)
               = Σ_{i,j} k(x_i, y_j) / mn       when m ≠ n
    With m = n the paired terms k(x_i, y_i) are left out, so the estimate stays unbiased when x_i
    and y_i are dependent (here: two models' responses to the same prompt with the same seed) and
    is exactly 0 for y = x. σ defaults to the median heuristic over the pooled samples (1.0 if all
    points coincide). ≈ 0 (it can be slightly negative) for samples from one distribution, > 0
    when the distributions differ."""
    x = torch.as_tensor(x, dtype=torch.float64)
    y = torch.as_tensor(y, dtype=torch.float64)
    m, n_ = x.shape[0], y.shape[0]
    if m < 2 or n_ < 2:
        raise ValueError("mmd_rbf needs at least two samples on each side")
    if sigma is None:
        sigma = median_heuristic(torch.cat([x, y])) or 1.0

    def kernel(a, b):
        return torch.exp(-torch.cdist(a, b).pow(2) / (2 * sigma ** 2))

    def off_diagonal_mean(kk):
        return (kk.sum() - kk.diagonal().sum()) / (kk.shape[0] * (kk.shape[0] - 1))

    kxy = kernel(x, y)
    cross = off_diagonal_mean(kxy) if m == n_ else kxy.mean()
    return (off_diagonal_mean(kernel(x, x)) + off_diagonal_mean(kernel(y, y)) - 2 * cross).item()


TEXT_SIM_CHARS = 4000  # difflib is quadratic in the worst case: compare at most this many leading characters


def text_similarity(a, b):
    """Mean difflib SequenceMatcher ratio (0 = nothing shared, 1 = identical) over paired texts."""
    if not a:
        return None
    return sum(difflib.SequenceMatcher(None, x[:TEXT_SIM_CHARS], y[:TEXT_SIM_CHARS]).ratio()
               for x, y in zip(a, b)) / len(a)


@torch.no_grad()
def embed_responses(model, tokenizer, message_lists, texts, dev, batch=16, enable_thinking=False, autocast=None):
    """Mean-pooled final hidden states of `model` over each response's tokens, read after its prompt.

    Each response text is re-encoded with `tokenizer` and followed by EOS (so an empty response
    still has one position): the embedding space belongs to `model` alone, whichever model wrote
    the text. Returns a float32 CPU tensor [N, hidden]."""
    autocast = autocast or contextlib.nullcontext
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(texts), batch):
        prompts = [train.prompt_ids(tokenizer, msgs, enable_thinking) for msgs in message_lists[start:start + batch]]
        responses = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
                     for t in texts[start:start + batch]]
        with autocast():
            h = models.hidden_states(model, [p + r for p, r in zip(prompts, responses)], dev)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            out.append(h[i, len(p):len(p) + len(r)].float().mean(0).cpu())
    model.train(was_training)
    return torch.stack(out)


# ----------------------------------------------------------------------------- format artifacts
FORMATS = {  # answer formats of the domains; each kind expects one of them
    "boxed": re.compile(r"\\(?:boxed|fbox)\s*\{"),
    "answer_tag": re.compile(r"<answer>", re.I),
    "tool_call": re.compile(r"^[ \t*]*Action[ \t*]*Input[ \t*]*:", re.M),
    "python_block": re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n", re.I),
}
NATIVE_FORMAT = {"math": "boxed", "mcq": "answer_tag", "exact": "answer_tag", "tool": "tool_call",
                 "code": "python_block"}  # an expression task's code answer is an <answer> tag (native_format)
REPEAT_RE = re.compile(r"(.{1,40}?)\1{3,}", re.S)  # a unit of 1-40 characters, then >= 3 more copies of it
LOOP_MIN_SPAN = 16  # ...covering at least this many characters, with a letter or digit in the unit
LOOP_NGRAM, LOOP_MIN_WORDS, LOOP_DUP_FRAC = 4, 32, 0.5
LOOP_CHARS = 20_000  # look at most at this many leading characters


def native_format(kind, answer=None):
    """The answer format a task of `kind` expects (a FORMATS name), None for an unknown kind. A code
    task's is a ```python block, except an expression task's (the toy func domain): an <answer> tag."""
    if kind == "code" and checkers.code_expression(answer):
        return "answer_tag"
    return NATIVE_FORMAT.get(kind)


def foreign_formats(text, kind, answer=None):
    """Names of the answer formats in `text` that belong to other domains than `kind`'s.

    math expects \\boxed{}; mcq and exact expect <answer>…</answer>; tool expects
    'Action: … / Action Input: {…}'; code a ```python block (an expression task <answer>…</answer>:
    native_format). Any other of those formats appearing is foreign (e.g. '\\boxed{' in an exact/mcq
    response, '<answer>' in a math one, a ```python block in either). Unknown kinds: none."""
    native = native_format(kind, answer)
    if native is None:
        return []
    return [name for name, rx in FORMATS.items() if name != native and rx.search(text)]


def repetition_loop(text):
    """True when the response is stuck in a loop, by either test:
      consecutive: some unit of 1-40 characters containing a letter or digit occurs >= 4 times
                   back to back, spanning >= LOOP_MIN_SPAN (16) characters ('\\boxed{1}\\boxed{1}…',
                   '1111111111111111', 'the the the the …'); short natural runs ('1111') are not loops;
      4-grams:     a response of >= 32 whitespace words in which >= half of the word 4-grams
                   repeat an earlier 4-gram (loops of long units, e.g. a repeated sentence).
    Only the first LOOP_CHARS characters are examined (bounded time)."""
    text = text[:LOOP_CHARS]
    for m in REPEAT_RE.finditer(text):
        if len(m.group(0)) >= LOOP_MIN_SPAN and any(c.isalnum() for c in m.group(1)):
            return True
    words = text.split()
    if len(words) >= LOOP_MIN_WORDS:
        grams = [tuple(words[i:i + LOOP_NGRAM]) for i in range(len(words) - LOOP_NGRAM + 1)]
        if 1 - len(set(grams)) / len(grams) >= LOOP_DUP_FRAC:
            return True
    return False


def format_artifacts(texts, kinds, lengths, answers=None):
    """Artifact rates over responses (texts[i] answers a task of kind kinds[i] with reference answer
    answers[i] (it tells an expression task from a program one), lengths[i] tokens).

    foreign_format: fraction with another domain's answer format (foreign_formats);
    repetition: fraction stuck in a loop (repetition_loop); empty_answer: fraction that are blank
    or have no extractable final answer (checkers.final_answer); mean_len: mean tokens per response;
    formats: the fraction showing each answer format at all."""
    m = len(texts)
    answers = answers or [None] * m
    if m == 0:
        return {"n": 0, "foreign_format": None, "repetition": None, "empty_answer": None, "mean_len": None, "formats": {}}
    return {
        "n": m,
        "foreign_format": sum(bool(foreign_formats(t, kd, a)) for t, kd, a in zip(texts, kinds, answers)) / m,
        "repetition": sum(repetition_loop(t) for t in texts) / m,
        "empty_answer": sum(checkers.final_answer(kd, t, a) is None for t, kd, a in zip(texts, kinds, answers)) / m,
        "mean_len": sum(lengths) / m,
        "formats": {name: sum(bool(rx.search(t)) for t in texts) / m for name, rx in FORMATS.items()},
    }


def artifacts_of(tokenizer, tasks, texts_per_task):
    """format_artifacts over every response to every task (token lengths from `tokenizer`)."""
    texts = [t for row in texts_per_task for t in row]
    kinds = [task["kind"] for task, row in zip(tasks, texts_per_task) for _ in row]
    answers = [task.get("answer") for task, row in zip(tasks, texts_per_task) for _ in row]
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return format_artifacts(texts, kinds, lengths, answers)


# ----------------------------------------------------------------------------- run folder
def parse_eval_sets(spec, presets):
    """'math,toy/add' -> the preset's sets + ['toy/add'] (order kept, duplicates dropped)."""
    names = []
    for part in (p.strip() for p in spec.split(",")):
        if part:
            names.extend(presets.get(part, [part]))
    return list(dict.fromkeys(names))


def parse_ks(spec, n_samples):
    """'1,4,16' -> [1, 4, 16] restricted to k <= n (and n itself if nothing is left)."""
    try:
        ks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise train.UserError(f"k={spec!r} is not a comma list of integers (e.g. k=1,4,16)") from None
    if any(kk < 1 for kk in ks):
        raise train.UserError(f"k={spec!r}: every k must be >= 1")
    return [kk for kk in ks if kk <= n_samples] or [n_samples]


def snapshot_name(stage_name):
    return stage_name.replace("/", "_").replace("+", "_")


def read_run(path):
    """A training run folder -> {"matrix", "state", "snapshots": [(stage number, stage name, folder)]}.
    Its checkpoint's state is read under the run's checkpoint lock (never between a save's renames)."""
    if not os.path.isdir(path):
        raise train.UserError(f"run_dir {path} is not a folder (point it at a train.py out_dir)")
    run = {"matrix": read_json(os.path.join(path, "accuracy_matrix.json")), "state": None, "snapshots": []}
    if run["matrix"] is not None:
        check_matrix(run["matrix"], os.path.join(path, "accuracy_matrix.json"))
    ckpt = os.path.join(path, "ckpt")
    with checkpoint.reading(ckpt):
        complete = checkpoint.newest_complete(ckpt) or ckpt
        run["state"] = read_json(os.path.join(complete, "trainer", "state.json"))
        run["base_fingerprint"] = saved_base_fingerprint(run["state"], complete)
    stages = (run["matrix"] or {}).get("stages", [])
    for entry in os.listdir(path):
        m = re.fullmatch(r"stage(\d+)_(.+)", entry)
        if m and not entry.endswith(".tmp") and os.path.exists(os.path.join(path, entry, "config.json")):
            # stageN_x.tmp: a snapshot save_snapshot was writing, or had not renamed yet, when the run stopped
            i = int(m.group(1))
            name = stages[i - 1] if i <= len(stages) and snapshot_name(stages[i - 1]) == m.group(2) else m.group(2)
            run["snapshots"].append((i, name, os.path.join(path, entry)))
    run["snapshots"].sort()
    if run["matrix"] is None and run["state"] is None:
        raise train.UserError(f"{path} has neither accuracy_matrix.json nor ckpt/trainer/state.json: is it a train.py out_dir?")
    return run


def saved_base_fingerprint(state, ckpt):
    """models.base_fingerprint of the run's base_init as training began (a LoRA run's: in its adapter's
    metadata), or None (a run from before it was saved, or a damaged one: then not compared)."""
    saved = (state or {}).get("base_fingerprint")
    adapter = os.path.join(ckpt, "adapter", "adapter_model.safetensors")
    if saved is None and os.path.isfile(adapter):
        try:
            saved = checkpoint.adapter_fingerprint(adapter)
        except (OSError, ValueError, RuntimeError):  # a damaged adapter: loading the model says so
            return None
    return saved if checkpoint.is_fingerprint(saved) else None


def read_json(path):
    """A run folder's JSON file (None when absent); damaged or half-written is one line."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise train.UserError(f"{path} is damaged or half-written ({e}): rerun the stage that wrote it, or "
                              "evaluate a checkpoint with --model=") from None
    if not isinstance(obj, dict):
        raise train.UserError(f"{path} holds a {type(obj).__name__}, not train.py's record (a JSON object)")
    return obj


def check_matrix(matrix, path):
    """An accuracy matrix eval.py can print: a list of eval sets, the stage names, one full row of
    numbers per stage (and the base row)."""
    sets, stages, rows = matrix.get("eval_sets"), matrix.get("stages"), matrix.get("rows")
    base = matrix.get("base", {})
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    ok = (isinstance(sets, list) and sets and isinstance(stages, list) and isinstance(rows, list) and len(rows) == len(stages)
          and all(isinstance(r, list) and len(r) == len(sets) and all(map(number, r)) for r in rows)
          and isinstance(base, dict) and all(map(number, base.values())))
    if not ok:
        raise train.UserError(f"{path} is not a well-formed accuracy matrix (one row of {len(sets or [])} numbers per "
                              "stage): it was damaged or written by another program")


REPORT_MARK = "nanoSDPO eval.py"  # every JSON report eval.py writes says so: it overwrites only those


def check_out(out_path):
    """eval.py writes out_path (.json), the markdown beside it and maybe plots: refuse before any
    work unless each is absent or a report eval.py wrote earlier (never a README or a config.json)."""
    if not out_path.endswith(".json"):
        raise train.UserError(f"out={out_path}: eval.py writes a JSON report (and its markdown beside it): give a path "
                              "ending in .json")
    stem = out_path[:-5]
    folder = os.path.dirname(os.path.abspath(out_path))
    existing = folder
    while not os.path.exists(existing):  # the folder is made at the end: its nearest existing ancestor must allow it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise train.UserError(f"out={out_path}: cannot write into {folder} ({existing} is "
                              f"{'not a folder' if not os.path.isdir(existing) else 'not writable'}): give another --out")
    for tmp in (out_path + ".tmp", stem + ".md.tmp", stem + "_matrix.png.tmp", stem + "_drift.png.tmp"):
        if os.path.lexists(tmp) and not os.path.isfile(tmp):
            raise train.UserError(f"out={out_path}: {tmp} (where the report is written first) is not a file: remove it")
    earlier_report = os.path.exists(out_path) and own_report(out_path)  # its plots are its own too
    for path in (out_path, stem + ".md", stem + "_matrix.png", stem + "_drift.png"):
        ours = (earlier_report and os.path.isfile(path)) if path.endswith(".png") else own_report(path)
        if os.path.lexists(path) and not ours:
            raise train.UserError(f"out={out_path}: {path} exists and is not a report eval.py wrote: give another --out "
                                  "(eval.py overwrites only its own reports)")
    return stem


def own_report(path):
    """Absent (nothing to lose), or a report eval.py wrote: its JSON (the mark, or an earlier
    version's keys) or its markdown (the '# eval: ' title)."""
    if not os.path.lexists(path):
        return True
    if not os.path.isfile(path) or os.path.islink(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".md"):
                return f.readline().startswith("# eval: ")
            obj = json.load(f)
    except (OSError, ValueError):
        return False
    earlier_version = {"config", "model", "eval_sets", "ks"}  # its keys, before the mark
    return isinstance(obj, dict) and (obj.get("written_by") == REPORT_MARK or earlier_version <= set(obj))


def load(init, run_cfg, dev):
    """models.load_model with the run's config (needed to rebuild init_from='scratch'); a run's
    checkpoint under its lock (train.py may be saving one), from the complete copy a crash between
    its renames left."""
    if init == "scratch" and not run_cfg:
        raise train.UserError("base_model='scratch' needs run_dir (its config rebuilds the initial weights)")
    with checkpoint.reading(init):
        model, tokenizer = models.load_model(checkpoint.newest_complete(init) or init, dev, scratch=run_cfg or {})
    model.eval()
    return model, tokenizer


def fit_sets(sets, loaded, cfg):
    """Leave out (and count) the prompts that do not fit, before max_new_tokens of response, in the
    context of every model that reads them (the model and the base score the same prompts), as
    train.py does for its own; a model with no room at all is one line."""
    for model, tokenizer in loaded:
        cap = models.prompt_budget(model, cfg["max_new_tokens"])[0]
        for name in sets:
            sets[name] = models.fit_tasks(sets[name], name, tokenizer, cap=cap, enable_thinking=cfg["enable_thinking"],
                                          fix="lower max_new_tokens (or use a model with a longer context)")


# ----------------------------------------------------------------------------- one model's numbers
def sample_with_eval_settings(model, tokenizer, tasks, cfg, autocast, *, n, batch_prompts, seed, progress=False):
    """train.sample_and_score with eval.py's sampling settings: n responses per prompt, on the model's device."""
    dev = next(model.parameters()).device
    with autocast():
        return train.sample_and_score(model, tokenizer, tasks, n=n, temperature=cfg["temperature"], top_p=cfg["top_p"],
                              max_new_tokens=cfg["max_new_tokens"], batch_prompts=batch_prompts,
                              generator=train.make_generator(seed, dev), enable_thinking=cfg["enable_thinking"],
                              progress=progress, static=train.use_static_rollout(cfg["static_rollout"], dev),
                              success_threshold=cfg["success_threshold"], math_checker=cfg["math_checker"])


def accuracy_per_set(model, tokenizer, sets, cfg, ks, autocast, label):
    """Sample n responses per prompt on every set: {set: {"metrics", "texts", "artifacts"}}."""
    res = {}
    for name, tasks in sets.items():
        print(f"{label}: {name} ({len(tasks)} prompts x {cfg['n']} samples)", flush=True)
        r = sample_with_eval_settings(model, tokenizer, tasks, cfg, autocast, n=cfg["n"], batch_prompts=cfg["batch_prompts"],
                                      seed=cfg["seed"], progress=True)
        res[name] = {"metrics": train.accuracy_summary(r["scores"], ks, threshold=cfg["success_threshold"]), "texts": r["texts"],
                     "artifacts": artifacts_of(tokenizer, tasks, r["texts"])}
    return res


def drift_responses(model, tokenizer, drift_sets, cfg, autocast, seed_offset=0):
    """One response per fixed drift prompt, sampled with a generator seeded by cfg['seed']: {set: [text]}."""
    return {name: [row[0] for row in sample_with_eval_settings(model, tokenizer, tasks, cfg, autocast, n=1,
                                                               batch_prompts=max(1, cfg["batch_prompts"] * cfg["n"]),
                                                               seed=cfg["seed"] + seed_offset)["texts"]]
            for name, tasks in drift_sets.items()}


def bandwidth(base_emb, other_emb):
    """RBF σ for a set: the median heuristic over the base responses' embeddings (so every model and
    stage compared with this base uses one kernel), else over both sides pooled, else 1."""
    return median_heuristic(base_emb) or median_heuristic(torch.cat([other_emb, base_emb])) or 1.0


def response_drift(texts, base, drift_sets, dev, cfg, autocast):
    """Per set: MMD² between base-model embeddings of the model's and the base's responses (kernel
    from `bandwidth`), the base's own noise floor (MMD² between two base samples drawn with other
    seeds: the size of the sampling noise at this many prompts between independent samples; the model
    and the base are sampled with the same seed, so an unchanged model scores exactly 0 and the floor
    is a scale to read mmd2 against, not its null distribution), the mean text similarity of paired
    responses and the fraction of identical pairs."""
    per_set = {}
    for name, tasks in drift_sets.items():
        emb = embed_responses(base["model"], base["tokenizer"], [t["messages"] for t in tasks], texts[name], dev,
                              enable_thinking=cfg["enable_thinking"], autocast=autocast)
        sigma = bandwidth(base["drift_emb"][name], emb)
        per_set[name] = {"mmd2": mmd_rbf(emb, base["drift_emb"][name], sigma) if len(tasks) >= 2 else None,
                         "mmd2_floor": base["mmd2_floor"][name], "bandwidth": sigma,
                         "text_similarity": text_similarity(texts[name], base["drift_texts"][name]),
                         "identical": sum(a == b for a, b in zip(texts[name], base["drift_texts"][name])) / len(tasks),
                         "n_prompts": len(tasks)}
    return per_set


def drift_of(model, tokenizer, base, drift_sets, cfg, dev, autocast):
    """Parameter and spectral drift, response drift and artifacts (on the drift responses) of one model vs the base."""
    texts = drift_responses(model, tokenizer, drift_sets, cfg, autocast) if drift_sets else {}
    drift = {"param": param_drift(model.state_dict(), base["state"]) if base else None,
             "spectral": spectral_drift(model.state_dict(), base["state"], cfg["spectral_k"],
                                        base_cache=base.setdefault("spectral_cache", {}))
             if base and cfg["spectral_k"] >= 0 else None,
             "response": response_drift(texts, base, drift_sets, dev, cfg, autocast) if base and drift_sets else {},
             "artifacts": {name: artifacts_of(tokenizer, tasks, [[t] for t in texts[name]])
                           for name, tasks in drift_sets.items()}}
    return drift, texts


# ----------------------------------------------------------------------------- report
def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report):
    """The report as markdown tables."""
    lines = [f"# eval: {report['model']}", "", f"base: {report['base_model'] or '(none)'}; "
             f"n={report['config']['n']}, temperature={report['config']['temperature']}, "
             f"top_p={report['config']['top_p']}, max_new_tokens={report['config']['max_new_tokens']}", ""]
    acc = report["accuracy"]
    if acc:
        keys = list(next(iter(acc.values()))["model"])
        lines += ["## Accuracy (model / base / delta)", "", "Both scored by this eval, with the settings above "
                  "(the accuracy matrix below is train.py's own evals).", "",
                  "| set | prompts | " + " | ".join(keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
        for name, a in list(acc.items()) + [("**average**", report["accuracy_avg"])]:
            cells = [f"{_f(a['model'][kk])} / {_f((a.get('base') or {}).get(kk))} / {_f((a.get('delta') or {}).get(kk))}"
                     for kk in keys]
            lines.append(f"| {name} | {a.get('n_prompts', '')} | " + " | ".join(cells) + " |")
        lines.append("")
    c = report.get("continual")
    if c:
        sets = c["eval_sets"]
        lines += ["## Continual (accuracy matrix: row = after stage, column = eval set)", "",
                  "As train.py scored it during the run (out_dir/accuracy_matrix.json: its eval_n, eval_max_prompts "
                  "and eval sampling): the base row is its iteration-0 eval, another sample than the base above.", "",
                  "| after | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        if c.get("base"):
            lines.append("| base | " + " | ".join(_f(c["base"].get(s)) for s in sets) + " |")
        for i, (stage, row) in enumerate(zip(c["stages"], c["rows"])):
            lines.append(f"| {i + 1}: {stage} | " + " | ".join(_f(v) for v in row) + " |")
        lines.append("| forgetting | " + " | ".join(_f(c["forgetting"].get(s)) for s in sets) + " |")
        lines.append("| max drop | " + " | ".join(_f(c["max_drop"].get(s)) for s in sets) + " |")
        lines += ["", f"average final accuracy {_f(c['avg_final'])} (every set; over the trained sets, GEM's ACC: "
                  f"{_f(c['avg_acc'])}), average forgetting {_f(c['avg_forgetting'])}, "
                  f"BWT {_f(c['bwt'])}, FWT {_f(c['fwt'])}, in-domain gain per stage "
                  + ", ".join(_f(g) for g in c["gain"]), ""]
    d = report.get("drift")
    if d:
        if d.get("param"):
            p = d["param"]
            lines += ["## Parameter drift ‖θ−θ0‖/‖θ0‖", "", "| overall | " + " | ".join(p["by_module"]) + " |",
                      "|---|" + "---|" * len(p["by_module"]),
                      f"| {_f(p['overall'], 4)} | " + " | ".join(_f(v, 4) for v in p["by_module"].values()) + " |", ""]
            if p["by_layer"]:
                lines += ["per layer: " + ", ".join(f"{layer} {_f(v, 4)}" for layer, v in p["by_layer"].items()), ""]
        if (d.get("spectral") or {}).get("overall"):
            sp = d["spectral"]
            lines += [f"## Spectral drift: top-k singular subspaces of each weight matrix vs base "
                      f"(k = {sp['k'] or 'auto'})", "",
                      "NSS = ‖U0ᵀU‖²_F / k (1 = the same top-k subspace, 0 = orthogonal); max angle = the largest "
                      "principal angle (degrees); σ change = ‖σ−σ0‖/‖σ0‖ of the top-k singular values; "
                      "means over matrices (embeddings and LM head excluded)", "",
                      "| module | matrices | k | NSS left | NSS right | max angle left (°) | max angle right (°) | σ change |",
                      "|---|---|---|---|---|---|---|---|"]
            for name, g in [("**overall**", sp["overall"])] + list(sp["by_module"].items()):
                lines.append(f"| {name} | {g['n']} | {'/'.join(map(str, g['k']))} | {_f(g['nss_left'], 5)} | "
                             f"{_f(g['nss_right'], 5)} | {_f(g['max_angle_left'])} | {_f(g['max_angle_right'])} | "
                             f"{_f(g['sv_change'], 4)} |")
            lines.append("")
        if d.get("response"):
            lines += ["## Response drift vs base (fixed prompts, 1 sample each)", "",
                      "| set | prompts | MMD² | MMD² floor (base vs base) | bandwidth | text similarity | identical |",
                      "|---|---|---|---|---|---|---|"]
            for name, r in d["response"].items():
                lines.append(f"| {name} | {r['n_prompts']} | {_f(r['mmd2'], 4)} | {_f(r['mmd2_floor'], 4)} | "
                             f"{_f(r['bandwidth'])} | {_f(r['text_similarity'])} | {_f(r['identical'])} |")
            lines.append("")
        if d.get("artifacts"):
            lines += ["## Format artifacts (model / base; all eval samples)", "",
                      "| set | foreign format | repetition | empty answer | mean len (tokens) |", "|---|---|---|---|---|"]
            for name, a in d["artifacts"].items():
                m, b = a["model"], a.get("base") or {}
                lines.append(f"| {name} | " + " | ".join(f"{_f(m[kk])} / {_f(b.get(kk))}" for kk in
                                                         ("foreign_format", "repetition", "empty_answer"))
                             + f" | {_f(m['mean_len'], 1)} / {_f(b.get('mean_len'), 1)} |")
            lines.append("")
    curve = report.get("stage_drift")
    if curve:
        sets = list(curve[0]["response"] or curve[0]["artifacts"])
        lines += ["## Drift per stage snapshot", "", "| stage | param drift | NSS L/R | max angle L/R (°) | σ change |",
                  "|---|---|---|---|---|"]
        for st in curve:
            sp = (st.get("spectral") or {}).get("overall") or {}
            lines.append(f"| {st['stage']}: {st['name']} | {_f((st['param'] or {}).get('overall'), 4)} | "
                         f"{_f(sp.get('nss_left'), 5)} / {_f(sp.get('nss_right'), 5)} | "
                         f"{_f(sp.get('max_angle_left'))} / {_f(sp.get('max_angle_right'))} | "
                         f"{_f(sp.get('sv_change'), 4)} |")
        # the per-set numbers: one small table per measure (rows: stages, columns: eval sets), not one 5 x sets wide
        for title, part, key, digits in (("response drift MMD² vs base", "response", "mmd2", 4),
                                         ("text similarity to the base's responses", "response", "text_similarity", 3),
                                         ("foreign answer format", "artifacts", "foreign_format", 3),
                                         ("repetition", "artifacts", "repetition", 3),
                                         ("empty answer", "artifacts", "empty_answer", 3)):
            lines += ["", f"{title}:", "", "| stage | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
            lines += [f"| {st['stage']}: {st['name']} | " + " | ".join(_f(st[part].get(s, {}).get(key), digits) for s in sets)
                      + " |" for st in curve]
        lines.append("")
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a UserError saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise train.UserError("plots=True needs matplotlib: pip install matplotlib (or run with --plots=False)") from None
    return plt


def save_png(plt, fig, path):
    """Write fig to path whole or not at all (a temp file, then a rename, as the JSON and markdown)."""
    fig.savefig(path + ".tmp", dpi=120, format="png")
    plt.close(fig)
    os.replace(path + ".tmp", path)
    return path


def write_plots(report, stem):
    """PNG heatmap of the accuracy matrix and drift curves over stages; returns the paths written."""
    plt = pyplot()
    paths = []
    c = report.get("continual")
    if c and c["rows"]:
        labels = (["base"] if c.get("base") else []) + [f"{i + 1}: {s}" for i, s in enumerate(c["stages"])]
        grid = ([[c["base"].get(s, float("nan")) for s in c["eval_sets"]]] if c.get("base") else []) + c["rows"]
        fig, ax = plt.subplots(figsize=(1.2 * len(c["eval_sets"]) + 3, 0.6 * len(labels) + 2))
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(c["eval_sets"])), c["eval_sets"], rotation=30, ha="right")
        ax.set_yticks(range(len(labels)), labels)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k")
        ax.set_xlabel("eval set")
        ax.set_ylabel("after stage")
        fig.colorbar(im, ax=ax, label="accuracy")
        fig.tight_layout()
        paths.append(save_png(plt, fig, stem + "_matrix.png"))
    curve = report.get("stage_drift")
    if curve:
        x = [0] + [st["stage"] for st in curve]
        sets = list(curve[0]["artifacts"])
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        axes[0].plot(x, [0.0] + [(st["param"] or {}).get("overall") or 0.0 for st in curve], marker="o")
        axes[0].set_title("parameter drift ‖θ−θ0‖/‖θ0‖")
        for s in sets:
            line = axes[1].plot(x[1:], [st["response"].get(s, {}).get("mmd2") for st in curve], marker="o", label=s)
            floor = ((report.get("drift") or {}).get("response") or {}).get(s, {}).get("mmd2_floor")
            if floor is not None:
                axes[1].axhline(floor, ls="--", lw=1, color=line[0].get_color())
            base_rate = ((report["drift"] or {}).get("base_drift_artifacts") or {}).get(s, {}).get("foreign_format") or 0.0
            axes[2].plot(x, [base_rate] + [st["artifacts"][s]["foreign_format"] or 0.0 for st in curve], marker="o", label=s)
        axes[1].set_title("response drift (MMD² vs base; dashed: base-vs-base floor)")
        axes[2].set_title("foreign answer format rate")
        for ax in axes:
            ax.set_xlabel("stage (0 = base)")
            ax.set_xticks(x)
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        paths.append(save_png(plt, fig, stem + "_drift.png"))
    return paths


# ----------------------------------------------------------------------------- main
def main(cfg):
    from data.common import EVAL_PRESETS
    from tqdm import tqdm
    check_seed(cfg["seed"])
    if cfg["n"] < 1 or cfg["batch_prompts"] < 1:
        raise train.UserError("n and batch_prompts must be >= 1")
    if cfg["drift_prompts"] == 1 or cfg["drift_prompts"] < 0:
        raise train.UserError(f"drift_prompts={cfg['drift_prompts']}: MMD needs >= 2 prompts (0 = skip response drift)")
    if cfg["spectral_k"] < -1:
        raise train.UserError(f"spectral_k={cfg['spectral_k']}: give k > 0, 0 (auto) or -1 (skip spectral drift)")
    if cfg["max_prompts"] < 0:
        raise train.UserError(f"max_prompts={cfg['max_prompts']}: give the test prompts per set, or 0 for all")
    if cfg["temperature"] <= 0 or not 0 < cfg["top_p"] <= 1:
        raise train.UserError("temperature must be > 0 and top_p in (0, 1]")
    if cfg["dtype"] not in ("auto", "float32", "bfloat16", "float16"):
        raise train.UserError(f"dtype={cfg['dtype']!r} is not one of auto, float32, bfloat16, float16")
    ks = parse_ks(cfg["k"], cfg["n"])
    if cfg["plots"]:
        pyplot()  # fail now, not after the evaluation
    run = read_run(cfg["run_dir"]) if cfg["run_dir"] else None
    state = (run or {}).get("state") or {}
    run_cfg = state.get("config") or {}
    model_path = cfg["model"] or (os.path.join(cfg["run_dir"], "ckpt") if run else "")
    if not model_path:
        raise train.UserError("nothing to evaluate: give --run_dir=<train.py out_dir> or --model=<checkpoint or HF id>")
    # the run's base_init is as train.py was given it: relative to train.py's working directory, which is
    # usually the repository (data.tasks.resolve: from here, else under the repository, else as given)
    base_path = cfg["base_model"] or (task_files.resolve(state["base_init"]) if state.get("base_init") else "")
    if base_path == "none":
        base_path = ""
    if cfg["max_new_tokens"] < 0:
        raise train.UserError(f"max_new_tokens={cfg['max_new_tokens']} must be >= 1 (or 0: the run's, else 2048)")
    if not cfg["max_new_tokens"]:
        cfg["max_new_tokens"] = run_cfg.get("max_new_tokens", 2048)
    # score as the run scored its own evals (a code run's partial rewards, math-verify): else its
    # in-training pass@n and eval.py's would count different samples as solved
    if not 0 <= cfg["success_threshold"] <= 1:  # the value given; a run's own may be 0 (train.py's range is [0, 1])
        raise train.UserError(f"success_threshold={cfg['success_threshold']} is not in [0, 1] (0 = the run's)")
    cfg["success_threshold"] = cfg["success_threshold"] or run_cfg.get("success_threshold", 1.0)
    cfg["math_checker"] = cfg["math_checker"] or run_cfg.get("math_checker", "builtin")
    if cfg["static_rollout"] not in train.CHOICES["static_rollout"]:
        raise train.UserError(f"static_rollout={cfg['static_rollout']!r} is not one of {', '.join(train.CHOICES['static_rollout'])}")
    if cfg["math_checker"] not in train.CHOICES["math_checker"]:
        raise train.UserError(f"math_checker={cfg['math_checker']!r} is not one of {', '.join(train.CHOICES['math_checker'])}")
    if cfg["math_checker"] == "math_verify":
        require("math_verify", "math_checker=math_verify", "math-verify")
    names = parse_eval_sets(cfg["eval_sets"], EVAL_PRESETS) or list(((run or {}).get("matrix") or {}).get("eval_sets", []))
    if not names:
        raise train.UserError("no eval sets: give --eval_sets=a,b or a preset (" + ", ".join(EVAL_PRESETS) + ")")
    sets = {}
    for name in names:
        tasks = train.load_tasks(name, "test", cfg["data_dir"])
        sets[name] = tasks[:cfg["max_prompts"]] if cfg["max_prompts"] > 0 else tasks
    out_path = cfg["out"] or (os.path.join(cfg["run_dir"], "eval.json") if run else "eval.json")
    stem = check_out(out_path)
    dev = runtime.pick_device(cfg["device"])
    autocast = runtime.make_autocast(dev, cfg["dtype"])

    report = {"written_by": REPORT_MARK, "config": cfg, "model": model_path, "base_model": base_path or None, "eval_sets": names, "ks": ks}
    # both models are loaded (and the prompts fitted to both contexts) before anything is scored
    print(f"model: {model_path}", flush=True)
    model, tokenizer = load(model_path, run_cfg, dev)
    if base_path:
        print(f"base model: {base_path}", flush=True)
        try:
            base_model, base_tok = load(base_path, run_cfg, dev)
        except train.UserError as e:
            raise train.UserError(f"base model: {e} (set --base_model=<folder or HF id>, or --base_model=none)") from None
        try:  # parameter drift pairs the two models' tensors: names and shapes now, not after the sampling
            for _ in paired_tensors(model.state_dict(), base_model.state_dict()):
                pass
        except train.UserError as e:
            raise train.UserError(f"base model {base_path}: {e} (give the model training started from as "
                                  "--base_model, or --base_model=none)") from None
        saved = (run or {}).get("base_fingerprint")
        if not cfg["base_model"] and saved and not checkpoint.same_fingerprint(saved, base_model):
            raise train.UserError(f"base model {base_path}, the run's base_init, holds other weights than when the run "
                                  "began (it changed since): restore it, give the model training started from as "
                                  "--base_model, or --base_model=none")
    fit_sets(sets, [(model, tokenizer)] + ([(base_model, base_tok)] if base_path else []), cfg)
    drift_sets = {name: tasks[:cfg["drift_prompts"]] for name, tasks in sets.items()} if cfg["drift_prompts"] else {}
    # the base model first: it embeds every response for response drift
    base = None
    base_scores = {}
    if base_path:
        base_scores = accuracy_per_set(base_model, base_tok, sets, cfg, ks, autocast, "base")
        base = {"model": base_model, "tokenizer": base_tok, "state": base_model.state_dict(),
                "drift_texts": drift_responses(base_model, base_tok, drift_sets, cfg, autocast), "drift_emb": {},
                "mmd2_floor": {}}
        floor_a = drift_responses(base_model, base_tok, drift_sets, cfg, autocast, seed_offset=1)
        floor_b = drift_responses(base_model, base_tok, drift_sets, cfg, autocast, seed_offset=2)
        for name, tasks in drift_sets.items():
            emb = [embed_responses(base_model, base_tok, [t["messages"] for t in tasks], responses[name], dev,
                                   enable_thinking=cfg["enable_thinking"], autocast=autocast)
                   for responses in (base["drift_texts"], floor_a, floor_b)]
            base["drift_emb"][name] = emb[0]
            base["mmd2_floor"][name] = mmd_rbf(emb[1], emb[2], bandwidth(emb[0], emb[1])) if len(tasks) >= 2 else None
    scores = accuracy_per_set(model, tokenizer, sets, cfg, ks, autocast, "model")

    report["accuracy"] = {name: {"n_prompts": len(sets[name]), "model": scores[name]["metrics"],
                                 "base": base_scores[name]["metrics"] if base else None,
                                 "delta": delta(scores[name]["metrics"], base_scores[name]["metrics"]) if base else None}
                          for name in names}
    avg = {who: {key: _mean([report["accuracy"][s][who][key] for s in names]) for key in scores[names[0]]["metrics"]}
           for who in (("model", "base") if base else ("model",))}
    report["accuracy_avg"] = {"model": avg["model"], "base": avg.get("base"),
                              "delta": delta(avg["model"], avg["base"]) if base else None}
    matrix = (run or {}).get("matrix")
    report["continual"] = {**matrix, **continual_metrics(matrix)} if matrix and matrix.get("rows") else None

    drift, texts = drift_of(model, tokenizer, base, drift_sets, cfg, dev, autocast)
    drift["drift_artifacts"] = drift.pop("artifacts")  # on the drift responses: comparable with stage_drift's
    drift["artifacts"] = {name: {"model": scores[name]["artifacts"], "base": base_scores[name]["artifacts"] if base else None}
                          for name in names}  # on every eval sample
    if base:
        drift["base_drift_artifacts"] = {name: artifacts_of(base["tokenizer"], tasks, [[t] for t in base["drift_texts"][name]])
                                         for name, tasks in drift_sets.items()}
    drift["examples"] = {name: [{"prompt": tasks[i]["messages"][-1]["content"], "model": texts[name][i],
                                 "base": base["drift_texts"][name][i] if base else None}
                                for i in range(min(3, len(tasks)))] for name, tasks in drift_sets.items()}
    report["drift"] = drift
    del model

    report["stage_drift"] = []
    if run and cfg["stage_drift"] and run["snapshots"]:
        for i, name, path in tqdm(run["snapshots"], desc="stage snapshots"):
            snap, snap_tok = load(path, run_cfg, dev)
            d, _ = drift_of(snap, snap_tok, base, drift_sets, cfg, dev, autocast)
            report["stage_drift"].append({"stage": i, "name": name, "path": path, **d})
            del snap

    md = markdown(report)
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    if cfg["plots"]:
        report["plots"] = write_plots(report, stem)
    for path, write in ((out_path, lambda f: json.dump(report, f, indent=1, default=float)),
                        (stem + ".md", lambda f: f.write(md + "\n"))):
        with open(path + ".tmp", "w") as f:  # each file whole or the earlier one: never half-written
            write(f)
        os.replace(path + ".tmp", path)
    print(f"wrote {out_path} and {stem}.md" + "".join(f" and {p}" for p in report.get("plots", [])))


if __name__ == "__main__":
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except train.UserError as e:
        sys.exit(f"error: {e}")
