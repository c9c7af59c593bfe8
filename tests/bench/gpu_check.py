"""One command for a GPU machine: is nanoSDPO correct on CUDA, does it train there, and how fast is it.

    python tests/bench/gpu_check.py --only=a,c,d --out=runs/gc   # one GPU, the first command (<= 4 min on an H200)
    python tests/bench/gpu_check.py --only=b,e --out=runs/gc     # the second command (~5 min)
    python tests/bench/gpu_check.py --cpu          # the same code paths at tiny sizes on the CPU (tests/test_bench.py)
    bash tests/bench/gpu_session.sh a,c,d          # on a machine without network: installs the carried .whl/ (Liger,
                                                   # tests/bench/gpu_wheels.sh), runs one command, gathers $OUT
Each command writes into --out (default: a new temp dir, kept): its table (gpu_check_<sections>.md),
the full JSON (gpu_check_<sections>.json), and the train.py runs with their logs (logs/); the table and
JSON go to --report-dir instead when given (gpu_session.sh: $OUT), rewritten after every section, so
a command killed outright (the device's limit: SIGKILL) keeps the sections that finished; it prints
the table and, last, a short JSON line (the verdicts and the files), well under the 12,000 characters
a device call returns.

Sections (each check prints PASS / FAIL with its numbers as it finishes):
  a  correctness on the device
       - train.fused_token_loss == train.naive_token_loss (the fp32 reference): fp32 inputs for every
         distill mode, bf16 inputs (bf16 products), and fp32 weights with bf16 products (autocast,
         as train.py runs on CUDA); relative errors of the loss and both gradients
       - train.generate(static=True) == the dynamic-cache decode with the device generator: the same
         tokens (fp32), and under bf16 autocast (train.py's CUDA rollouts) nearly all rows the same; the
         static decode through the bf16 decode weights ~ the one casting the fp32 weights every step
       - a resume on the device continues exactly: `python train.py` SDPO + EMA teacher 3 + 3
         iterations == 6 (tests/test_run_folder.py::test_resume_continues_exactly, on the device; on CUDA
         under torch.use_deterministic_algorithms, so only the resume itself can make them differ)
  b  a short toy SFT -> GRPO -> SDPO, `python train.py ... --device=<dev> --static_rollout=on`
     subprocesses: accuracy (mean@4 on toy/add) before and after, and seconds per phase; the SDPO run
     with --grad_checkpointing=True (the headline configs' setting: rollouts must keep their cache)
  c  tests/bench/bench_loss.py on the device (bf16 inputs, the main size N=8192 H=4096 V=128256): fused
     vs the fp32 naive and the bf16-matmul naive, and the full-vocab JSD against Liger's fused linear
     JSD when liger_kernel is importable (tests/bench/gpu_wheels.sh fetches its wheel to carry)
  d  rollout tokens/s at a random-init Qwen3-0.6B shape (toy tokenizer, vocab padded to 128) as
     train.py runs it: fp32 weights under bf16 autocast, the model in train mode with gradient
     checkpointing on: train.generate (dynamic cache), train.generate(static=True) (its compiled step
     reads bf16 copies of the weights: decoding.decode_weights) and HF generate (the same autocast);
     32 prompts x 8 samples x 128 new tokens, 1 warm-up (for static: the torch.compile) + 2 timed
     runs each; the number of graphs dynamo compiled

  e  the headline config's memory: config/sdpo_math.py's first 2 iterations, shortened (512 new tokens,
     4 prompts x 8) on toy prompts, through `python train.py` (this script's --train wrapper: a random-init
     Qwen3-4B shape, no checkpoint written): 2 finite iterations that distil (correctness), its CUDA
     peak (torch.cuda.max_memory_allocated) within memory_estimate.py's peak for the same settings, and
     the decode state that StepMemory frees before the first train step giving its memory back (targets)

Targets (GPU only; reported, exit code unaffected unless --strict): fused loss >= 1.0x the bf16
naive's speed and <= 15 % of its peak memory at the main size; the fused JSD within 1.2x of Liger's
time (an aim, when Liger is there); static rollout >= 3x HF generate's tokens/s; the headline run's
peak within its memory estimate, and >= 90 % of a freed decode state's bytes given back.
The exit code is non-zero when a correctness check fails or a section raises.

--cpu: tiny sizes; torch.compile runs with backend="eager" (dynamo traces the decode step as on
CUDA, inductor's minute of CPU code generation is skipped), in this process and, through this
script's --train wrapper, in the resume check's train.py runs; section b's runs use
--static_rollout=off there and overlap the other sections (CPU timings mean nothing here).

Budget on one H200, an estimate from reading the code (no GPU was lent when it was written; the
printed seconds tell): a ~1.7 min (three small compiles in this process while the resume runs, three
short train.py runs with their compiles, go on beside them), c ~1 min (the fp32 naive at the main
size is the slow column), d ~1.3 min (the 0.6B static compile, ~50 s, then 3 x 3 engines x 256 rows
x 128 tokens): `--only=a,c,d` ~4 min; b ~2.5 min (three train.py runs, each compiling its decode
step; SFT 250 iterations, GRPO and SDPO 20), e ~2.5 min (two 4B static compiles, ~65 s each: the student
eval's cache length, then the teacher eval's longer one, which the rollouts reuse; then 2 iterations of
32 rows x 512 tokens): `--only=b,e` ~5 min. ~9 min in all, plus each command's start. gpu_session.sh
stops a command at 540 s (GPU_CHECK_LIMIT) with SIGTERM: the train.py runs are stopped, and the table
and JSON of what ran are still written (the interrupted section an error).
"""
import sys

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--train":
    # `python tests/bench/gpu_check.py --train [--eager-compile] [--deterministic] -- <train.py args>`: runs
    # train.py as `python train.py <args>` would, after setting up what the flags ask for.
    import os
    import runpy
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags, args = sys.argv[2:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]
    import torch
    if "--eager-compile" in flags:
        real_compile = torch.compile
        torch.compile = lambda fn, mode=None, **kw: real_compile(fn, backend="eager", **kw)
    if "--deterministic" in flags:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if hasattr(torch.utils, "deterministic"):  # no NaN-filling of torch.empty: a plain run's kernels, minus the atomics
            torch.utils.deterministic.fill_uninitialized_memory = False
    sys.path.insert(0, root)
    shape = next((f.split("=", 1)[1] for f in flags if f.startswith("--random-init=")), None)
    if shape:  # section e: the run trains a random-init model of that shape (no hub), writes no checkpoint
        import atexit
        import checkpoint
        import models
        from tests.bench import gpu_check
        models.load_student = lambda init, dev, cfg: gpu_check.random_qwen3(shape, dev, cfg["tokenizer_path"])
        checkpoint.save = checkpoint.keep_as_good = lambda *a, **k: None  # a 4B checkpoint: 64 GB of disk
        if torch.cuda.is_available():  # the run's peak and what each free of the decode state gave back, the last line
            import decoding
            frees, free = [], decoding.free_decode_state  # StepMemory frees it through the module's name

            def measured_free():
                held, before = decoding.decode_state_bytes(), torch.cuda.memory_allocated()
                free()
                frees.append([held, before - torch.cuda.memory_allocated()])
            decoding.free_decode_state = measured_free
            # StepMemory resets the peak counter before every train step: the run's peak is the largest seen
            peaks, reset = [], torch.cuda.reset_peak_memory_stats

            def measured_reset(*a, **k):
                peaks.append(torch.cuda.max_memory_allocated())
                reset(*a, **k)
            torch.cuda.reset_peak_memory_stats = measured_reset
            atexit.register(lambda: print(f'{{"cuda_peak_bytes": {max(peaks + [torch.cuda.max_memory_allocated()])}, '
                                          f'"decode_state_frees": {frees}}}', flush=True))  # ints: JSON as printed
    sys.argv = [os.path.join(root, "train.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
import decoding  # noqa: E402
import runtime  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402
from tests.bench import bench_loss  # noqa: E402

SECTIONS = {"a": "correctness", "b": "toy SFT -> GRPO -> SDPO", "c": "loss benchmark", "d": "rollout tokens/s",
            "e": "the headline config's memory"}
# a model small enough that a few train.py iterations take seconds (tests/conftest.py's TINY)
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128", "--eval_max_prompts=4", "--eval_n=2",
        "--batch_prompts=4", "--group_size=4", "--micro_batch_size=8", "--max_new_tokens=8", "--warmup_iters=1",
        "--eval_interval=0", "--topk=10", "--loss_chunk=16"]
RESUME_KEYS = ("loss", "reward", "resp_len", "div", "distill_frac", "grad_norm")


class Check:
    """Settings (cpu or cuda), the results, and printing. Thread-safe enough: one line per print."""

    def __init__(self, args):
        self.cpu = args.cpu
        self.dev = torch.device("cpu" if args.cpu else "cuda")
        self.out = args.out
        self.rows, self.errors, self.seconds = [], {}, {}
        self.children, self.current = [], None  # the train.py runs started; the section running
        self.lock = threading.RLock()
        self.stdout = sys.stdout  # the real one: section c captures bench_loss's prints through a redirect

    def say(self, section, text):
        with self.lock:
            for line in str(text).splitlines() or [""]:
                self.stdout.write(f"[{section}] {line}\n")
            self.stdout.flush()

    def add(self, section, name, status, summary, numbers=None, kind="correctness"):
        """One check: status PASS / FAIL (or SKIP / INFO); kind correctness, target or aim."""
        row = dict(section=section, name=name, status=status, kind=kind, summary=summary, numbers=numbers or {})
        with self.lock:
            self.rows.append(row)
        self.say(section, f"{status} {name}: {summary}")
        return row

    def target(self, section, name, ok, summary, numbers, kind="target"):
        """A GPU performance target: PASS / FAIL on CUDA, INFO on a CPU (not a target there)."""
        status = ("PASS" if ok else "FAIL") if not self.cpu else "INFO"
        return self.add(section, name, status, summary + (" (cpu: not a target)" if self.cpu else ""), numbers, kind)

    @contextlib.contextmanager
    def guard(self, section, name):
        """A check that raises is a FAIL with the exception in one line; the next check still runs."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - report and carry on
            self.add(section, name, "FAIL", f"raised {one_line(e)}")

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()


def one_line(e):
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300]


def fmt(x):
    return "-" if x is None else f"{x:.3f}"


def compiled_graphs():
    """Graphs dynamo has compiled in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def reset_compile():
    """A fresh torch.compile state: the static path compiles as it would in a new process."""
    torch._dynamo.reset()
    decoding._compiled_steps.clear()
    decoding.free_decode_state()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def eager_compile():
    """torch.compile -> backend="eager" in this process (tests/test_rollout.py's way)."""
    real = torch.compile
    torch.compile = lambda fn, mode=None, **kw: real(fn, backend="eager", **kw)


# ============================================================================= a: correctness

def rel(a, b):
    """||a - b|| / ||b|| (0 when both are 0)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def loss_and_grads(P, fn, **kw):
    P["h_leaf"].grad = P["weight"].grad = None
    hidden = P["h_leaf"] * 1.0
    loss, _ = fn(hidden, P["weight"], P["tokens"], P["loss_fn"], P["teacher"], P["div_rows"], **kw)
    loss.backward()
    out = loss.detach().double(), P["h_leaf"].grad.double(), P["weight"].grad.double()
    P["h_leaf"].grad = P["weight"].grad = None
    return out


def check_fused_vs_naive(C):
    N, H, V, chunk, topk = (4000, 1024, 32768, 512, 100) if not C.cpu else (200, 32, 1024, 48, 20)
    groups = [  # (name, input dtype, matmul dtype, distill modes, tolerance on the relative errors)
        ("fp32", torch.float32, None, ("topk", "full", "token"), 1e-4),
        ("bf16 inputs (bf16 products)", torch.bfloat16, None, ("topk", "full"), 3e-2),
        ("fp32 weights, bf16 products (autocast)", torch.float32, torch.bfloat16, ("topk", "full"), 3e-2),
    ]
    for name, dtype, mm, modes, tol in groups:
        title = f"fused == naive, {name}"
        with C.guard("a", title):
            worst = {"loss": 0.0, "grad_h": 0.0, "grad_w": 0.0}
            for i, distill in enumerate(modes):
                P = bench_loss.make_problem(N, H, V, dtype, C.dev, seed=10 + i)
                # a smooth loss (a policy-gradient term and the divergence): with the PPO clip, rounding
                # (even fp32's, over thousands of rows) can move a row across a clip edge, where its
                # gradient jumps; tests/test_loss.py checks the clipped loss (on a CPU, fp64 and fp32)
                c = torch.randn(N, generator=torch.Generator().manual_seed(i)).to(C.dev)
                P["loss_fn"] = lambda logp, div, tlogp, rows, c=c: (c[rows] * logp + 0.5 * div).sum() / N
                kw = dict(alpha=0.5, distill=distill, topk=topk, tail=True, temperature=0.8)
                ref = loss_and_grads(P, train.naive_token_loss, **kw)
                got = loss_and_grads(P, train.fused_token_loss, chunk_size=chunk, matmul_dtype=mm, **kw)
                errs = {"loss": abs(got[0] - ref[0]).item() / max(abs(ref[0]).item(), 1e-12),
                        "grad_h": rel(got[1], ref[1]), "grad_w": rel(got[2], ref[2])}
                worst = {k: max(worst[k], v) for k, v in errs.items()}
                del P
            ok = all(math.isfinite(v) and v <= tol for v in worst.values())
            C.add("a", title, "PASS" if ok else "FAIL",
                  f"{'/'.join(modes)}, N={N} H={H} V={V} chunk {chunk}: max rel. err loss {worst['loss']:.1e}, "
                  f"grad_h {worst['grad_h']:.1e}, grad_w {worst['grad_w']:.1e} (tol {tol:g})",
                  dict(worst, tol=tol, size=[N, H, V], modes=list(modes)))


def toy_model(C, n_layer=2, n_embd=64):
    cfg = dict(tokenizer_path=os.path.join(ROOT, "data", "toy", "tokenizer"), n_embd=n_embd, n_layer=n_layer,
               n_head=4, block_size=256, seed=0)
    model, tokenizer = models.load_model("scratch", C.dev, scratch=cfg)
    return model.eval(), tokenizer


def check_static_vs_dynamic(C):
    reset_compile()
    model, tok = toy_model(C)
    tasks = train.load_tasks("toy/add", "test", os.path.join(ROOT, "data"))[:8]
    prompts = [train.prompt_ids(tok, t["messages"]) for t in tasks]
    eos = train.stop_token_ids(model, tok)
    max_new = 24 if not C.cpu else 12

    def gen(static, autocast):
        with autocast():
            return train.generate(model, prompts, group_size=4, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                                  eos_ids=eos, pad_id=tok.pad_token_id, generator=train.make_generator(7, C.dev),
                                  static=static)

    def compare(a, b):
        same = [x == y for x, y in zip(a.response_ids, b.response_ids)]
        diffs = []  # log-prob differences over each row's common prefix (the same tokens)
        for x, y, lx, ly in zip(a.response_ids, b.response_ids, a.old_logprobs, b.old_logprobs):
            n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            if n:
                diffs.append((lx[:n] - ly[:n]).abs().max().item())
        return sum(same) / len(same), max(diffs, default=0.0)

    name = "static == dynamic decode, fp32, device generator"
    with C.guard("a", name):
        t0 = time.perf_counter()
        dyn = gen(False, contextlib.nullcontext)
        first = gen(True, contextlib.nullcontext)
        compile_s = time.perf_counter() - t0
        again = gen(True, contextlib.nullcontext)  # reuses the static cache buffers and the compiled step
        (f1, d1), (f2, d2) = compare(first, dyn), compare(again, dyn)
        tol = 1e-3 if not C.cpu else 1e-5
        stopped = sum(not t for t in dyn.truncated)
        ok = f1 == 1.0 and f2 == 1.0 and max(d1, d2) <= tol and bool(decoding._compiled_steps)
        C.add("a", name, "PASS" if ok else "FAIL",
              f"{len(dyn.response_ids)} rows x {max_new} tokens ({stopped} stop at an EOS): identical rows "
              f"{f1:.0%} / {f2:.0%} (first / second static call), max abs log-prob diff {max(d1, d2):.1e} (tol {tol:g}); "
              f"dynamic + first static (compile) {compile_s:.1f} s",
              dict(same_rows=[f1, f2], max_logprob_diff=max(d1, d2), tol=tol, rows=len(dyn.response_ids),
                   eos_rows=stopped, compile_s=round(compile_s, 2)))

    name = "static ~ dynamic decode, bf16 autocast (train.py's CUDA rollout)"
    # fresh static caches and compile, as in a new process (under autocast the cached keys are fp32 --
    # RoPE promotes them -- and the values bf16: decoding.static_decoding keys its caches by both)
    reset_compile()
    with C.guard("a", name):
        autocast = runtime.make_autocast(C.dev, "bfloat16")
        dyn, st = gen(False, autocast), gen(True, autocast)
        frac, diff = compare(st, dyn)
        # bf16 rounding differs between eager and compiled kernels: a near-tie may sample another
        # token, after which a row differs; the log-probs up to there must agree to bf16 precision
        ok = frac >= 0.75 and diff <= 0.05
        C.add("a", name, "PASS" if ok else "FAIL",
              f"identical rows {frac:.0%} (need >= 75%), max abs log-prob diff on the common prefix {diff:.1e} (tol 0.05)",
              dict(same_rows=frac, max_logprob_diff=diff))

    name = "static decode: bf16 decode weights ~ fp32 weights cast every step (bf16 autocast)"
    with C.guard("a", name):
        real = train.decode_weights
        train.decode_weights = lambda model, enabled=True: real(model, enabled=False)  # the step casts (a recompile)
        try:
            casting = gen(True, autocast)
        finally:
            train.decode_weights = real
        frac, diff = compare(st, casting)
        # the same bf16 values reach the same matmuls; only the compiled graphs differ (casts in or out)
        ok = frac >= 0.75 and diff <= 0.05
        C.add("a", name, "PASS" if ok else "FAIL",
              f"identical rows {frac:.0%} (need >= 75%), max abs log-prob diff on the common prefix {diff:.1e} (tol 0.05)",
              dict(same_rows=frac, max_logprob_diff=diff))
    reset_compile()  # drops the compiled steps' hold on the model


def train_cmd(C, args, wrapper=()):
    """`python train.py args` (CUDA, no wrapper) or through this script's --train wrapper."""
    if not wrapper:
        return [sys.executable, os.path.join(ROOT, "train.py"), *args]
    return [sys.executable, os.path.abspath(__file__), "--train", *wrapper, "--", *args]


def cpu_wrapper(C):
    return ("--eager-compile",) if C.cpu else ()


def start_train(C, tag, args, wrapper=(), env=None):
    """Start a train.py subprocess, stdout/stderr to files in the out dir; returns (Popen, log path, t0)."""
    os.makedirs(os.path.join(C.out, "logs"), exist_ok=True)
    log = os.path.join(C.out, "logs", tag)
    env = dict(os.environ, **(env or {}))
    if C.cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        proc = subprocess.Popen(train_cmd(C, args, wrapper), cwd=ROOT, stdout=out, stderr=err, env=env)
    C.children.append(proc)
    return proc, log, time.perf_counter()


def finish_train(C, started, timeout=300):
    """Wait for a started train.py; raise with its last error line if it failed. Returns wall seconds."""
    proc, log, t0 = started
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"train.py timed out after {timeout} s (log {log}.err)")
    if rc != 0:
        with open(log + ".err") as f:
            lines = [x for x in f.read().splitlines() if x.strip()]
        with open(log + ".out") as f:
            lines += [x for x in f.read().splitlines() if x.startswith("error:")]
        raise RuntimeError(f"train.py exit {rc}: {(lines or ['?'])[-1][:250]} (log {log}.err)")
    return time.perf_counter() - t0


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def start_resume(C):
    """The resume check's runs: 6 iterations, and 3 (with a checkpoint) at the same time; returns them."""
    base = os.path.join(C.out, "resume")
    common = ["config/sdpo_toy.py", *TINY, "--dataset=toy/add", "--init_from=scratch", "--success_threshold=0.0",
              "--teacher=ema", "--density=0.5", "--learning_rate=1e-2", f"--device={C.dev.type}", "--static_rollout=on"]
    # CUDA: deterministic kernels, so that two runs can only differ by what the resume restores
    wrapper = cpu_wrapper(C) if C.cpu else ("--deterministic",)
    env = {"OMP_NUM_THREADS": "1"} if C.cpu else {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    full = start_train(C, "resume_full", [*common, f"--out_dir={base}/full", "--max_iters=6"], wrapper, env)
    split = start_train(C, "resume_split", [*common, f"--out_dir={base}/split", "--save_interval=3",
                                            "--stages=toy/add:3"], wrapper, env)  # 3 iterations, a checkpoint ...
    return dict(base=base, common=common, wrapper=wrapper, env=env, full=full, split=split)


def finish_resume(C, runs):
    name = "resume continues exactly (3 + 3 == 6 iterations, SDPO + EMA)"
    with C.guard("a", name):
        base = runs["base"]
        finish_train(C, runs["full"])
        finish_train(C, runs["split"])
        finish_train(C, start_train(C, "resume_resume", [*runs["common"], f"--out_dir={base}/split",
                                                         "--init_from=resume", "--stages=toy/add:3,toy/add:3"],
                                    runs["wrapper"], runs["env"]))  # ... then 3 more in a new process
        a = [r for r in read_log(f"{base}/full") if "loss" in r]
        b = [r for r in read_log(f"{base}/split") if "loss" in r]
        iters_ok = [r["iter"] for r in b] == [1, 2, 3, 4, 5, 6] and [r["iter"] for r in a] == [1, 2, 3, 4, 5, 6]
        worst, first_bad = 0.0, None
        for x, y in zip(a, b):
            for key in RESUME_KEYS:
                d = abs(x[key] - y[key])
                worst = max(worst, d / max(abs(x[key]), 1e-30))
                if d > max(1e-6 * abs(y[key]), 1e-9) and first_bad is None:  # pytest.approx(rel=1e-6, abs=1e-9)
                    first_bad = f"iter {x['iter']} {key}: {x[key]!r} vs {y[key]!r}"
        ok = iters_ok and first_bad is None
        C.add("a", name, "PASS" if ok else "FAIL",
              f"{', '.join(RESUME_KEYS)} at every iteration: max rel. diff {worst:.1e} (tol 1e-6), static rollout"
              + ("" if iters_ok else f"; iterations {[r['iter'] for r in b]}") + (f"; first: {first_bad}" if first_bad else "")
              + (", deterministic algorithms" if not C.cpu else ""),
              dict(max_rel_diff=worst, first_mismatch=first_bad, iters_ok=iters_ok))


def section_a(C):
    runs = None
    with C.guard("a", "resume continues exactly (3 + 3 == 6 iterations, SDPO + EMA)"):
        runs = start_resume(C)  # subprocesses: they run while the in-process checks do
    check_fused_vs_naive(C)
    check_static_vs_dynamic(C)
    if runs:
        finish_resume(C, runs)


# ============================================================================= b: toy SFT -> GRPO -> SDPO

def phase_summary(out_dir, wall):
    log = read_log(out_dir)
    steps = [r for r in log if "loss" in r]
    evals = [r for r in log if "eval_tag" in r]  # one record per eval: eval/<set>/mean@n per set
    acc_key = next((k for k in (evals[0] if evals else {}) if k.startswith("eval/") and "/mean@" in k
                    and "teacher" not in k), None)
    start = next((r[acc_key] for r in evals if r["eval_tag"] == "start"), None)
    end = next((r[acc_key] for r in reversed(evals) if r["eval_tag"].startswith("end of stage")), None)
    return dict(iters=len(steps), finite=all(math.isfinite(r["loss"]) for r in steps),
                acc_start=start, acc_end=end, acc_metric=acc_key, wall_s=round(wall, 2),
                loop_s=round(sum(r["iter_s"] for r in steps), 2), gen_s=round(sum(r.get("gen_s", 0.0) for r in steps), 2),
                tokens=sum(r["tokens"] for r in steps), losses=[r["loss"] for r in steps],
                distill_frac=statistics.mean(r["distill_frac"] for r in steps) if steps and "distill_frac" in steps[0] else None)


def section_b(C):
    out = os.path.join(C.out, "toy")
    dev = [f"--device={C.dev.type}", f"--static_rollout={'off' if C.cpu else 'on'}"]
    if C.cpu:
        C.say("b", "cpu: --static_rollout=off here (a minute of inductor compile per run on a CPU); the static path "
                   "through train.py is covered by a's resume runs (eager-backend compile)")
        sft_iters, rl_iters = 20, 2
        size = [*TINY, "--eval_max_prompts=8"]
        sft = ["config/toy_base.py", *size, "--learning_rate=3e-3", f"--stages=toy/add:{sft_iters}"]
        rl_extra = ["--success_threshold=0.0"]  # a 20-iteration model never succeeds: let the SDPO teacher run anyway
    else:
        sft_iters, rl_iters = 250, 20
        evals = ["--eval_interval=0", "--eval_max_prompts=64", "--eval_n=4"]
        sft = ["config/toy_base.py", *evals, "--micro_batch_size=64", f"--stages=toy/add:{sft_iters}"]
        rl_extra = evals
    runs = [("SFT", [*sft, "--eval_sets=toy/add", f"--out_dir={out}/sft"], sft_iters)]
    for algo in ("grpo", "sdpo"):
        # SDPO with gradient checkpointing, as the headline configs train: its rollouts must keep their KV cache
        ckpt = ["--grad_checkpointing=True"] if algo == "sdpo" else []
        runs.append((algo.upper(), [f"config/{algo}_toy.py", *(size if C.cpu else []), *rl_extra, *ckpt, "--dataset=toy/add",
                                    f"--init_from={out}/sft/ckpt", f"--out_dir={out}/{algo}", f"--max_iters={rl_iters}"],
                     rl_iters))
    sft_ok = False
    for phase, args, iters in runs:
        name = f"{phase}, {iters} iterations on toy/add" + (", grad_checkpointing" if phase == "SDPO" else "")
        if phase != "SFT" and not sft_ok:
            C.add("b", name, "FAIL", "not run: the SFT phase failed")
            continue
        with C.guard("b", name):
            wall = finish_train(C, start_train(C, phase.lower(), [*args, *dev]))
            s = phase_summary(os.path.join(out, phase.lower()), wall)
            ok = s["iters"] == iters and s["finite"]
            extra = ""
            if phase == "SFT":  # it must have learned: the loss falls
                q = max(1, iters // 4)
                first, last = statistics.mean(s["losses"][:q]), statistics.mean(s["losses"][-q:])
                ok = ok and last < first
                extra = f"; loss {first:.3g} -> {last:.3g}"
                sft_ok = ok
            elif phase == "SDPO":
                extra = f"; distilled token fraction {fmt(s['distill_frac'])}"
            s.pop("losses")
            C.add("b", name, "PASS" if ok else "FAIL",
                  f"{s['acc_metric']} {fmt(s['acc_start'])} -> {fmt(s['acc_end'])}; {s['wall_s']:.1f} s wall "
                  f"(iterations {s['loop_s']:.1f} s, of which generation {s['gen_s']:.1f} s; the rest: start-up, "
                  f"compile, evals, checkpoints){extra}", s)


# ============================================================================= c: the loss benchmark

def section_c(C):
    if C.cpu:
        argv = ["--size", "256", "32", "2048", "--dtype", "bf16", "--runs", "1", "--jsd", "on", "--inprocess"]
    else:
        argv = ["--cuda", "--dtype", "bf16", "--main-only", "--inprocess"]
    C.say("c", f"tests/bench/bench_loss.py {' '.join(argv)}")
    buf = _Tee(lambda line: C.say("c", line))
    with contextlib.redirect_stdout(buf):
        r = bench_loss.main(argv)
    buf.flush()
    size = "x".join(map(str, r["size"]))
    # not a correctness check: at bf16 precision rows near the PPO clip's edges may fall on the other
    # side (their gradient jumps); section a compares the two with a smooth loss
    grad_rel = r["max_abs_grad_diff"] / max(r["max_abs_grad"], 1e-30)
    C.add("c", f"fused vs naive at {size}, bf16 inputs", "INFO",
          f"max abs grad diff / max abs grad {grad_rel:.1e} (GRPO clip: rows at the clip edges may flip at bf16 "
          f"precision; exactness is section a's)", dict(grad_rel=grad_rel), kind="info")
    C.target("c", f"fused speed >= 1.0x bf16 naive at {size}", (r["speedup_vs_bf16_naive"] or 0) >= 1.0,
             f"bf16 naive {r['naive_bf16_s']:.4f} s, fused {r['fused_s']:.4f} s: {r['speedup_vs_bf16_naive']:.2f}x "
             f"(fp32 naive {r['naive_s']:.4f} s)", {k: r[k] for k in ("naive_bf16_s", "fused_s", "naive_s", "speedup_vs_bf16_naive")})
    C.target("c", f"fused peak <= 15% of bf16 naive at {size}", (r["mem_frac_of_bf16_naive"] or 1) <= 0.15,
             f"bf16 naive {r['naive_bf16_peak_mb']:.0f} MB, fused {r['fused_peak_mb']:.0f} MB: " + (
                 f"{100 * r['mem_frac_of_bf16_naive']:.1f}%" if r["mem_frac_of_bf16_naive"] is not None else
                 "no ratio (a CPU peak is RSS growth: memory the process already held does not show)"),
             {k: r[k] for k in ("naive_bf16_peak_mb", "fused_peak_mb", "naive_peak_mb", "mem_frac_of_bf16_naive")})
    j = r["jsd"]
    name = f"fused JSD within 1.2x of Liger's time at {size}"
    if j.get("liger_skipped"):
        C.add("c", name, "SKIP", f"{j['liger_skipped']}; fused full-vocab JSD {j['fused_s']:.4f} s, "
              f"{j['fused_peak_mb']:.0f} MB", j, kind="aim")
    else:
        C.target("c", name, j["fused_over_liger"] <= 1.2,
                 f"Liger {j['liger_s']:.4f} s {j['liger_peak_mb']:.0f} MB, fused {j['fused_s']:.4f} s "
                 f"{j['fused_peak_mb']:.0f} MB: {j['fused_over_liger']:.2f}x; loss rel. diff {j['loss_rel_diff']:.1e}",
                 j, kind="aim")
    return r


class _Tee:
    """A file-like object that hands complete lines to a function."""

    def __init__(self, fn):
        self.fn, self.buf = fn, ""

    def write(self, s):
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.fn(line)
        return len(s)

    def flush(self):
        if self.buf:
            self.fn(self.buf)
            self.buf = ""


# ============================================================================= d: rollout tokens/s

# --cpu's stand-in for memory_estimate.ARCH's Qwen3 shapes (random_qwen3's "tiny")
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, tie_word_embeddings=True)


def section_d(C):
    reset_compile()
    shape, n_prompts, group, max_new, runs = ("qwen3-0.6b", 32, 8, 128, 2) if not C.cpu else ("tiny", 4, 2, 16, 2)
    # as train.py runs it: fp32 master weights, bf16 autocast (CUDA), train mode with gradient checkpointing
    autocast = runtime.make_autocast(C.dev, "bfloat16" if not C.cpu else "float32")
    model, tok = random_qwen3(shape, C.dev, os.path.join(ROOT, "data", "toy", "tokenizer"), vocab=128)
    model.train()
    models.enable_grad_checkpointing(model)
    tasks = train.load_tasks("toy/sort", "test", os.path.join(ROOT, "data"))[:n_prompts]
    prompts = [train.prompt_ids(tok, t["messages"]) for t in tasks]
    eos, pad = train.stop_token_ids(model, tok), tok.pad_token_id
    ids, mask = (t.to(C.dev) for t in models.pad_batch(prompts, pad, left=True))
    params = sum(p.numel() for p in model.parameters())
    C.say("d", f"Qwen3 {shape} shape, {params / 1e6:.0f}M params, fp32 weights" + (" under bf16 autocast" if not C.cpu else "")
          + f", train mode + grad checkpointing; {n_prompts} prompts x {group} samples x {max_new} new tokens (prompt "
            f"length {ids.shape[1]}); 1 warm-up + {runs} timed runs each, interleaved")

    def ours(seed, static):
        g = train.make_generator(seed, C.dev)
        C.sync()
        t0 = time.perf_counter()
        with autocast():
            r = train.generate(model, prompts, group_size=group, max_new_tokens=max_new, temperature=1.0, top_p=1.0,
                               eos_ids=eos, pad_id=pad, generator=g, static=static)
        C.sync()
        return time.perf_counter() - t0, sum(len(x) for x in r.response_ids)

    def hf(seed):
        torch.manual_seed(seed)
        C.sync()
        t0 = time.perf_counter()
        with torch.no_grad(), autocast(), models.eval_mode(model):
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 num_return_sequences=group, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad)
        C.sync()
        dt = time.perf_counter() - t0
        return dt, int(train.response_mask(out[:, ids.shape[1]:].cpu(), eos).sum())

    engines = {"dynamic": lambda s: ours(s, False), "static": lambda s: ours(s, True), "hf": hf}
    compiled = {}
    labels = {"dynamic": "train.generate", "static": "train.generate(static=True)", "hf": "HF generate"}
    res, warm = {}, {}
    for name, fn in engines.items():
        with C.guard("d", f"{labels[name]} warm-up"):
            graphs = compiled_graphs()
            t0 = time.perf_counter()
            fn(0)
            warm[name] = time.perf_counter() - t0
            compiled[name] = compiled_graphs() - graphs
            res[name] = []
    graphs_after_warmup = compiled_graphs()
    for r in range(runs):  # interleaved, so that drifts hit every engine alike
        for name in (list(res) if r % 2 == 0 else list(res)[::-1]):
            with C.guard("d", f"{labels[name]} run {r + 1}"):
                res[name].append(engines[name](1 + r))
    summary = {}
    for name, rs in res.items():
        if rs:
            s, n = statistics.median(t for t, _ in rs), statistics.median(n for _, n in rs)
            summary[name] = dict(s=round(s, 4), tokens=n, tok_s=round(statistics.median(n / t for t, n in rs), 1),
                                 warmup_s=round(warm[name], 2), runs_s=[round(t, 4) for t, _ in rs],
                                 compiled_graphs_warmup=compiled[name], compiled_graphs_total=compiled_graphs())
            C.add("d", f"{labels[name]} tokens/s", "INFO",
                  f"{summary[name]['tok_s']:.0f} tok/s ({s:.3f} s for {n:.0f} tokens; warm-up {warm[name]:.1f} s"
                  + (f", the compile: {compiled[name]} graph(s)" if name == "static" else "") + ")", summary[name],
                  kind="info")
    if "static" in summary and "hf" in summary:
        x = summary["static"]["tok_s"] / summary["hf"]["tok_s"]
        y = summary["static"]["tok_s"] / summary["dynamic"]["tok_s"] if "dynamic" in summary else float("nan")
        C.target("d", f"static rollout >= 3x HF generate ({shape} shape)", x >= 3.0,
                 f"{x:.2f}x HF generate's tokens/s ({y:.2f}x the dynamic path)",
                 dict(static_over_hf=round(x, 3), static_over_dynamic=round(y, 3)))
    if "static" in summary:  # every timed run reuses the warm-up's graphs: a recompile would show here
        C.add("d", "compiles of the static decode step", "INFO",
              f"{compiled['static']} graph(s) in the warm-up, {compiled_graphs() - graphs_after_warmup} in the "
              f"{runs} timed runs after it", dict(warmup=compiled["static"], after=compiled_graphs() - graphs_after_warmup),
              kind="info")
    reset_compile()  # drops the compiled steps' hold on the model (freed on return)
    return summary


