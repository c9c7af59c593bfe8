"""
Why SDPO's early gain on toy/sort fades: the single-domain sort runs (config/sdpo_toy.py and
config/grpo_toy.py, 60 iterations at their lr 3e-4, an eval every 10 iterations) on paired seeds,
with one arm per suspect:

    sdpo           the EMA teacher (tau 0.05): the configs as they are
    sdpo_frozen    --teacher=frozen: a teacher that cannot lose the demonstration skill by following the student
    sdpo_seqmean   --distill_agg=seq-mean: the step shrinks with the fraction of responses that have a peer
    grpo           the reward-only baseline

    python tests/experiments/sort_fade.py --seeds=1-8 --jobs=2                 # run (or read) and report
    python tests/experiments/sort_fade.py --seeds=1-8 --no_run                 # only read finished runs

Each run is `train.py <config> --eval_interval=10 --stop_on_collapse=False --seed=S
--out_dir=out/fade/<arm>_s<S>` at one torch thread (the miniature's statistics and verdict rule:
tests/experiments/miniature.py). From each run's log.jsonl: the student's mean@4 at every eval, the teacher's
teacher_mean@4 (the teacher reading each eval prompt with the reference solution as its
demonstration: SDPO arms), and per 10-iteration window the mean peer_frac, reward and
sampled_logratio(_ok, _failed). Per run: peak = the best eval after iteration 0, fade = peak − final, gain10 = eval@10 − start,
net = final − start, early = eval@20 − start; teacher_drop = teacher@0 − teacher@60;
*_late: the mean over the second half of the iterations (31-60).
"""
import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
from tests.experiments import miniature as mini  # noqa: E402

COMMON = ["--eval_interval=10", "--stop_on_collapse=False"]
ARMS = {
    "sdpo": ("config/sdpo_toy.py", []),
    "sdpo_frozen": ("config/sdpo_toy.py", ["--teacher=frozen"]),
    "sdpo_seqmean": ("config/sdpo_toy.py", ["--distill_agg=seq-mean"]),
    "grpo": ("config/grpo_toy.py", []),
}
COMPARE = [("sdpo", "grpo"), ("sdpo_frozen", "sdpo"), ("sdpo_seqmean", "sdpo")]
SET = "toy/sort"
WINDOW = 10


