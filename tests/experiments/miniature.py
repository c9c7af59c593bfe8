"""
The paper in miniature, as statistics: continual post-training on the toy suite, every arm run on
the same (paired) seeds, every number a mean over seeds with its spread, and a verdict only where
a paired difference is larger than its spread.

    python tests/experiments/miniature.py --experiment=main --seeds=1-8 --jobs=2          # GRPO vs SDPO d=1/0.5/0.25
    python tests/experiments/miniature.py --experiment=distance --seeds=1-8 --jobs=2      # add, then a near/mid/far domain
    python tests/experiments/miniature.py --experiment=teacher --seeds=1-8 --jobs=2       # frozen / EMA / trust-region teacher
    python tests/experiments/miniature.py --experiment=feedback --seeds=1-8 --jobs=2      # toy/func: SDPO with / without feedback, GRPO
    python tests/experiments/miniature.py --arms=grpo --seeds=1-8 --ref=none              # any arms, no comparison

Each (arm, seed) is one `train.py` run and one `eval.py` run into out_root/<arm>_s<seed>/, at one
torch thread (OMP_NUM_THREADS=1: deterministic for a given seed), `--jobs` at a time; a run whose
eval.json (or `done` marker) exists is read, not rerun. Every arm is one entry of ARMS (config
file, overrides, the reference arm it is compared with seed by seed, whether eval.py runs, or a
view of the first stages of another arm's runs). Output: per experiment, a table
of mean ± standard error [bootstrap 95 % interval] per arm and metric, a table of paired
differences against the reference arm with a verdict, then a JSON last line.

Statistics (pure functions below, tested in tests/test_miniature_stats.py):
  mean ± SE           SE = sample standard deviation / sqrt(n)
  bootstrap interval  percentile bootstrap of the mean over seeds (10 000 resamples, fixed seed)
  paired difference   per seed arm − reference, its mean ± SE, its bootstrap interval and its t interval
  verdict             "A > B" / "A < B" only when *both* 95 % intervals of the paired difference
                      exclude 0 (with 8 seeds the percentile bootstrap is the narrower of the two and
                      under-covers; the t interval guards it), else "no difference resolved"
  collapse            a 0/1 per run (COLLAPSE_ACC below), shown as a rate k/n with a Wilson 95 % interval;
                      its paired comparison is the same bootstrap and t interval, and its verdict also
                      needs McNemar's exact p < 0.05 (with 8 seeds: at least 6 discordant pairs, all
                      one way)
Needs the toy base: python data/toy/prepare.py && python train.py config/toy_base.py
(the feedback experiment: the code toy base, python train.py config/toy_base_code.py)
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
from eval import continual_metrics  # noqa: E402  (forgetting, BWT, gains: one definition)
G, S = "config/continual_toy_grpo.py", "config/continual_toy_sdpo.py"


def arm(config, *overrides, ref=None, evaluate=True, view=None):
    """An arm: train.py on `config` with `overrides`, compared seed by seed with arm `ref`.
    evaluate=False: no eval.py run (only train.py's accuracy matrix and log: no drift or format
    numbers). view=(arm, n): no run of its own, the first n stages of that arm's run (train.py at
    one thread is deterministic, and a run's first stages do not depend on the stages after them)."""
    return {"config": config, "overrides": list(overrides), "ref": ref, "evaluate": evaluate, "view": view}


