"""
Spectral parameter drift of finished miniature runs, read-only, with the miniature's statistics:
does the paper's own drift measure (top-k singular subspaces and spectrum of each weight matrix,
after arXiv 2511.08567: eval.spectral_drift) separate the arms where ‖θ−θ0‖/‖θ0‖ does not?

    python tests/experiments/spectral_runs.py --root=out/miniature --arms=grpo,sdpo,sdpo_d0.5,sdpo_d0.25 \
        --seeds=1-8 --ref=grpo --out=out/spectral

For every <root>/<arm>_s<seed>/ it reads the safetensors of each stage snapshot (stage*_*/) and of
the final model (ckpt/) and those of the base (--base, default out/toy_base/ckpt), computes
eval.param_drift and eval.spectral_drift (k = 0: min(m,n)//8 = 16 for the toy's matrices; the
embedding / LM head is skipped by spectral_drift) on the state dicts, and caches them in
<out>/<arm>_s<seed>.json (nothing is written under --root). Reported per arm (mean ± SE [bootstrap
95 %]) and paired against --ref:
  param_drift    ‖θ−θ0‖/‖θ0‖ (overall)
  nss            mean of nss_left and nss_right (1 = the top-k subspaces did not rotate)
  angle          mean of max_angle_left and max_angle_right, degrees (the largest principal angle)
  sv_change      ‖σ−σ0‖/‖σ0‖ over the top-k singular values
  angle_per_drift  angle / param_drift: rotation per unit of relative movement (scale-free)
each for the final model (and with --stages per stage snapshot: s1_, s2_ prefixes), overall and for
the MLP matrices (mlp_) and each attention projection (attn_q_, attn_k_, attn_v_, attn_o_).
"""
import argparse
import glob
import json
import os
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
import eval as ev  # noqa: E402
from tests.experiments import miniature as mini  # noqa: E402

torch.set_num_threads(1)


def load(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


BASE_SPECTRA = {}  # the one base's decompositions (--base), shared by every run and snapshot


def drift(state, state0):
    p = ev.param_drift(state, state0)
    s = ev.spectral_drift(state, state0, base_cache=BASE_SPECTRA)
    out = {"param_drift": p["overall"], **{f"param_{m}": v for m, v in p["by_module"].items()}}
    for group, g in [("", s["overall"])] + [(m + "_", v) for m, v in s["by_module"].items()]:
        out.update({group + name: value for name, value in mini.spectral_figures(g).items()})
        out[group + "sv_change"] = g["sv_change"]
    out["angle_per_drift"] = out["angle"] / out["param_drift"] if out["param_drift"] else None
    out["spectral_raw"] = s
    return out


def source(run, base):
    """What a cache entry was computed from: the run folder, its final weights' mtime, the base folder."""
    weights = os.path.join(run, "ckpt", "model.safetensors")
    return {"run": os.path.abspath(run), "mtime": os.path.getmtime(weights) if os.path.exists(weights) else None,
            "base": os.path.abspath(base)}


def run_drift(run, base_state, cache, base):
    """The run's drift, from the cache when it was computed from this run folder (as it is now) and base."""
    key = source(run, base)
    if os.path.exists(cache):
        with open(cache) as f:
            got = json.load(f)
        if got.get("source") == key:  # (a cache of another --root, a rerun or another --base is recomputed)
            return got["drift"]
    res = {"final": drift(load(os.path.join(run, "ckpt")), base_state)}
    for snap in sorted(glob.glob(os.path.join(run, "stage*_*"))):
        res[os.path.basename(snap).split("_")[0]] = drift(load(snap), base_state)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache, "w") as f:
        json.dump({"source": key, "drift": res}, f)
    return res


KEYS = ["param_drift", "nss", "angle", "sv_change", "angle_per_drift", "param_mlp", "mlp_nss", "mlp_angle", "mlp_sv_change",
        *[f"{m}_{k}" for m in ("attn_q", "attn_k", "attn_v", "attn_o") for k in ("nss", "angle", "sv_change")]]

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True)
    p.add_argument("--arms", default="grpo,sdpo,sdpo_d0.5,sdpo_d0.25")
    p.add_argument("--seeds", default="1-8")
    p.add_argument("--ref", default="grpo")
    p.add_argument("--base", default="out/toy_base/ckpt")
    p.add_argument("--out", default="out/spectral")
    p.add_argument("--stages", action="store_true", help="also report each stage snapshot")
    args = p.parse_args()
    arms, seeds = args.arms.split(","), mini.parse_seeds(args.seeds)
    base = load(os.path.join(ROOT, args.base))
    res = {(a, s): run_drift(os.path.join(args.root, f"{a}_s{s}"), base, os.path.join(ROOT, args.out, f"{a}_s{s}.json"),
                             os.path.join(ROOT, args.base))
           for a in arms for s in seeds}
    for part in ["final"] + (["stage1", "stage2", "stage3"] if args.stages else []):
        print(f"\n## {part}: mean ± SE [bootstrap 95 %] over {len(seeds)} seeds\n")
        print("| metric | " + " | ".join(arms) + " |\n|---|" + "---|" * len(arms))
        for k in KEYS:
            cells = []
            for a in arms:
                s = mini.summarize([res[(a, sd)].get(part, {}).get(k) for sd in seeds])
                cells.append(mini.cell(s, 4))
            print(f"| {k} | " + " | ".join(cells) + " |")
        print(f"\npaired difference (arm − {args.ref}): mean ± SE [bootstrap 95 %] [t 95 %]\n")
        print("| arm − ref | metric | difference | verdict |\n|---|---|---|---|")
        for a in arms:
            if a == args.ref:
                continue
            for k in KEYS:
                x = [res[(a, sd)].get(part, {}).get(k) for sd in seeds]
                y = [res[(args.ref, sd)].get(part, {}).get(k) for sd in seeds]
                d = mini.paired_diff(x, y)
                print(f"| {a} − {args.ref} | {k} | {mini.diff_cell(d, 4)} | {mini.verdict(d, a, args.ref)} |")