# ============================================================================= e: the headline config's memory

def random_qwen3(shape, dev, tokenizer_path, vocab=None):
    """(model, tokenizer): a random-init Qwen3 of memory_estimate's ARCH shape (default vocabulary: its
    151936) or TINY_QWEN3 ("tiny"; default: the toy vocabulary padded to 128), fp32 on dev, checked as
    load_model checks, with the tokenizer at tokenizer_path (the toy one: its ids are within the vocabulary)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from tests.bench.memory_estimate import ARCH, VOCAB
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    arch = TINY_QWEN3 if shape == "tiny" else ARCH[shape]
    cfg = Qwen3Config(vocab_size=vocab or (128 if shape == "tiny" else VOCAB), max_position_embeddings=8192,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, **arch)
    torch.manual_seed(0)
    with dev:  # initialised on the device: seconds, not minutes of CPU init at 4B
        model = Qwen3ForCausalLM(cfg)
    model = model.to(dev, torch.float32)
    models.check_model(model)
    return model, tok


def section_e(C):
    """config/sdpo_math.py's first iterations (EMA teacher, gradient checkpointing, gen_batch_size, the
    fused loss, static rollout), shortened (512 new tokens, 4 prompts x 8: one rollout chunk) and on the
    toy prompts, on a random-init Qwen3-4B shape; its CUDA peak against memory_estimate.py's peak for the
    same settings."""
    from tests.bench import memory_estimate
    shape = "qwen3-4b" if not C.cpu else "tiny"
    max_new = 512 if not C.cpu else 8
    settings = [f"--max_new_tokens={max_new}", "--batch_prompts=4", "--max_iters=2", "--eval_interval=0",
                "--eval_max_prompts=4", "--eval_n=8",  # evals of one rollout's 32 rows: no other compile shape
                "--warmup_iters=0", "--success_threshold=0.0"]  # every row a peer: the teacher forward runs
    args = ["config/sdpo_math.py", *settings, "--dataset=toy/add", "--eval_sets=toy/add",
            f"--tokenizer_path={os.path.join(ROOT, 'data', 'toy', 'tokenizer')}", f"--device={C.dev.type}",
            f"--static_rollout={'off' if C.cpu else 'on'}", f"--out_dir={os.path.join(C.out, 'headline')}"]
    if C.cpu:
        args += ["--micro_batch_size=8", "--topk=10", "--loss_chunk=16"]
    name = f"the headline config's first 2 iterations ({shape} shape, random init)"
    with C.guard("e", name):
        C.say("e", f"train.py {' '.join(args[:1] + settings)} on toy/add prompts, {shape} random init")
        started = start_train(C, "headline", args, wrapper=("--random-init=" + shape,) + (("--eager-compile",) if C.cpu else ()))
        wall = finish_train(C, started, timeout=480)
        steps = [r for r in read_log(os.path.join(C.out, "headline")) if "loss" in r]
        with open(started[1] + ".out") as f:
            memory = next((json.loads(line) for line in reversed(f.read().splitlines())
                           if line.startswith('{"cuda_peak_bytes"')), {})
        peak = memory.get("cuda_peak_bytes")
        tasks = train.load_tasks("toy/add", "train", os.path.join(ROOT, "data")) + train.load_tasks("toy/add", "test", os.path.join(ROOT, "data"))
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "toy", "tokenizer"))
        prompt_tokens = max(len(train.prompt_ids(tok, t["messages"])) for t in tasks)
        # the toy tokenizer spells the reprompt templates character by character: far more than the 64 template
        # tokens the estimate assumes for a real tokenizer, so the teacher prompt is counted generously
        teacher_tokens = prompt_tokens + max_new + 512
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            memory_estimate.main(["--config=config/sdpo_math.py", *settings, "--model=qwen3-4b",
                                  f"--prompt_tokens={prompt_tokens}", f"--teacher_prompt_tokens={teacher_tokens}"])
        est = json.loads(buf.getvalue().strip().splitlines()[-1])
        numbers = dict(iters=len(steps), wall_s=round(wall, 1), prompt_tokens=prompt_tokens, teacher_prompt_tokens=teacher_tokens,
                       estimate_peak_gb=est and est["peak_gb"], measured_peak_gb=peak and round(peak / 1e9, 1))
        ok = len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps) and all(r["distill_frac"] > 0 for r in steps)
        C.add("e", name, "PASS" if ok else "FAIL", f"{len(steps)} iterations in {wall:.0f} s, distilled token fraction "
              f"{fmt(statistics.mean(r['distill_frac'] for r in steps) if steps else None)}", numbers)
        if peak is None:  # the CPU: no device memory to measure
            C.add("e", "its CUDA peak within memory_estimate.py's", "INFO", f"no CUDA peak on the CPU (the 4B estimate "
                  f"for these settings: {est['peak_gb']} GB)", numbers, kind="info")
        else:
            C.target("e", "its CUDA peak within memory_estimate.py's", peak / 1e9 <= est["peak_gb"],
                     f"measured {peak / 1e9:.1f} GB vs estimated {est['peak_gb']} GB ({peak / 1e9 / est['peak_gb']:.0%})", numbers)
            report_decode_state_frees(C, memory.get("decode_state_frees", []))


def report_decode_state_frees(C, frees):
    """Whether freeing the decode state (StepMemory, before a train step it does not fit beside) gives its
    memory back, or whether something else (the CUDA graphs recorded on it, dynamo) still holds it: the
    estimate counts it as gone during the step. frees: [bytes held, bytes memory_allocated fell], each."""
    name = "the freed decode state gives back its memory"
    held, returned = sum(h for h, _ in frees), sum(r for _, r in frees)
    if not held:
        C.add("e", name, "INFO", "not freed in this run", dict(frees=frees), kind="info")
        return
    C.target("e", name, returned >= 0.9 * held, f"{len(frees)} free(s): {returned / 1e9:.2f} GB of the "
             f"{held / 1e9:.2f} GB held came back ({returned / held:.0%}; need >= 90%)", dict(frees=frees))


# ============================================================================= main

def table(rows, errors):
    lines = ["| sec | check | status | numbers |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['section']} | {r['name']} | {r['status']} | {r['summary'].replace('|', '/')} |")
    for s, e in errors.items():
        lines.append(f"| {s} | section raised | FAIL | {e} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (eager-backend compile): tests the script")
    ap.add_argument("--only", default="a,b,c,d,e", help="comma-separated sections to run (a,b,c,d,e)")
    ap.add_argument("--out", default=None, help="folder for the table, the JSON, the train.py runs and their logs "
                                                "(default: a new temp dir, kept)")
    ap.add_argument("--strict", action="store_true", help="also exit non-zero when a GPU target is missed")
    ap.add_argument("--serial", action="store_true", help="--cpu: run section b after a instead of beside the others")
    ap.add_argument("--report-dir", default=None, help="folder for the table and the JSON (default: --out); they are "
                    "rewritten after every section, so a command killed mid-way keeps what had finished")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if not only or any(s not in SECTIONS for s in only):
        ap.error(f"--only takes letters among {','.join(SECTIONS)}")
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: run on a GPU machine, or use --cpu for the tiny CPU version")
    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    os.makedirs(args.out, exist_ok=True)
    args.report_dir = os.path.abspath(args.report_dir or args.out)
    os.makedirs(args.report_dir, exist_ok=True)
    if not os.path.exists(os.path.join(ROOT, "data", "toy", "tokenizer", "tokenizer_config.json")) or \
            not os.path.exists(os.path.join(ROOT, "data", "toy", "add", "train.jsonl")):
        subprocess.run([sys.executable, os.path.join(ROOT, "data", "toy", "prepare.py")], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    C = Check(args)
    # gpu_session.sh's time limit: SIGTERM (or SIGINT) ends the sections but not the report. Set here, not inherited:
    # a process started in the background (a non-interactive shell's `&`, a pytest-xdist worker) ignores SIGINT
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    if args.cpu:
        eager_compile()
    try:
        import liger_kernel  # noqa: F401
        liger = getattr(liger_kernel, "__version__", "importable")
    except Exception as e:  # noqa: BLE001
        liger = f"not importable ({type(e).__name__})"
    import transformers
    device = torch.cuda.get_device_name() if not args.cpu else f"cpu x{torch.get_num_threads()} threads"
    print(f"gpu_check: {device}, torch {torch.__version__}, transformers {transformers.__version__}, liger_kernel "
          f"{liger}; sections {','.join(only)}; runs in {args.out}" + (" (cpu mode: tiny sizes)" if args.cpu else ""),
          flush=True)
    fns = {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e}
    t_start = time.perf_counter()

    def run_section(s):
        t0 = time.perf_counter()
        C.current = s
        C.say(s, f"== {s}: {SECTIONS[s]}")
        try:
            fns[s](C)
        except Exception as e:  # noqa: BLE001 - one section's failure must not hide the others
            C.errors[s] = one_line(e)
            if os.environ.get("GPU_CHECK_TRACE"):
                traceback.print_exc()
            C.say(s, f"FAIL section raised {one_line(e)}")
        C.seconds[s] = round(time.perf_counter() - t0, 1)
        C.say(s, f"== {s} done in {C.seconds[s]:.1f} s")

    order = {s: i for i, s in enumerate(SECTIONS)}
    tag = "".join(only)
    files = {"table": os.path.join(args.report_dir, f"gpu_check_{tag}.md"),
             "json": os.path.join(args.report_dir, f"gpu_check_{tag}.json"), "logs": os.path.join(args.out, "logs")}

    def write_report():
        """The table and the JSON of what has run so far (after every section: a kill keeps them)."""
        total = round(time.perf_counter() - t_start, 1)
        with C.lock:
            rows = sorted(C.rows, key=lambda r: order[r["section"]])  # stable: each section's checks in the order they ran
            errors, seconds = dict(C.errors), dict(C.seconds)
        correctness = {f"{r['section']}: {r['name']}": r["status"] for r in rows if r["kind"] == "correctness"}
        targets = {f"{r['section']}: {r['name']}": r["status"] for r in rows if r["kind"] in ("target", "aim")}
        correct = all(v == "PASS" for v in correctness.values()) and not errors
        targets_met = all(v in ("PASS", "SKIP", "INFO") for v in targets.values())
        not_run = [s for s in only if s not in seconds]
        verdict = "correctness: " + ("all PASS" if correct else "FAILED") + "; targets: " + \
                  ("met" if targets_met else "missed") + ("" if not args.cpu else " (cpu: not applied)") + \
                  (f"; not finished: {','.join(not_run)}" if not_run else "")
        report = "\n".join([f"## gpu_check: {device}" + (" (--cpu: tiny sizes)" if args.cpu else "") + f", torch "
                            f"{torch.__version__}, transformers {transformers.__version__}; {total:.0f} s (" +
                            ", ".join(f"{s} {seconds[s]:.0f} s" for s in only if s in seconds) + ")", "",
                            table(rows, errors), "", verdict])
        result = {"mode": "cpu" if args.cpu else "cuda", "device": device, "torch": torch.__version__,
                  "transformers": transformers.__version__, "liger_kernel": liger, "sections": only,
                  "seconds": seconds, "total_s": total, "correctness": correctness, "correctness_ok": correct,
                  "targets": targets, "targets_ok": targets_met, "errors": errors, "not_finished": not_run, "files": files}
        for key, text in (("table", report + "\n"), ("json", json.dumps(dict(result, checks=rows), indent=1, default=str))):
            with open(files[key] + ".tmp", "w") as f:
                f.write(text)
            os.replace(files[key] + ".tmp", files[key])  # whole or not there
        return report, result, correct and (targets_met or not args.strict)

    # --cpu: section b is subprocesses only; let it run beside the in-process sections
    background = args.cpu and not args.serial and "b" in only and len(only) > 1
    thread = threading.Thread(target=run_section, args=("b",)) if background else None
    if thread:
        thread.start()
    try:
        for s in only:
            if not (thread and s == "b"):
                run_section(s)
                write_report()
        if thread:
            thread.join()
    except KeyboardInterrupt:  # SIGTERM / SIGINT: gpu_session.sh's time limit; what ran is still written out below
        for proc in C.children:
            proc.kill()
        C.errors[C.current] = "interrupted (a signal: gpu_session.sh's time limit) in this section"
        C.say(C.current, f"FAIL {C.errors[C.current]}; sections not run: "
              f"{', '.join(s for s in only if s not in C.seconds and s != C.current) or 'none'}")
    report, result, ok = write_report()
    print()
    print(report)
    print(json.dumps(result, default=str))  # the short form: the checks' numbers are in files["json"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
