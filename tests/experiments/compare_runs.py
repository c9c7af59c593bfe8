"""Are two runs of one (arm, seed) numerically identical? Compares accuracy_matrix.json exactly and every
per-iteration number both log.jsonl files share (loss, reward, grad_norm, ...; phase times excluded).

    python tests/experiments/compare_runs.py out/check/grpo_s1 out/miniature/grpo_s1
"""
import json
import os
import sys

SKIP = {"gen_s", "reward_s", "train_s", "iter_s", "optimizer_s", "teacher_s", "student_s", "reference_s", "tok_s"}


def iters(path):
    with open(path + "/log.jsonl") as f:
        return {x["iter"]: x for x in map(json.loads, f) if "reward" in x and "eval_tag" not in x and "eval" not in x}


def gap(x, y):
    """|x − y|; 0 for NaN in both, inf for NaN in one (abs(nan − y) is nan, which max() may pass over)."""
    if x == y or (x != x and y != y):
        return 0
    return abs(x - y) if x == x and y == y else float("inf")


def compare(a, b):
    ma, mb = (json.load(open(p + "/accuracy_matrix.json")) for p in (a, b))
    same_matrix = ma["rows"] == mb["rows"] and ma.get("base") == mb.get("base")
    ia, ib = iters(a), iters(b)
    shared = sorted(set(ia) & set(ib))
    keys = sorted({k for i in shared for k in ia[i] if k in ib[i] and k not in SKIP and isinstance(ia[i][k], (int, float))})
    diffs = {k: max(gap(ia[i][k], ib[i][k]) for i in shared if k in ia[i] and k in ib[i]) for k in keys}
    return same_matrix, len(shared), {k: v for k, v in diffs.items() if v != 0}, ma["rows"], mb["rows"]


if __name__ == "__main__":
    missing = [p for p in sys.argv[1:] if not os.path.isfile(os.path.join(p, "accuracy_matrix.json"))]
    if len(sys.argv) != 3 or missing:
        sys.exit("usage: python tests/experiments/compare_runs.py RUN_DIR_A RUN_DIR_B (two finished run folders"
                 + (f"; no accuracy_matrix.json in {', '.join(missing)})" if missing else ")"))
    same, n, diffs, ra, rb = compare(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[1]} vs {sys.argv[2]}: accuracy matrix identical: {same}; {n} iterations compared; "
          f"per-iteration keys that differ (max |diff|): {diffs or 'none'}")
    if not same:
        print("  rows A:", ra, "\n  rows B:", rb)
