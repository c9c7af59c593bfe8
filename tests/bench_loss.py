"""Benchmark: naive token loss (full [N, V] logits + autograd) vs the fused,
chunked one, at a few sizes. Each measurement runs in its own subprocess so
peak memory is clean.

    python tests/bench_loss.py                      # CPU, fp32
    python tests/bench_loss.py --cuda --dtype bf16  # GPU, main size N=8192 H=4096 V=128256
    python tests/bench_loss.py --size 256 64 4096   # one size of your choice

Peak memory = peak above the post-setup baseline (inputs allocated, a tiny
warm-up done): on CPU the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs; a 1 ms RSS sampler if that is not allowed), on CUDA
torch.cuda.max_memory_allocated. Time = median of the timed runs, which come
after a first (memory-measuring, warm-up) run. The last line printed is one
JSON object for the main size.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from train import fused_token_loss, naive_token_loss, sampled_logprobs  # noqa: E402

CPU_SIZES = [  # (N, H, V); the first is the main size
    (1024, 256, 151936),
    (2048, 128, 32768),
    (256, 1024, 151936),
]
CUDA_SIZES = [
    (8192, 4096, 128256),
    (16384, 1024, 65536),
    (4096, 4096, 32768),
]


# ----------------------------------------------------------------------------- memory

def _rss_mb(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


class PeakMemory:
    """Peak memory (MB) above the level at __enter__, for the code in the block."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
            return self
        self.base = _rss_mb()
        try:  # "5" resets the peak RSS (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.sampler = None
        except OSError:
            self.peak, self.stop = self.base, False

            def sample():
                while not self.stop:
                    self.peak = max(self.peak, _rss_mb())
                    time.sleep(0.001)

            self.sampler = threading.Thread(target=sample, daemon=True)
            self.sampler.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.mb = torch.cuda.max_memory_allocated() / 2**20 - self.base
        elif self.sampler is None:
            self.mb = _rss_mb("VmHWM") - self.base
        else:
            self.stop = True
            self.sampler.join()
            self.mb = max(self.peak, _rss_mb()) - self.base


# ----------------------------------------------------------------------------- problem

def make_problem(N, H, V, dtype, device, seed=0):
    """A GRPO + distillation step: student hidden states (non-leaf, as out of a
    model), LM head Parameter, a frozen teacher with its own head, a mask of
    rows that get the divergence (sequence-level: whole blocks of rows)."""
    g = torch.Generator().manual_seed(seed)
    h_leaf = (torch.randn(N, H, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(V, H, generator=g) * H ** -0.5 * 2).to(device, dtype))
    h_t = (torch.randn(N, H, generator=g) * 0.5).to(device, dtype)
    w_t = (weight.detach().float().cpu() + 0.1 * torch.randn(V, H, generator=g) * H ** -0.5).to(device, dtype)
    tokens = torch.randint(0, V, (N,), generator=g).to(device)
    adv = torch.randn(N, generator=g).to(device)
    # behaviour-policy log-probs near the current ones, so the PPO ratio is ~1
    # and some rows are clipped, as in a real update
    old_logp = sampled_logprobs(h_leaf.detach(), weight.detach(), tokens)
    old_logp += (0.2 * torch.randn(N, generator=g)).to(device)
    # rows come in "sequences" of 16..255 tokens; 3 of 4 sequences have a
    # teacher signal (so chunks are often partly distilled)
    lengths = torch.randint(16, 256, (N,), generator=g)
    seq_id = torch.repeat_interleave(torch.arange(N), lengths)[:N]
    div_rows = (seq_id % 4 != 3).to(device)

    def loss_fn(logp, div, teacher_logp, rows):
        ratio = torch.exp(logp - old_logp[rows])
        a = adv[rows]
        pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        return (pg + 0.5 * div).sum() / N

    return dict(h_leaf=h_leaf, weight=weight, tokens=tokens, loss_fn=loss_fn,
                teacher=[(h_t, w_t, 1.0)], div_rows=div_rows)


