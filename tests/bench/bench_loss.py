"""Benchmark: naive token loss (full [N, V] logits + autograd) vs the fused,
chunked one, at a few sizes. Each measurement runs in its own subprocess so
peak memory is clean (--inprocess: all in this process, one problem per size;
exact for CUDA's allocated-bytes peaks, approximate for CPU RSS).

    python tests/bench/bench_loss.py                      # CPU, fp32
    python tests/bench/bench_loss.py --cuda --dtype bf16  # GPU, main size N=8192 H=4096 V=128256
    python tests/bench/bench_loss.py --size 256 64 4096   # one size of your choice

Columns (the same inputs for all):
  naive       train.naive_token_loss: fp32 products and maths (the exact reference)
  bf16 naive  what a user writes: logits = (h @ W.T) as a bf16 product (tensor cores), then
              .float() for the softmax / divergence maths, autograd (--bf16-naive; default
              on for --dtype bf16). Speed and memory ratios are reported against it.
  fused       train.fused_token_loss (bf16 inputs: bf16 products, fp32 maths), chunk_size
              train.py's default for the device (128 on CPU, 512 on CUDA)
and, with --jsd (default on for CUDA), the full-vocab generalized JSD alone (alpha = beta
= 0.5, mean over the distilled rows, forward + backward): the fused loss with distill="full"
beside Liger's LigerFusedLinearJSD (liger_kernel, optional, CUDA only: skipped with the reason
printed when it is not importable), so the anchor is measured in the same run.

Peak memory = peak above the post-setup baseline (inputs allocated, a tiny
warm-up done): on CPU the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs; a 1 ms RSS sampler if that is not allowed), on CUDA
torch.cuda.max_memory_allocated. Time = median of the timed runs, which come
after a first (memory-measuring, warm-up) run; on CUDA synchronised. The last
line printed is one JSON object for the main size.
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
import train  # noqa: E402
from teacher import TeacherLogits  # noqa: E402
from train import distill_divergence, fused_token_loss, naive_token_loss, sampled_logprobs  # noqa: E402

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
    rows that get the divergence (sequence-level: whole blocks of rows).
    On CUDA the [N, H] and [V, H] draws come from a device generator (seconds
    saved at the main size); on a CPU everything is drawn as before."""
    g = torch.Generator().manual_seed(seed)
    cuda = torch.device(device).type == "cuda"
    big = torch.Generator(device).manual_seed(seed) if cuda else g

    def randn(*shape):
        return torch.randn(*shape, generator=big, device=device if cuda else "cpu")

    h_leaf = (randn(N, H) * 0.5).to(device, dtype).requires_grad_()
    weight = torch.nn.Parameter((randn(V, H) * H ** -0.5 * 2).to(device, dtype))
    h_t = (randn(N, H) * 0.5).to(device, dtype)
    w_t = (weight.detach().float().to(big.device) + 0.1 * randn(V, H) * H ** -0.5).to(device, dtype)
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
    n_div = max(int(div_rows.sum()), 1)

    def loss_fn(logp, div, teacher_logp, rows):
        ratio = torch.exp(logp - old_logp[rows])
        a = adv[rows]
        pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        return (pg + 0.5 * div).sum() / N

    def jsd_loss_fn(logp, div, teacher_logp, rows):  # the divergence alone, mean over the distilled rows
        return div.sum() / n_div

    return dict(h_leaf=h_leaf, weight=weight, tokens=tokens, loss_fn=loss_fn, jsd_loss_fn=jsd_loss_fn,
                teacher=[TeacherLogits(h_t, w_t, 1.0)], div_rows=div_rows)


def naive_bf16_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                          alpha, distill, topk, tail, temperature=1.0):
    """What a user writes: the LM head as one bf16 product (tensor cores), then .float() for the
    softmax and divergence maths, plain autograd. The same loss as naive_token_loss."""
    N = hidden.shape[0]
    bf16 = torch.bfloat16
    logits = (hidden.to(bf16) @ weight.to(bf16).T).float()
    logits = logits / temperature if temperature != 1.0 else logits
    logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None].long()).squeeze(1)
    div = torch.zeros(N, device=hidden.device)
    teacher_logp = torch.zeros(N, device=hidden.device)
    rows = div_rows.nonzero().squeeze(1) if teacher else div_rows.new_zeros(0, dtype=torch.long)
    if rows.numel():
        with torch.no_grad():
            t_logits = sum(coef * (h_t[rows].to(bf16) @ w_t.to(bf16).T).float() for h_t, w_t, coef in teacher)
            t_logits = t_logits / temperature if temperature != 1.0 else t_logits
            teacher_logp = teacher_logp.index_put((rows,), torch.log_softmax(t_logits, -1).gather(
                1, tokens[rows, None].long()).squeeze(1))
        div = div.index_put((rows,), distill_divergence(logits[rows], t_logits, alpha, distill, topk, tail))
    return loss_fn(logp, div, teacher_logp, slice(0, N)), None


