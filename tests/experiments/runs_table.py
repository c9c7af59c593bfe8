"""Several runs side by side, for an ablation: the settings in which they differ, each eval set's score at
the first and the last eval (and its best), and the training signal over the last iterations.

    python train.py config/sdpo_toy.py --out_dir=out/d1
    python train.py config/sdpo_toy.py --density=0.5 --out_dir=out/d05
    python tests/experiments/runs_table.py out/d1 out/d05

Reads each run folder's log.jsonl and the settings its checkpoint holds (ckpt/trainer/state.json, written
with the first checkpoint, at iteration 0); a run still training shows what it has logged so far. Prints
a markdown table. One run's numbers only: for a verdict between arms, run several seeds
(tests/experiments/miniature.py does, with paired statistics).
"""
import json
import os
import re
import sys

LAST = 10  # the training columns: the mean over the last LAST iterations logged
SIGNAL = ("reward", "resp_len", "truncated", "distill_frac", "div")  # per-iteration keys shown, where logged
EVAL_KEY = re.compile(r"^eval/(.+)/mean@(\d+)$")  # the student's score on a set (teacher_mean@n is the teacher's)


def read_run(folder):
    """(settings, iteration rows, {eval set: its mean@n at each eval, in order}) of a train.py out_dir; a folder
    that is not one: SystemExit."""
    log, state = os.path.join(folder, "log.jsonl"), os.path.join(folder, "ckpt", "trainer", "state.json")
    for path, what in ((log, "log.jsonl"), (state, "ckpt/trainer/state.json")):
        if not os.path.isfile(path):
            raise SystemExit(f"error: {folder} has no {what}: give train.py out_dir folders "
                             "(the settings are saved with the first checkpoint, at iteration 0)")
    try:
        with open(state) as f:
            settings = json.load(f)["config"]
        with open(log) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (ValueError, KeyError) as e:
        raise SystemExit(f"error: {folder}: cannot read its log or settings ({type(e).__name__}: {e})") from None
    scores = {}
    for r in (r for r in rows if "eval_tag" in r):
        for k, v in r.items():
            if m := EVAL_KEY.match(k):
                scores.setdefault(m.group(1), []).append(v)
    iters = [r for r in rows if "loss" in r and "eval_tag" not in r]
    return settings, iters, scores


def table(folders):
    """The markdown table of the runs in `folders` (one row each)."""
    runs = [read_run(f) for f in folders]
    keys = sorted({k for s, _, _ in runs for k in s})
    differ = [k for k in keys if k != "out_dir" and len({json.dumps(s.get(k)) for s, _, _ in runs}) > 1]
    sets = list(dict.fromkeys(name for _, _, scores in runs for name in scores))
    signal = [k for k in SIGNAL if any(k in r for _, iters, _ in runs for r in iters)]
    head = ["run", *differ, "iters", *(f"{s} mean@n: first → last (best)" for s in sets),
            *(f"{k} (last {LAST})" for k in signal)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for folder, (settings, iters, scores) in zip(folders, runs):
        cells = [folder, *(json.dumps(settings.get(k)) for k in differ), str(iters[-1]["iter"] if iters else 0)]
        for name in sets:
            got = scores.get(name)
            cells.append(f"{got[0]:.3f} → {got[-1]:.3f} ({max(got):.3f})" if got else "-")
        for k in signal:
            values = [r[k] for r in iters[-LAST:] if k in r]
            cells.append(f"{sum(values) / len(values):.3g}" if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if len(folders) == 1:
        return "\n".join(lines)
    note = f"settings that differ: {', '.join(differ)}" if differ else "the runs' settings are the same (out_dir aside)"
    return "\n".join(lines) + "\n\n" + note


def main(argv):
    if not argv or any(a.startswith("-") for a in argv):
        raise SystemExit("usage: python tests/experiments/runs_table.py RUN_DIR [RUN_DIR ...] (train.py out_dir folders)")
    print(table(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