def run_step(kind, P, chunk_size):
    hidden = P["h_leaf"] * 1.0  # non-leaf, like a model output
    kw = dict(alpha=0.5, distill="topk", topk=100, tail=True, temperature=1.0)
    if kind == "fused":
        loss, _ = fused_token_loss(hidden, P["weight"], P["tokens"], P["loss_fn"], P["teacher"],
                                   P["div_rows"], chunk_size=chunk_size, **kw)
    else:
        loss, _ = naive_token_loss(hidden, P["weight"], P["tokens"], P["loss_fn"], P["teacher"],
                                   P["div_rows"], **kw)
    loss.backward()
    return loss.detach()


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def worker(args):
    N, H, V = args.size
    device = "cuda" if args.cuda else "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    P = make_problem(N, H, V, dtype, device)

    if args.worker == "check":  # max |grad_fused - grad_naive|, in one process
        out = {}
        for kind in ("naive", "fused"):
            P["h_leaf"].grad = P["weight"].grad = None
            loss = run_step(kind, P, args.chunk_size)
            out[kind] = (loss.float(), P["h_leaf"].grad.float(), P["weight"].grad.float())
        diffs = [(a - b).abs().max().item() for a, b in zip(out["naive"], out["fused"])]
        print(json.dumps({"loss_diff": diffs[0], "max_abs_grad_diff": max(diffs[1:]),
                          "max_abs_grad": max(out["naive"][1].abs().max().item(),
                                              out["naive"][2].abs().max().item())}))
        return

    # tiny warm-up (threads, kernels) that does not touch the measured sizes
    Q = make_problem(64, H, 1024, dtype, device, seed=1)
    run_step(args.worker, Q, args.chunk_size)
    del Q
    _sync(args.cuda)

    times, peak = [], None
    for i in range(args.runs + 1):
        P["h_leaf"].grad = P["weight"].grad = None
        _sync(args.cuda)
        if i == 0:  # first run: peak memory (and warm-up for the timings)
            with PeakMemory(args.cuda) as m:
                run_step(args.worker, P, args.chunk_size)
            peak = m.mb
        else:
            t0 = time.perf_counter()
            run_step(args.worker, P, args.chunk_size)
            _sync(args.cuda)
            times.append(time.perf_counter() - t0)
    print(json.dumps({"time_s": statistics.median(times), "times": times, "peak_mb": peak}))


def spawn(args, kind, size):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--size", *map(str, size),
           "--dtype", args.dtype, "--chunk-size", str(args.chunk_size), "--runs", str(args.runs)]
    if args.cuda:
        cmd.append("--cuda")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"worker failed: {' '.join(cmd)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["naive", "fused", "check"])
    ap.add_argument("--size", type=int, nargs=3, metavar=("N", "H", "V"), help="measure this size only")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median)")
    ap.add_argument("--main-only", action="store_true", help="only the main size")
    args = ap.parse_args()
    if args.chunk_size is None:  # the fused_token_loss default
        args.chunk_size = fused_token_loss.__kwdefaults__["chunk_size"]
    if args.worker:
        return worker(args)

    sizes = [tuple(args.size)] if args.size else CUDA_SIZES if args.cuda else CPU_SIZES
    if args.main_only:
        sizes = sizes[:1]
    dev = torch.cuda.get_device_name() if args.cuda else f"cpu x{torch.get_num_threads()} threads"
    print(f"device: {dev}  dtype: {args.dtype}  chunk_size: {args.chunk_size}  "
          f"loss: GRPO clip + 0.5 * JSD(alpha=0.5) top-100 + tail, 3/4 rows distilled")
    print(f"{'N':>6} {'H':>5} {'V':>7} | {'naive s':>8} {'fused s':>8} {'speedup':>7} | "
          f"{'naive MB':>9} {'fused MB':>9} {'mem red.':>8}")
    results = []
    for size in sizes:
        n, f = spawn(args, "naive", size), spawn(args, "fused", size)
        r = {"size": list(size), "naive_s": round(n["time_s"], 4), "fused_s": round(f["time_s"], 4),
             "naive_peak_mb": round(n["peak_mb"], 1), "fused_peak_mb": round(f["peak_mb"], 1)}
        r["speedup"] = round(n["time_s"] / f["time_s"], 3)
        r["mem_reduction"] = round(1 - f["peak_mb"] / n["peak_mb"], 4)
        results.append(r)
        print(f"{size[0]:>6} {size[1]:>5} {size[2]:>7} | {r['naive_s']:>8.3f} {r['fused_s']:>8.3f} "
              f"{r['speedup']:>6.2f}x | {r['naive_peak_mb']:>9.1f} {r['fused_peak_mb']:>9.1f} "
              f"{100 * r['mem_reduction']:>7.1f}%", flush=True)
    check = spawn(args, "check", sizes[0])
    print(f"main size: max |grad fused - grad naive| = {check['max_abs_grad_diff']:.3e} "
          f"(max |grad| {check['max_abs_grad']:.3e}), |loss diff| = {check['loss_diff']:.3e}")
    main_r = dict(results[0])
    main_r.pop("size")
    main_r["max_abs_grad_diff"] = check["max_abs_grad_diff"]
    main_r["size"] = list(sizes[0])
    main_r["chunk_size"] = args.chunk_size
    main_r["device"] = dev
    main_r["dtype"] = args.dtype
    main_r["other_sizes"] = results[1:]
    print(json.dumps(main_r))


if __name__ == "__main__":
    main()