DIST = "--stages=toy/add:30,toy/{}:30"  # the distance experiment: add, then one more domain
# the feedback experiment: one stage on the toy code domain func from the base that learned it
# (config/toy_base_code.py), scored on func alone; the sandbox's feedback ("f(4) gave 8, expected 9")
# reaches the teacher only with --use_feedback=True, and then only for rows without a successful peer.
# 10 iterations, not the other experiments' 30: on the shared 2-core machine an iteration on func took
# ~20 s (half of it the sandbox scoring 128 programs, other jobs running), so 24 runs at 30 would not
# have finished in the time there was (RESULTS.md)
FUNC_ITERS = 10
FUNC = ("--init_from=out/toy_base_code/ckpt", f"--stages=toy/func:{FUNC_ITERS}", "--eval_sets=toy/func")
ARMS = {
    # main: GRPO vs SDPO at three supervision densities (EMA teacher, tau 0.05)
    "grpo": arm(G),
    # stability (RESULTS.md, "Why lr 1e-4"): GRPO at the lr the miniature was first built with
    "grpo_lr3e-4": arm(G, "--learning_rate=3e-4"),
    "sdpo": arm(S, ref="grpo"),
    "sdpo_d0.5": arm(S, "--density=0.5", ref="grpo"),
    "sdpo_d0.25": arm(S, "--density=0.25", ref="grpo"),
    # teacher stability: stable teachers (frozen, slow EMA, trust region) against the fast EMA (tau 0.05)
    "sdpo_frozen": arm(S, "--teacher=frozen", ref="sdpo"),
    "sdpo_ema0.01": arm(S, "--teacher_rate=0.01", ref="sdpo"),
    "sdpo_tr0.05": arm(S, "--teacher=trust_region", "--teacher_rate=0.05", ref="sdpo"),
    # domain distance from add: near (sub, same format, sibling skill), intermediate (mul: the main
    # runs' first two stages), far (sort: strings, another format); SDPO vs GRPO at each distance
    "grpo_near": arm(G, DIST.format("sub"), evaluate=False),
    "sdpo_near": arm(S, DIST.format("sub"), ref="grpo_near", evaluate=False),
    "grpo_mid": arm(G, view=("grpo", 2)),
    "sdpo_mid": arm(S, ref="grpo_mid", view=("sdpo", 2)),
    "grpo_far": arm(G, DIST.format("sort"), evaluate=False),
    "sdpo_far": arm(S, DIST.format("sort"), ref="grpo_far", evaluate=False),
    # which tokens get the teacher at the same expected fraction (vs random at that density)
    "sdpo_d0.25_disagree": arm(S, "--density=0.25", "--density_select=disagree", ref="sdpo_d0.25"),
    "sdpo_d0.25_last": arm(S, "--density=0.25", "--density_select=last", ref="sdpo_d0.25"),
    "sdpo_d0.5_disagree": arm(S, "--density=0.5", "--density_select=disagree", ref="sdpo_d0.5"),
    "sdpo_d0.5_last": arm(S, "--density=0.5", "--density_select=last", ref="sdpo_d0.5"),
    # normalisation: TRL's seq-mean (step shrinks with the fraction that has a peer) vs token-mean
    "sdpo_seqmean": arm(S, "--distill_agg=seq-mean", ref="sdpo"),
    # rich feedback (the SDPO paper's code setting) on toy/func: the teacher of a row whose group has no
    # success reads its own attempt's failing point, vs no teacher for that row, vs GRPO
    "grpo_func": arm(G, *FUNC, evaluate=False),
    "sdpo_func": arm(S, *FUNC, ref="grpo_func", evaluate=False),
    "sdpo_func_feedback": arm(S, *FUNC, "--use_feedback=True", "--feedback_only_without_solution=True",
                              ref="sdpo_func", evaluate=False),
}
EXPERIMENTS = {
    "main": ["grpo", "sdpo", "sdpo_d0.5", "sdpo_d0.25"],
    "stability": ["grpo", "grpo_lr3e-4"],
    "teacher": ["sdpo", "sdpo_frozen", "sdpo_ema0.01", "sdpo_tr0.05", "grpo"],
    "distance": ["grpo_near", "sdpo_near", "grpo_mid", "sdpo_mid", "grpo_far", "sdpo_far"],
    "select": ["grpo", "sdpo", "sdpo_d0.25", "sdpo_d0.25_disagree", "sdpo_d0.25_last"],
    "select0.5": ["grpo", "sdpo", "sdpo_d0.5", "sdpo_d0.5_disagree", "sdpo_d0.5_last"],
    "norm": ["grpo", "sdpo", "sdpo_seqmean"],
    "feedback": ["sdpo_func_feedback", "sdpo_func", "grpo_func"],
}
# linear contrasts over arms, per seed (metric, {arm: coefficient}): where in distance the forgetting is
# largest, for each algorithm, and where SDPO's excess over GRPO is largest
CONTRASTS = {"feedback": [  # the feedback arm against GRPO (its reference is SDPO without feedback)
    ("first_acc", {"sdpo_func_feedback": 1, "grpo_func": -1}), ("first_gain", {"sdpo_func_feedback": 1, "grpo_func": -1}),
], "distance": [
    ("forgetting", {"grpo_mid": 1, "grpo_near": -1}), ("forgetting", {"grpo_mid": 1, "grpo_far": -1}),
    ("forgetting", {"sdpo_mid": 1, "sdpo_near": -1}), ("forgetting", {"sdpo_mid": 1, "sdpo_far": -1}),
    ("forgetting", {"sdpo_mid": 1, "grpo_mid": -1, "sdpo_near": -1, "grpo_near": 1}),
    ("forgetting", {"sdpo_mid": 1, "grpo_mid": -1, "sdpo_far": -1, "grpo_far": 1}),
]}
# A run collapses when a domain it trained on in an earlier stage ends below COLLAPSE_ACC mean@4
# (the toy base holds every domain at 0.11-0.50, RESULTS.md "Toy base": below 0.05 is most of it gone).
COLLAPSE_ACC = 0.05
# (key, label); every metric is a number per run (None where undefined)
METRICS = [
    ("first_acc", "first stage's domain after its stage"),
    ("first_gain", "first stage's in-domain gain"),
    ("first_reward", "first stage's mean training reward"),
    ("first_mid_acc", "first stage's domain part-way (eval_interval)"),
    ("gain2", "second stage's in-domain gain"),
    ("gain3", "third stage's in-domain gain"),
    ("add", "final add"), ("sub", "final sub"), ("mul", "final mul"), ("sort", "final sort"), ("rev", "final rev"),
    ("avg_final", "average final accuracy"),
    ("avg_acc", "average final accuracy, trained sets (GEM's ACC)"),
    ("forgetting", "average forgetting"),
    ("bwt", "BWT"),
    ("collapse", f"collapse (an earlier domain < {COLLAPSE_ACC})"),
    ("foreign_format", "foreign answer format rate"),
    ("no_answer", "no extractable answer rate"),
    ("response_mmd2", "response drift MMD²"),
    ("param_drift", "parameter drift ‖θ−θ0‖/‖θ0‖"),
    ("spectral_nss", "spectral drift: subspace similarity NSS"),
    ("spectral_angle", "spectral drift: largest principal angle (°)"),
]
BINARY = {"collapse"}


