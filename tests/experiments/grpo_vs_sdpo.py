"""
GRPO vs SDPO on one toy domain, same iterations, batch and seed: in-domain test accuracy
(mean@4 at temperature 0.6) at every eval, side by side, then a JSON last line.

    python tests/experiments/grpo_vs_sdpo.py                         # toy/sort, config/grpo_toy.py vs config/sdpo_toy.py
    python tests/experiments/grpo_vs_sdpo.py --dataset=toy/add --seed=2
Needs the toy base: python data/toy/prepare.py && python train.py config/toy_base.py
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def curve(out_dir, dataset):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["iter"]: r[f"eval/{dataset}/mean@4"] for r in rows if f"eval/{dataset}/mean@4" in r}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="toy/sort")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out_root", default="out/grpo_vs_sdpo")
    p.add_argument("extra", nargs="*", help="more --key=value overrides for both runs")
    args = p.parse_args()
    curves = {}
    # the overrides name the folder too: a run with other overrides is another run
    tag = "_" + hashlib.sha1(" ".join(args.extra).encode()).hexdigest()[:8] if args.extra else ""
    for algo in ("grpo", "sdpo"):
        out = os.path.join(args.out_root, f"{algo}_{args.dataset.replace('/', '_')}_s{args.seed}{tag}")
        # finished: its one stage's accuracy matrix is written after its last iteration (ckpt/ exists from
        # iteration 0 on); paths from ROOT, where train.py runs, whatever the current folder
        if not os.path.exists(os.path.join(ROOT, out, "accuracy_matrix.json")):
            cmd = [sys.executable, "train.py", f"config/{algo}_toy.py", f"--dataset={args.dataset}",
                   f"--seed={args.seed}", f"--out_dir={out}", "--overwrite=True", *args.extra]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        curves[algo] = curve(os.path.join(ROOT, out), args.dataset)
    print(f"| iteration | GRPO {args.dataset} mean@4 | SDPO {args.dataset} mean@4 |\n|---|---|---|")
    for it in sorted(curves["grpo"]):
        print(f"| {it} | {curves['grpo'][it]:.3f} | {curves['sdpo'].get(it, float('nan')):.3f} |")
    print(json.dumps({"dataset": args.dataset, "seed": args.seed, **curves}))