MAIN_LOSS = dict(alpha=0.5, distill="topk", topk=100, tail=True, temperature=1.0)
JSD_LOSS = dict(alpha=0.5, distill="full", topk=100, tail=True, temperature=1.0)
KINDS = ("naive", "naive_bf16", "fused", "fused_jsd", "liger")


def run_step(kind, P, chunk_size):
    hidden = P["h_leaf"] * 1.0  # non-leaf, like a model output
    if kind == "liger":  # full-vocab generalized JSD, mean over the rows whose label is not ignored
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
        (h_t, w_t, _), = P["teacher"]
        labels = torch.where(P["div_rows"], P["tokens"], torch.full_like(P["tokens"], -100))
        loss = LigerFusedLinearJSD(jsd_beta=0.5)(hidden, P["weight"], h_t, w_t, labels)
    elif kind == "fused_jsd":
        loss, _ = fused_token_loss(hidden, P["weight"], P["tokens"], P["jsd_loss_fn"], P["teacher"], P["div_rows"],
                                   chunk_size=chunk_size, **JSD_LOSS)
    else:
        loss_fn = {"naive": naive_token_loss, "naive_bf16": naive_bf16_token_loss}.get(kind)
        if kind == "fused":
            loss, _ = fused_token_loss(hidden, P["weight"], P["tokens"], P["loss_fn"], P["teacher"],
                                       P["div_rows"], chunk_size=chunk_size, **MAIN_LOSS)
        else:
            loss, _ = loss_fn(hidden, P["weight"], P["tokens"], P["loss_fn"], P["teacher"], P["div_rows"], **MAIN_LOSS)
    loss.backward()
    return loss.detach()


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def check(P, chunk_size):
    """max |grad_fused - grad_naive| (and |loss diff|), both on the same problem."""
    out = {}
    for kind in ("naive", "fused"):
        P["h_leaf"].grad = P["weight"].grad = None
        loss = run_step(kind, P, chunk_size)
        out[kind] = (loss.float(), P["h_leaf"].grad.float(), P["weight"].grad.float())
    P["h_leaf"].grad = P["weight"].grad = None
    diffs = [(a - b).abs().max().item() for a, b in zip(out["naive"], out["fused"])]
    return {"loss_diff": diffs[0], "max_abs_grad_diff": max(diffs[1:]),
            "max_abs_grad": max(out["naive"][1].abs().max().item(), out["naive"][2].abs().max().item())}


def measure(kind, P, args):
    """Peak memory of a first run, then the median time of args.runs timed runs."""
    H, dtype, device = P["h_leaf"].shape[1], P["h_leaf"].dtype, P["h_leaf"].device
    # tiny warm-up (threads, kernels) that does not touch the measured sizes
    Q = make_problem(64, H, 1024, dtype, device, seed=1)
    run_step(kind, Q, args.chunk_size)
    del Q
    _sync(args.cuda)
    times, peak, loss = [], None, None
    for i in range(args.runs + 1):
        P["h_leaf"].grad = P["weight"].grad = None
        _sync(args.cuda)
        if i == 0:  # first run: peak memory (and warm-up for the timings)
            with PeakMemory(args.cuda) as m:
                loss = run_step(kind, P, args.chunk_size)
            peak = m.mb
        else:
            t0 = time.perf_counter()
            run_step(kind, P, args.chunk_size)
            _sync(args.cuda)
            times.append(time.perf_counter() - t0)
    P["h_leaf"].grad = P["weight"].grad = None
    return {"time_s": statistics.median(times), "times": times, "peak_mb": peak, "loss": loss.float().item()}


def dtype_of(args):
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]


