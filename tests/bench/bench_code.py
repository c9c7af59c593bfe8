"""
Code-reward throughput: programs/s of data/checkers.py's check_code_many (the sandbox pool: one
harness per program, a fork per test, stop at the first failure, `workers` programs at a time)
against the plain baseline of one fresh `python` subprocess per test, run one after another (no
isolation at all: the floor of what a per-test subprocess costs). The programs are a rollout
batch's worth of stdin/stdout solutions to one problem with `tests` tests each, `wrong_frac` of them
wrong at a random test. Prints one JSON line last. Run it on an idle machine (figures for README).

    python tests/bench/bench_code.py                         # 256 programs x 10 tests, one worker per core
    python tests/bench/bench_code.py --programs=64 --workers=4
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from data import checkers, sandbox  # noqa: E402

CORRECT = "import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint(sum(nums))"


def workload(n_programs, n_tests, wrong_frac, seed=0):
    rng = random.Random(seed)
    tests = []
    for k in range(n_tests):
        nums = [rng.randint(-1000, 1000) for _ in range(rng.randint(1, 50))]
        tests.append({"input": " ".join(map(str, nums)) + "\n", "output": f"{sum(nums)}\n", "public": k == 0})
    answer = json.dumps({"tests": tests})
    programs = []
    for i in range(n_programs):
        if rng.random() < wrong_frac:  # wrong on inputs with more than m numbers: fails at some test
            m = rng.randint(1, 50)
            programs.append(CORRECT.replace("print(sum(nums))", f"print(sum(nums) if len(nums) <= {m} else 0)"))
        else:
            programs.append(CORRECT)
    return programs, answer, tests


def baseline(programs, tests, timeout=6.0):
    """One subprocess per test, sequential, stopping at a program's first failure."""
    scores = []
    for program in programs:
        ok = True
        for t in tests:
            try:
                p = subprocess.run([sys.executable, "-I", "-S", "-c", program], input=t["input"], capture_output=True,
                                   text=True, timeout=timeout)
                ok = p.returncode == 0 and checkers.same_output(p.stdout, t["output"])
            except subprocess.TimeoutExpired:
                ok = False
            if not ok:
                break
        scores.append(1.0 if ok else 0.0)
    return scores


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=256)
    p.add_argument("--tests", type=int, default=10)
    p.add_argument("--wrong_frac", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=0, help="sandboxes at a time (0 = one per core)")
    p.add_argument("--baseline_programs", type=int, default=32, help="the baseline is slow: its rate is measured on these")
    args = p.parse_args(argv)
    programs, answer, tests = workload(args.programs, args.tests, args.wrong_frac)
    responses = [f"```python\n{prog}\n```" for prog in programs]
    checkers.check_code_many(responses[:2], [answer] * 2, workers=1)  # warm up: imports, the first harness
    t0 = time.perf_counter()
    pool = checkers.check_code_many(responses, [answer] * len(responses), workers=args.workers)
    pool_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_serial = min(args.baseline_programs, len(programs))
    serial = checkers.check_code_many(responses[:n_serial], [answer] * n_serial, workers=1)
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    base = baseline(programs[:n_serial], tests)
    base_s = time.perf_counter() - t0
    assert [s for s, _ in pool[:n_serial]] == [s for s, _ in serial] == base, "the three runners disagree"
    workers = args.workers or os.cpu_count()
    out = {"programs": args.programs, "tests": args.tests, "wrong_frac": args.wrong_frac, "workers": workers,
           "cpus": os.cpu_count(), "isolation": sandbox.isolation(), "pass_rate": sum(s for s, _ in pool) / len(pool),
           "pool_programs_per_s": round(args.programs / pool_s, 2), "pool_s": round(pool_s, 2),
           "one_worker_programs_per_s": round(n_serial / serial_s, 2),
           "baseline_programs_per_s": round(n_serial / base_s, 2), "baseline_programs": n_serial,
           "speedup_vs_baseline": round((args.programs / pool_s) / (n_serial / base_s), 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
