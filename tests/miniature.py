"""
The paper in miniature: continual post-training on the toy suite (add -> mul -> sort, all five
domains scored after every stage), GRPO against SDPO at density 1, 0.5 and 0.25 and SDPO with a
frozen instead of an EMA teacher. Each arm is one `train.py` run and one `eval.py` run; this
script runs them in turn (skipping arms whose eval.json already exists) and prints the table
that README's "The paper in miniature" shows (one row per run, then each arm's mean over its
seeds), then a JSON last line.

    python tests/miniature.py                      # seed 1337, every arm
    python tests/miniature.py --seeds=1,2,3 --arms=grpo,sdpo_d1
Needs the toy base: python data/toy/prepare.py && python train.py config/toy_base.py
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {  # name: (config, overrides)
    "grpo": ("config/continual_toy_grpo.py", []),
    "sdpo_d1": ("config/continual_toy_sdpo.py", []),
    "sdpo_d0.5": ("config/continual_toy_sdpo.py", ["--density=0.5"]),
    "sdpo_d0.25": ("config/continual_toy_sdpo.py", ["--density=0.25"]),
    "sdpo_frozen": ("config/continual_toy_sdpo.py", ["--teacher=frozen"]),
}
DOMAINS = ["toy/add", "toy/sub", "toy/mul", "toy/sort", "toy/rev"]


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def arm(name, seed, out_root):
    config, overrides = ARMS[name]
    out = os.path.join(out_root, f"{name}_s{seed}")
    report = os.path.join(out, "eval.json")
    if not os.path.exists(report):
        run([sys.executable, "train.py", config, *overrides, f"--seed={seed}", f"--out_dir={out}"])
        run([sys.executable, "eval.py", f"--run_dir={out}", "--n=4", "--k=1,4", "--max_prompts=100",
             "--drift_prompts=64", "--stage_drift=False", f"--seed={seed}"])
    with open(report) as f:
        r = json.load(f)
    c, d = r["continual"], r["drift"]
    final = dict(zip(c["eval_sets"], c["rows"][-1]))
    mmd = [v["mmd2"] for v in d["response"].values()]
    leak = [v["model"]["foreign_format"] for v in d["artifacts"].values()]
    return {"arm": name, "seed": seed, **{k.split("/")[1]: final[k] for k in DOMAINS},
            "avg_final": c["avg_final"], "forgetting": c["avg_forgetting"], "bwt": c["bwt"],
            "param_drift": d["param"]["overall"], "response_mmd2": sum(mmd) / len(mmd),
            "format_leak": sum(leak) / len(leak)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1337")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out_root", default="out/miniature")
    args = p.parse_args()
    rows = [arm(a, int(s), args.out_root) for a in args.arms.split(",") for s in args.seeds.split(",")]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        print("| " + " | ".join(map(fmt, r.values())) + " |")
    means = []  # each arm's mean over its seeds
    for a in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == a]
        means.append({"arm": a, "seed": f"mean of {len(mine)}",
                      **{k: sum(r[k] for r in mine) / len(mine) for k in cols[2:]}})
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in means:
        print("| " + " | ".join(map(fmt, r.values())) + " |")
    print(json.dumps({"rows": rows, "means": means}))