def run_one(name, seed, out_root):
    out = os.path.join(out_root, f"{name}_s{seed}")
    full = os.path.join(ROOT, out)
    if os.path.exists(os.path.join(full, "done")):
        return full
    os.makedirs(full, exist_ok=True)
    config, extra = ARMS[name]
    cmd = [sys.executable, "train.py", config, *COMMON, *extra, f"--seed={seed}", f"--out_dir={out}", "--overwrite=True"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print("+", " ".join(cmd), flush=True)
    with open(os.path.join(full, "run.out"), "w") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    open(os.path.join(full, "done"), "w").close()
    return full


def read_run(full):
    with open(os.path.join(full, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    evals = {x["iter"]: x for x in log if "eval_tag" in x}
    its = [x for x in log if "reward" in x and "eval_tag" not in x]
    student = {i: x.get(f"eval/{SET}/mean@4") for i, x in sorted(evals.items())}
    teacher = {i: x.get(f"eval/{SET}/teacher_mean@4") for i, x in sorted(evals.items())}
    windows = {}
    for x in its:
        w = (x["iter"] - 1) // WINDOW
        for k in ("peer_frac", "reward", "sampled_logratio", "sampled_logratio_ok", "sampled_logratio_failed", "div"):
            if x.get(k) is not None:
                windows.setdefault(k, {}).setdefault(w, []).append(x[k])
    windows = {k: {w: sum(v) / len(v) for w, v in d.items()} for k, d in windows.items()}
    last = max(student)
    after = [v for i, v in student.items() if i > 0]
    m = {"start": student[0], "final": student[last], "peak": max(after), "early": student.get(20, None),
         "gain10": student[10] - student[0] if 10 in student else None}
    m.update(fade=m["peak"] - m["final"], net=m["final"] - m["start"],
             early_gain=(m["early"] - m["start"]) if m["early"] is not None else None,
             peak_iter=max((i for i in student if i > 0), key=lambda i: student[i]))
    if teacher[0] is not None:
        m.update(teacher_start=teacher[0], teacher_final=teacher[last], teacher_drop=teacher[0] - teacher[last],
                 teacher_minus_student_final=teacher[last] - student[last])
    allits = lambda k: [x[k] for x in its if x.get(k) is not None]  # noqa: E731
    for k in ("peer_frac", "sampled_logratio", "sampled_logratio_ok", "sampled_logratio_failed"):
        v = allits(k)
        if v:
            m[f"{k}_mean"] = sum(v) / len(v)
        late = [x[k] for x in its if x.get(k) is not None and x["iter"] > last // 2]  # the second half
        if late:
            m[f"{k}_late"] = sum(late) / len(late)
    return {"metrics": m, "student": student, "teacher": teacher, "windows": windows}


def table(arms, seeds, runs, keys):
    lines = ["| metric | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for k in keys:
        cells = []
        for a in arms:
            s = mini.summarize([runs[(a, sd)]["metrics"].get(k) for sd in seeds])
            cells.append(mini.cell(s))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def means_table(arms, seeds, runs, columns, headers, value):
    """One row per arm, one column per entry of columns: mean ± SE over seeds of value(run, column);
    arms whose first column is missing (value None) are left out."""
    lines = ["| arm | " + " | ".join(headers) + " |", "|---|" + "---|" * len(columns)]
    for a in arms:
        if value(runs[(a, seeds[0])], columns[0]) is None:
            continue
        row = []
        for c in columns:
            m, se = mini.mean_se([value(runs[(a, s)], c) for s in seeds])
            row.append(f"{mini._f(m)} ± {mini._f(se)}")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return lines


def curve_table(arms, seeds, runs, field):
    iters = sorted(runs[(arms[0], seeds[0])][field])
    return means_table(arms, seeds, runs, iters, [f"it {i}" for i in iters], lambda r, i: r[field].get(i))


def window_table(arms, seeds, runs, key):
    ws = sorted(runs[(arms[0], seeds[0])]["windows"].get("reward", {}))
    return means_table(arms, seeds, runs, ws, [f"it {w * WINDOW + 1}-{(w + 1) * WINDOW}" for w in ws],
                       lambda r, w: r["windows"].get(key, {}).get(w))


def per_seed(arms, seeds, runs, field):
    iters = sorted(runs[(arms[0], seeds[0])][field])
    lines = ["| arm | seed | " + " | ".join(f"it {i}" for i in iters) + " |", "|---|---|" + "---|" * len(iters)]
    for a in arms:
        for s in seeds:
            c = runs[(a, s)][field]
            if c[iters[0]] is None:
                continue
            lines.append(f"| {a} | {s} | " + " | ".join(mini._f(c.get(i), 2) for i in iters) + " |")
    return lines


def compare(seeds, runs, keys, pairs=COMPARE):
    lines = ["| arm − reference | metric | difference mean ± SE [bootstrap 95 %] [t 95 %] | verdict |", "|---|---|---|---|"]
    out = []
    for a, b in pairs:
        for k in keys:
            x = [runs[(a, s)]["metrics"].get(k) for s in seeds]
            y = [runs[(b, s)]["metrics"].get(k) for s in seeds]
            d = mini.paired_diff(x, y)
            if not d["n"]:
                continue
            v = mini.verdict(d, a, b)
            out.append({"arm": a, "ref": b, "metric": k, **d, "verdict": v})
            lines.append(f"| {a} − {b} | {k} | {mini.diff_cell(d)} | {v} |")
    return lines, out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="1-8")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out_root", default="out/fade")
    p.add_argument("--no_run", action="store_true")
    args = p.parse_args()
    arms, seeds = args.arms.split(","), mini.parse_seeds(args.seeds)
    if [a for a in arms if a not in ARMS]:
        sys.exit(f"unknown arms {[a for a in arms if a not in ARMS]}; known: {', '.join(ARMS)}")
    todo = [(a, s) for s in seeds for a in arms]
    if args.no_run:
        dirs = {t: os.path.join(ROOT, args.out_root, f"{t[0]}_s{t[1]}") for t in todo}
        missing = sorted(d for d in dirs.values() if not os.path.exists(os.path.join(d, "done")))  # run_one's marker
        if missing:
            sys.exit(f"--no_run: no finished run in {', '.join(missing)}; run without --no_run first")
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            dirs = dict(zip(todo, pool.map(lambda t: run_one(t[0], t[1], args.out_root), todo)))
    runs = {t: read_run(d) for t, d in dirs.items()}
    keys = ["start", "gain10", "early", "peak", "final", "early_gain", "fade", "net", "peak_iter", "teacher_start", "teacher_final",
            "teacher_drop", "teacher_minus_student_final", "peer_frac_mean", "sampled_logratio_mean",
            "sampled_logratio_ok_mean", "sampled_logratio_failed_mean", "peer_frac_late", "sampled_logratio_late",
            "sampled_logratio_ok_late", "sampled_logratio_failed_late"]
    lines = [f"mean ± SE [bootstrap 95 %] over {len(seeds)} paired seeds ({','.join(map(str, seeds))})", ""]
    lines += table(arms, seeds, runs, keys)
    cl, cout = compare(seeds, runs, ["gain10", "early_gain", "fade", "net", "final", "teacher_drop", "teacher_final",
                                     "peer_frac_mean", "peer_frac_late", "sampled_logratio_late", "sampled_logratio_ok_late",
                                     "sampled_logratio_failed_late"],
                       [c for c in COMPARE if c[0] in arms and c[1] in arms])
    lines += ["", "paired differences (per seed); verdict only when both 95 % intervals exclude 0", ""] + cl
    lines += ["", f"student {SET} mean@4 by eval (mean ± SE over seeds)", ""] + curve_table(arms, seeds, runs, "student")
    lines += ["", f"teacher (reference-solution demonstration) {SET} mean@4 by eval", ""] + curve_table(arms, seeds, runs, "teacher")
    for k in ("reward", "peer_frac", "sampled_logratio", "sampled_logratio_ok", "sampled_logratio_failed"):
        lines += ["", f"{k}, mean per {WINDOW}-iteration window", ""] + window_table(arms, seeds, runs, k)
    lines += ["", "per seed: student mean@4", ""] + per_seed(arms, seeds, runs, "student")
    lines += ["", "per seed: teacher mean@4", ""] + per_seed(arms, seeds, runs, "teacher")
    print("\n".join(lines))
    print(json.dumps({"arms": arms, "seeds": seeds, "comparisons": cout,
                      "runs": [{"arm": a, "seed": s, **runs[(a, s)]["metrics"]} for a, s in todo]}))
