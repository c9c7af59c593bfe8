"""The teacher's own accuracy over a continual run: for each SDPO run folder, the teacher reading each
eval prompt with the reference solution as its demonstration (log.jsonl eval records,
eval/<set>/teacher_mean@n, written by train.py) at the start and after every stage,
beside the student's mean@n; mean ± SE over seeds per arm.

    python tests/experiments/teacher_track.py --root=out/miniature \
        --arms=sdpo_d0.25_disagree,sdpo_d0.25_last,sdpo_seqmean --seeds=1-8
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
from tests.experiments import miniature as mini  # noqa: E402


def evals(run):
    with open(os.path.join(run, "log.jsonl")) as f:
        return [x for x in map(json.loads, f) if "eval_tag" in x]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="out/miniature")
    p.add_argument("--arms", required=True)
    p.add_argument("--seeds", default="1-8")
    p.add_argument("--sets", default="add,mul,sort,rev")
    args = p.parse_args()
    seeds, sets = mini.parse_seeds(args.seeds), args.sets.split(",")
    for a in args.arms.split(","):
        runs = {s: evals(os.path.join(args.root, f"{a}_s{s}")) for s in seeds}
        tags = [x["eval_tag"] for x in runs[seeds[0]]]
        uneven = [s for s in seeds if [x["eval_tag"] for x in runs[s]] != tags]  # row i must be one eval in every seed
        if uneven:
            sys.exit(f"{a}: seeds {uneven} have other evals than seed {seeds[0]} ({', '.join(tags)}): "
                     "an unfinished or a different run")
        print(f"\n{a} ({len(seeds)} seeds): student / teacher mean@4, mean ± SE\n")
        print("| eval | " + " | ".join(sets) + " |\n|---|" + "---|" * len(sets))
        for i, tag in enumerate(tags):
            cells = []
            for st in sets:
                ms = mini.mean_se([runs[s][i].get(f"eval/toy/{st}/mean@4") for s in seeds])
                mt = mini.mean_se([runs[s][i].get(f"eval/toy/{st}/teacher_mean@4") for s in seeds])
                cells.append(f"{mini._f(ms[0], 2)} ± {mini._f(ms[1], 2)} / {mini._f(mt[0], 2)} ± {mini._f(mt[1], 2)}")
            print(f"| {tag} | " + " | ".join(cells) + " |")