# ----------------------------------------------------------------------------- statistics (pure)
def _clean(xs):
    return [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def mean_se(xs):
    """(mean, standard error = sample sd / sqrt(n)); SE is nan for n < 2, both nan for n = 0."""
    xs = _clean(xs)
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def bootstrap_ci(xs, level=0.95, n_boot=10_000, seed=0):
    """Percentile bootstrap interval of the mean of xs: (lo, hi). A fixed seed makes it reproducible."""
    xs = np.asarray(_clean(xs), dtype=float)
    if xs.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = xs[rng.integers(0, xs.size, size=(n_boot, xs.size))].mean(axis=1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def t_abs_cdf(t, df):
    """P(|T| < t) for Student's t with integer df >= 1 (the closed-form finite series)."""
    th = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(th) ** 2, math.sin(th)
    if df % 2:  # odd
        term, acc = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        return (2 / math.pi) * (th + (s * math.cos(th) * acc if df > 1 else 0.0))
    term, acc = 1.0, 1.0
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        acc += term
    return s * acc


def t_quantile(p, df):
    """Student t quantile for p > 0.5 and integer df >= 1 (bisection on t_abs_cdf)."""
    target, lo, hi = 2 * p - 1, 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_abs_cdf(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def t_ci(xs, level=0.95):
    """mean ± t_{n-1} · SE: (lo, hi); nan for n < 2."""
    m, se = mean_se(xs)
    n = len(_clean(xs))
    if n < 2:
        return math.nan, math.nan
    h = t_quantile(1 - (1 - level) / 2, n - 1) * se
    return m - h, m + h


def wilson(k, n, level=0.95):
    """Wilson score interval of a rate k/n: (lo, hi)."""
    if n == 0:
        return math.nan, math.nan
    z = statistics.NormalDist().inv_cdf(1 - (1 - level) / 2)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def mcnemar_exact(a, b):
    """Two-sided exact McNemar p for paired 0/1 outcomes a, b (binomial on the discordant pairs)."""
    n10 = sum(1 for x, y in zip(a, b) if x and not y)
    n01 = sum(1 for x, y in zip(a, b) if y and not x)
    n = n10 + n01
    if n == 0:
        return 1.0
    k = min(n10, n01)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def paired_diff(a, b, level=0.95, seed=0):
    """Per-pair differences a_i − b_i (pairs with a missing side dropped): {n, mean, se, ci (bootstrap), t_ci}."""
    # rounded to 1e-12: equal scores summed in another order differ in their last bits, and eight equal
    # tiny differences would give zero-width intervals that exclude 0 (a verdict from float noise)
    d = [round(x - y, 12) for x, y in zip(a, b) if _clean([x]) and _clean([y])]
    m, se = mean_se(d)
    return {"n": len(d), "mean": m, "se": se, "ci": bootstrap_ci(d, level, seed=seed), "t_ci": t_ci(d, level)}


def verdict(diff, name, ref):
    """'name > ref' / 'name < ref' when both intervals of the paired difference exclude 0, else
    'no difference resolved'."""
    lo = min(diff["ci"][0], diff["t_ci"][0])  # > 0 only when both lower bounds are
    hi = max(diff["ci"][1], diff["t_ci"][1])
    if any(math.isnan(x) for x in (*diff["ci"], *diff["t_ci"])):
        return "no difference resolved"
    if lo > 0:
        return f"{name} > {ref}"
    if hi < 0:
        return f"{name} < {ref}"
    return "no difference resolved"


def summarize(values, binary=False):
    """One arm's metric over seeds: {n, mean, se, ci} (+ k and a Wilson interval for a 0/1 metric)."""
    xs = _clean(values)
    m, se = mean_se(xs)
    out = {"n": len(xs), "mean": m, "se": se, "ci": bootstrap_ci(xs)}
    if binary and xs:
        out.update(k=int(sum(xs)), wilson=wilson(int(sum(xs)), len(xs)))
    return out


# ----------------------------------------------------------------------------- one run's numbers
def _domain(name):
    return name.split("/")[-1]


def spectral_figures(group):
    """eval.py's spectral drift of one group of matrices (its "overall" or a by_module entry) as two
    numbers: nss, the mean of nss_left and nss_right (1 = the top-k subspaces did not rotate), and
    angle, the mean of max_angle_left and max_angle_right (the largest principal angle, degrees)."""
    return {"nss": (group["nss_left"] + group["nss_right"]) / 2,
            "angle": (group["max_angle_left"] + group["max_angle_right"]) / 2}


def run_metrics(out_dir, n_stages=None):
    """The numbers of one finished run (train.py's accuracy_matrix.json and log.jsonl, eval.py's eval.json
    when there is one), or of its first n_stages stages (then without eval.py's numbers)."""
    d = None
    if n_stages is None and os.path.exists(os.path.join(out_dir, "eval.json")):
        with open(os.path.join(out_dir, "eval.json")) as f:
            d = json.load(f)["drift"]
    with open(os.path.join(out_dir, "accuracy_matrix.json")) as f:
        c = json.load(f)
    if n_stages is not None:
        if len(c["rows"]) < n_stages:
            raise ValueError(f"{out_dir}: {len(c['rows'])} stages in accuracy_matrix.json, the view needs {n_stages}")
        c = dict(c, stages=c["stages"][:n_stages], rows=c["rows"][:n_stages])
    c = {**c, **continual_metrics(c)}
    sets, rows = c["eval_sets"], c["rows"]
    final = dict(zip(sets, rows[-1]))
    first = c["stages"][0]
    if first not in sets:  # a mixed first stage ('a+b') has no one domain for first_acc and first_mid_acc
        raise ValueError(f"{out_dir}: the first stage {first!r} is not one of the eval sets: the miniature's "
                         "first-stage metrics need a first stage of one domain that is evaluated")
    j = sets.index(first)
    earlier = {s for stage in c["stages"][:-1] for s in stage.split("+") if s in sets}
    log = []
    if os.path.exists(os.path.join(out_dir, "log.jsonl")):
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            log = [json.loads(line) for line in f]
    rewards = [x["reward"] for x in log if x.get("stage") == first and "reward" in x]
    first_iters = max([x["iter"] for x in log if x.get("stage") == first and "reward" in x] or [0])
    mid_key = f"eval/{first}/mean@"  # train.score_and_log_eval_sets's record: {"iter", "eval_tag", "eval/<set>/mean@n", ...}
    periodic = [x for x in log if x.get("eval_tag") == "periodic" and x["iter"] <= first_iters]
    mmd = [v["mmd2"] for v in d["response"].values() if v.get("mmd2") is not None] if d else []
    leak = [v["model"]["foreign_format"] for v in d["artifacts"].values()] if d else []
    empty = [v["model"]["empty_answer"] for v in d["artifacts"].values()] if d else []
    spectral = spectral_figures(d["spectral"]["overall"]) if d and d.get("spectral") else {"nss": None, "angle": None}
    out = {
        "first_acc": rows[0][j], "first_gain": c["gain"][0], "first_reward": statistics.fmean(rewards) if rewards else None,
        "first_mid_acc": next((x[k] for x in sorted(periodic, key=lambda x: abs(2 * x["iter"] - first_iters))
                               for k in x if k.startswith(mid_key)), None),  # the eval nearest the stage's middle
        "gain2": c["gain"][1] if len(c["gain"]) > 1 else None, "gain3": c["gain"][2] if len(c["gain"]) > 2 else None,
        **{_domain(s): final[s] for s in sets},
        "avg_final": c["avg_final"], "avg_acc": c["avg_acc"], "forgetting": c["avg_forgetting"], "bwt": c["bwt"],
        "collapse": float(any(final[s] < COLLAPSE_ACC for s in earlier)) if earlier else None,
        "foreign_format": sum(leak) / len(leak) if leak else None,
        "no_answer": sum(empty) / len(empty) if empty else None,
        "response_mmd2": sum(mmd) / len(mmd) if mmd else None,
        "param_drift": d["param"]["overall"] if d else None, "spectral_nss": spectral["nss"],
        "spectral_angle": spectral["angle"],
        "mmd2_floor": max((v.get("mmd2_floor") or 0.0) for v in d["response"].values()) if d and d["response"] else None,
    }
    return out


_LOCKS, _LOCKS_LOCK = {}, threading.Lock()


def run_dir(name, seed, out_root):
    return os.path.join(out_root, f"{name}_s{seed}")


def run_one(name, seed, out_root):
    """Train (and unless the arm says otherwise, evaluate) one (arm, seed) unless its `done` marker
    or eval.json exists; returns (run folder, n_stages or None). A view runs its source arm."""
    a = ARMS[name]
    if a["view"]:
        return run_one(a["view"][0], seed, out_root)[0], a["view"][1]
    out = run_dir(name, seed, out_root)
    full = os.path.join(ROOT, out)
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(full, threading.Lock())
    with lock:  # a view and its source never run the same folder twice at once
        _run_locked(a, seed, out, full)
    return out, None


def finished(full):
    """run_one's test: train.py (and eval.py, for an arm that runs it) finished in this folder."""
    return os.path.exists(os.path.join(full, "done")) or os.path.exists(os.path.join(full, "eval.json"))


def _run_locked(a, seed, out, full):
    if not finished(full):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        os.makedirs(full, exist_ok=True)
        cmds = [[sys.executable, "train.py", a["config"], *a["overrides"], f"--seed={seed}", f"--out_dir={out}"]]
        if a["evaluate"]:
            cmds.append([sys.executable, "eval.py", f"--run_dir={out}", "--n=4", "--k=1,4", "--max_prompts=100",
                         "--drift_prompts=64", "--stage_drift=False", f"--seed={seed}"])
        if os.path.exists(os.path.join(full, "trained")):  # train.py finished earlier; eval.py did not
            cmds = cmds[1:]
        else:  # a train.py that crashed or was killed left its outputs here: train again from the start
            cmds[0].append("--overwrite=True")  # (train.py refuses an out_dir holding an earlier run's files)
        with open(os.path.join(full, "run.out"), "a") as log:
            for cmd in cmds:
                print("+", " ".join(cmd), flush=True)
                log.write("+ " + " ".join(cmd) + "\n")
                log.flush()
                subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
                if cmd[1] == "train.py":
                    open(os.path.join(full, "trained"), "w").close()
        open(os.path.join(full, "done"), "w").close()


# ----------------------------------------------------------------------------- report
def parse_seeds(spec):
    """'1-8' or '1,2,5' or '1-4,9' -> [ints]."""
    seeds = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        seeds += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return seeds


def _f(x, digits=3):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _n_note(got, n):
    return f" (n={got})" if n is not None and got < n else ""


def cell(s, digits=3, n=None):
    """n: the seeds the table names; a cell over fewer (a missing value) says how many."""
    if "wilson" in s:
        return f"{s['k']}/{s['n']} [{_f(s['wilson'][0], 2)}, {_f(s['wilson'][1], 2)}]"
    if not s["n"]:
        return "–"
    return (f"{_f(s['mean'], digits)} ± {_f(s['se'], digits)} [{_f(s['ci'][0], digits)}, {_f(s['ci'][1], digits)}]"
            + _n_note(s["n"], n))


def diff_cell(d, digits=3, n=None):
    """A paired difference: mean ± SE [bootstrap 95 %] [t 95 %] (and its number of pairs when below n)."""
    return (f"{_f(d['mean'], digits)} ± {_f(d['se'], digits)} [{_f(d['ci'][0], digits)}, {_f(d['ci'][1], digits)}] "
            f"[{_f(d['t_ci'][0], digits)}, {_f(d['t_ci'][1], digits)}]" + _n_note(d["n"], n))


def report(arms, seeds, per_run, ref_override=None):
    """Tables (markdown lines) and a JSON-able summary for `arms` over `seeds`."""
    metrics = [(k, label) for k, label in METRICS
               if any(per_run[(a, s)].get(k) is not None for a in arms for s in seeds)]
    summary = {a: {k: summarize([per_run[(a, s)].get(k) for s in seeds], k in BINARY) for k, _ in metrics} for a in arms}
    digits = {k: (4 if k in ("response_mmd2", "param_drift", "spectral_nss") else 3) for k, _ in metrics}
    lines = [f"mean ± SE [bootstrap 95 %] over {len(seeds)} paired seeds ({','.join(map(str, seeds))}); "
             "collapse: count/n [Wilson 95 %]", "",
             "| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for k, label in metrics:
        lines.append(f"| {label} | " + " | ".join(cell(summary[a][k], digits[k], len(seeds)) for a in arms) + " |")
    comparisons = []
    for a in arms:
        ref = ARMS[a]["ref"] if ref_override is None else (None if ref_override in ("none", a) else ref_override)
        if ref is None or ref not in arms:
            continue
        for k, label in metrics:
            x = [per_run[(a, s)].get(k) for s in seeds]
            y = [per_run[(ref, s)].get(k) for s in seeds]
            dd = paired_diff(x, y)
            if dd["n"] == 0:
                continue
            row = {"arm": a, "ref": ref, "metric": k, **dd, "verdict": verdict(dd, a, ref)}
            if k in BINARY:  # 0/1 outcomes: the intervals of a mean of 8 zeros and ones are too optimistic
                pairs = [(u, v) for u, v in zip(x, y) if _clean([u]) and _clean([v])]  # paired_diff's pairs
                row["mcnemar_p"] = mcnemar_exact([u == 1.0 for u, _ in pairs], [v == 1.0 for _, v in pairs])
                if row["mcnemar_p"] >= 0.05:
                    row["verdict"] = "no difference resolved"
            comparisons.append(row)
    if comparisons:
        lines += ["", "paired difference (arm − reference, per seed): mean ± SE [bootstrap 95 %] [t 95 %]; verdict only "
                  "when both intervals exclude 0", "",
                  "| arm − reference | metric | difference | verdict |", "|---|---|---|---|"]
        labels = dict(metrics)
        for row in comparisons:
            dg = digits[row["metric"]]
            extra = f"; McNemar p {row['mcnemar_p']:.3f}" if "mcnemar_p" in row else ""
            lines.append(f"| {row['arm']} − {row['ref']} | {labels[row['metric']]} | {diff_cell(row, dg, len(seeds))}{extra} | {row['verdict']} |")
    return lines, {"summary": summary, "comparisons": comparisons}


def contrast_label(coefs):
    if len(coefs) == 4:  # {a1: 1, b1: -1, a2: -1, b2: 1}: a difference of two paired differences
        a1, b1, a2, b2 = coefs
        return f"({a1} − {b1}) − ({a2} − {b2})"
    pos = " + ".join(a for a, c in coefs.items() if c > 0)
    neg = " − ".join(a for a, c in coefs.items() if c < 0)
    return f"{pos} − {neg}"


def contrasts(name, seeds, per_run):
    """Linear contrasts Σ coef·value per seed (CONTRASTS[name]), their mean, intervals and verdict."""
    lines, out = [], []
    for k, coefs in CONTRASTS.get(name, []):
        if not all((a, s) in per_run for a in coefs for s in seeds):
            continue
        vals = [sum(c * per_run[(a, s)][k] for a, c in coefs.items()) for s in seeds]
        dd = paired_diff(vals, [0.0] * len(vals))
        label = contrast_label(coefs)
        v = verdict(dd, "contrast", "0").replace("contrast > 0", "> 0").replace("contrast < 0", "< 0")
        out.append({"metric": k, "contrast": label, "coefs": coefs, **dd, "verdict": v})
        lines.append(f"| {label} | {k} | {diff_cell(dd)} | {v} |")
    if lines:
        lines = ["", "contrasts (per seed, then over seeds): mean ± SE [bootstrap 95 %] [t 95 %]", "",
                 "| contrast | metric | value | verdict |", "|---|---|---|---|"] + lines
    return lines, out


def per_seed_table(arms, seeds, per_run, keys=("first_acc", "avg_final", "forgetting", "collapse", "foreign_format")):
    lines = ["", "per seed: " + ", ".join(keys), "", "| arm | " + " | ".join(f"s{s}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for a in arms:
        lines.append(f"| {a} | " + " | ".join(" / ".join(_f(per_run[(a, s)].get(k), 2) for k in keys) for s in seeds) + " |")
    return lines


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="main", choices=list(EXPERIMENTS), help="ignored with --arms")
    p.add_argument("--arms", default="", help="comma list of ARMS names (default: the experiment's)")
    p.add_argument("--seeds", default="1-8", help="'1-8', '1,2,3'")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (each at one torch thread)")
    p.add_argument("--out_root", default="out/miniature")
    p.add_argument("--ref", default=None, help="compare every arm with this arm instead of ARMS' reference ('none': no comparison)")
    p.add_argument("--per_seed", action="store_true", help="also print a per-seed table")
    p.add_argument("--no_run", action="store_true", help="only read finished runs (missing ones are an error)")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a] or EXPERIMENTS[args.experiment]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        sys.exit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    seeds = parse_seeds(args.seeds)
    todo = [(a, s) for s in seeds for a in arms]  # seed-major: a half-finished sweep is still paired
    if args.no_run:
        dirs = {(a, s): ((run_dir(ARMS[a]["view"][0], s, args.out_root), ARMS[a]["view"][1]) if ARMS[a]["view"]
                         else (run_dir(a, s, args.out_root), None)) for a, s in todo}
        missing = sorted({d for d, _ in dirs.values() if not finished(os.path.join(ROOT, d))})
        if missing:
            sys.exit(f"--no_run: no finished run in {', '.join(missing)}; run without --no_run first")
    else:  # views last: their source runs are then done or running
        order = sorted(todo, key=lambda t: bool(ARMS[t[0]]["view"]))
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            dirs = dict(zip(order, pool.map(lambda t: run_one(t[0], t[1], args.out_root), order)))
    per_run = {t: run_metrics(os.path.join(ROOT, d), n) for t, (d, n) in dirs.items()}
    lines, out = report(arms, seeds, per_run, args.ref)
    cl, cout = contrasts(args.experiment if not args.arms else "", seeds, per_run)
    lines += cl
    if args.per_seed:
        lines += per_seed_table(arms, seeds, per_run)
    print("\n".join(lines))
    print(json.dumps({"arms": arms, "seeds": seeds, **out, "contrasts": cout,
                      "runs": [{"arm": a, "seed": s, **per_run[(a, s)]} for a, s in todo]}))
