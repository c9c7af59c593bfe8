"""
Where eval.spectral_drift's top-k subspace is ill-defined: the ratio σ_k / σ_k+1 of each weight matrix
of a model (the base, whose subspaces the drift is measured against). Near 1 there is no gap at the
cut, and a tiny update can swap a direction in or out of the top k: the largest principal angle of
that matrix jumps (towards 90°) and its NSS drops by ~1/k, whatever else training did.

    python tests/experiments/spectral_gaps.py --model=out/toy_base/ckpt

Prints every matrix spectral_drift reads (the same k: eval.spectral_k_for, the same skips) sorted by
its gap, the count below --below, and a JSON last line.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for eval.py

import eval as ev  # noqa: E402


def gaps(state, k=0):
    """{name: σ_k / σ_k+1} for every 2-D non-embedding weight with more than k singular values."""
    out = {}
    for name, t in state.items():
        if t.dim() != 2 or ev.module_type(name) == "embed" or not t.any():
            continue
        kk = ev.spectral_k_for(t.shape, k)
        if kk < min(t.shape):
            s = torch.linalg.svdvals(t.double())
            out[name] = (s[kk - 1] / s[kk]).item()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="out/toy_base/ckpt", help="a model folder (its *.safetensors)")
    p.add_argument("--k", type=int, default=0, help="eval.py's spectral_k (0: min(m, n) // 8, at most 64)")
    p.add_argument("--below", type=float, default=1.01, help="a gap below this counts as none")
    a = p.parse_args()
    files = sorted(f for f in os.listdir(a.model) if f.endswith(".safetensors"))
    if not files:
        sys.exit(f"error: {a.model} has no .safetensors files: give a model folder (a run's ckpt/)")
    state = {n: t for f in files for n, t in load_file(os.path.join(a.model, f)).items()}
    g = gaps(state, a.k)
    for name, r in sorted(g.items(), key=lambda x: x[1]):
        print(f"{r:8.4f}  {name}")
    flat = sorted(n for n, r in g.items() if r < a.below)
    print(f"{len(flat)} of {len(g)} matrices have sigma_k / sigma_k+1 < {a.below}")
    print(json.dumps({"model": a.model, "k": a.k, "below": a.below, "matrices": len(g), "without_gap": flat}))


if __name__ == "__main__":
    main()