def worker(args):
    N, H, V = args.size
    P = make_problem(N, H, V, dtype_of(args), "cuda" if args.cuda else "cpu")
    out = check(P, args.chunk_size) if args.worker == "check" else measure(args.worker, P, args)
    print(json.dumps(out))


def spawn(args, kind, size):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--size", *map(str, size),
           "--dtype", args.dtype, "--chunk-size", str(args.chunk_size), "--runs", str(args.runs)]
    if args.cuda:
        cmd.append("--cuda")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise RuntimeError(f"worker failed: {' '.join(cmd)}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


class InProcess:
    """--inprocess: every measurement in this process, on one problem per size."""

    def __init__(self, args):
        self.args, self.size, self.P = args, None, None

    def __call__(self, args, kind, size):
        if self.size != tuple(size):
            self.P = None
            if args.cuda:
                torch.cuda.empty_cache()
            self.P = make_problem(*size, dtype_of(args), "cuda" if args.cuda else "cpu")
            self.size = tuple(size)
        try:
            return check(self.P, args.chunk_size) if kind == "check" else measure(kind, self.P, args)
        finally:
            if args.cuda:
                torch.cuda.empty_cache()


def liger_unavailable(args):
    """None when Liger's fused linear JSD can run here, else the reason."""
    if not args.cuda:
        return "Liger's kernels are Triton (CUDA only)"
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (triton, transformers versions)
        return f"liger_kernel not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:200]
    return None


def ratio(a, b, digits=3):
    return round(a / b, digits) if a is not None and b else None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=KINDS + ("check",))
    ap.add_argument("--size", type=int, nargs=3, metavar=("N", "H", "V"), help="measure this size only")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--chunk-size", type=int, default=None, help="default: train.py's (128 on CPU, 512 on CUDA)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median)")
    ap.add_argument("--main-only", action="store_true", help="only the main size")
    ap.add_argument("--bf16-naive", choices=["auto", "on", "off"], default="auto",
                    help="the bf16-matmul naive column (auto: on for --dtype bf16)")
    ap.add_argument("--jsd", choices=["auto", "on", "off"], default="auto",
                    help="the full-vocab JSD comparison, fused vs Liger, at the main size (auto: on with --cuda)")
    ap.add_argument("--inprocess", action="store_true", help="measure in this process (no worker subprocesses)")
    args = ap.parse_args(argv)
    if args.chunk_size is None:  # what train.py uses on this device (loss_chunk = 0)
        args.chunk_size = train.loss_chunk_size({"loss_chunk": 0}, torch.device("cuda" if args.cuda else "cpu"))
    if args.worker:
        return worker(args)

    sizes = [tuple(args.size)] if args.size else CUDA_SIZES if args.cuda else CPU_SIZES
    if args.main_only:
        sizes = sizes[:1]
    run = InProcess(args) if args.inprocess else spawn
    bf16_naive = args.bf16_naive == "on" or (args.bf16_naive == "auto" and args.dtype == "bf16")
    jsd = args.jsd == "on" or (args.jsd == "auto" and args.cuda)
    dev = torch.cuda.get_device_name() if args.cuda else f"cpu x{torch.get_num_threads()} threads"
    print(f"device: {dev}  dtype: {args.dtype}  chunk_size: {args.chunk_size}  "
          f"loss: GRPO clip + 0.5 * JSD(alpha=0.5) top-100 + tail, 3/4 rows distilled"
          + ("" if args.inprocess else "  (one subprocess per measurement)"))
    if not bf16_naive:
        print("bf16 naive: off (fp32 inputs; --bf16-naive=on adds it); ratios are against the fp32 naive")
    print(f"{'N':>6} {'H':>5} {'V':>7} | {'naive s':>8} {'bf16nv s':>8} {'fused s':>8} {'speedup':>7} {'vs bf16':>7} | "
          f"{'naive MB':>9} {'bf16nv MB':>9} {'fused MB':>9} {'mem red.':>8} {'of bf16':>7}")
    results = []
    for size in sizes:
        n = run(args, "naive", size)
        b = run(args, "naive_bf16", size) if bf16_naive else None
        f = run(args, "fused", size)
        r = {"size": list(size), "naive_s": round(n["time_s"], 4), "fused_s": round(f["time_s"], 4),
             "naive_peak_mb": round(n["peak_mb"], 1), "fused_peak_mb": round(f["peak_mb"], 1),
             "naive_bf16_s": round(b["time_s"], 4) if b else None,
             "naive_bf16_peak_mb": round(b["peak_mb"], 1) if b else None}
        r["speedup"] = round(n["time_s"] / f["time_s"], 3)
        r["mem_reduction"] = round(1 - f["peak_mb"] / n["peak_mb"], 4)
        # the ratios the GPU targets are stated in: speed vs the bf16 naive, memory as a fraction of it
        r["speedup_vs_bf16_naive"] = ratio(b and b["time_s"], f["time_s"])
        r["mem_frac_of_bf16_naive"] = ratio(f["peak_mb"], b and b["peak_mb"], 4)
        results.append(r)
        fmt = lambda x, spec, unit="": format(x, spec) + unit if x is not None else "-".rjust(len(format(0.0, spec)) + len(unit))  # noqa: E731
        print(f"{size[0]:>6} {size[1]:>5} {size[2]:>7} | {r['naive_s']:>8.3f} {fmt(r['naive_bf16_s'], '>8.3f')} "
              f"{r['fused_s']:>8.3f} {r['speedup']:>6.2f}x {fmt(r['speedup_vs_bf16_naive'], '>6.2f', 'x')} | "
              f"{r['naive_peak_mb']:>9.1f} {fmt(r['naive_bf16_peak_mb'], '>9.1f')} {r['fused_peak_mb']:>9.1f} "
              f"{100 * r['mem_reduction']:>7.1f}% "
              f"{fmt(None if r['mem_frac_of_bf16_naive'] is None else 100 * r['mem_frac_of_bf16_naive'], '>6.1f', '%')}",
              flush=True)
    chk = run(args, "check", sizes[0])
    print(f"main size: max |grad fused - grad naive| = {chk['max_abs_grad_diff']:.3e} "
          f"(max |grad| {chk['max_abs_grad']:.3e}), |loss diff| = {chk['loss_diff']:.3e}")
    main_r = dict(results[0])
    main_r.pop("size")
    main_r["max_abs_grad_diff"] = chk["max_abs_grad_diff"]
    main_r["max_abs_grad"] = chk["max_abs_grad"]
    main_r["size"] = list(sizes[0])
    main_r["chunk_size"] = args.chunk_size
    main_r["device"] = dev
    main_r["dtype"] = args.dtype
    main_r["other_sizes"] = results[1:]

    # the full-vocab JSD alone, at the main size: the fused loss vs Liger on the same inputs
    jsd_r = None
    if jsd:
        jsd_r = {"liger_skipped": liger_unavailable(args)}
        fj = run(args, "fused_jsd", sizes[0])
        jsd_r.update(fused_s=round(fj["time_s"], 4), fused_peak_mb=round(fj["peak_mb"], 1), fused_loss=fj["loss"])
        line = f"JSD alone (full vocab, alpha = beta = 0.5, mean over distilled rows): fused {fj['time_s']:.4f} s " \
               f"{fj['peak_mb']:.1f} MB"
        if jsd_r["liger_skipped"] is None:
            try:
                lg = run(args, "liger", sizes[0])
                jsd_r.update(liger_s=round(lg["time_s"], 4), liger_peak_mb=round(lg["peak_mb"], 1), liger_loss=lg["loss"],
                             fused_over_liger=ratio(fj["time_s"], lg["time_s"]),
                             mem_frac_of_liger=ratio(fj["peak_mb"], lg["peak_mb"], 4),
                             loss_rel_diff=abs(fj["loss"] - lg["loss"]) / max(abs(lg["loss"]), 1e-30))
                line += f" | Liger {lg['time_s']:.4f} s {lg['peak_mb']:.1f} MB | fused / Liger time " \
                        f"{jsd_r['fused_over_liger']:.2f}x, loss rel. diff {jsd_r['loss_rel_diff']:.1e}"
            except Exception as e:  # a broken Liger install must not hide the rest
                jsd_r["liger_skipped"] = f"Liger failed: {type(e).__name__}: {str(e)[:200]}"
        if jsd_r["liger_skipped"]:
            line += f" | Liger skipped: {jsd_r['liger_skipped']}"
        print(line)
    main_r["jsd"] = jsd_r
    main_r["liger_s"] = jsd_r.get("liger_s") if jsd_r else None
    print(json.dumps(main_r))
    return main_r


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:  # a worker failed: its stderr is above
        sys.exit(str(e))
