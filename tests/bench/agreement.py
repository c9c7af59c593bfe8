"""
How well the reward checkers agree with the real benchmarks' reference answers (local copies of the
test files in $NANOSDPO_BENCHMARK_DATA, default ../shared/data):
reference answers and solutions must be accepted, other items' answers and perturbed answers
rejected. tests/test_rewards_real.py asserts these rates; this script prints them.

    python tests/bench/agreement.py [--data_dir=../shared/data]

Prints a table, then the same numbers as one JSON line (the last line) for the README.
"""
import argparse
import glob
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.environ.get("NANOSDPO_BENCHMARK_DATA", os.path.join(REPO, "..", "shared", "data"))
sys.path.insert(0, REPO)  # as a script: the repo root on sys.path, for train.py and tests.*
import train as R  # noqa: E402  (reward(): the dispatch to data/checkers.py)


def load(data_dir, name):
    with open(os.path.join(data_dir, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check(name, cases, expect):
    """cases: [(kind, response, answer)]; returns {name, ok, n, rate, failures}."""
    failures = []
    for kind, response, answer in cases:
        score, feedback = R.reward(kind, response, answer)
        if (score == 1.0) != expect:
            failures.append({"answer": str(answer)[:120], "response": response[-120:], "feedback": feedback})
    n = len(cases)
    return {"name": name, "ok": n - len(failures), "n": n, "rate": (n - len(failures)) / max(n, 1),
            "failures": failures}


def _answer(x):
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x).strip()


def _bumped(a):
    """A numeric answer plus one ('27' -> '28'), or None for non-numeric answers."""
    try:
        return str(int(a) + 1)
    except ValueError:
        return None


def _reformatted(a):
    """The same answer written differently: 3/4 for \\frac{3}{4}, 27.0 for 27, 58{,}500 for 58,500 (LaTeX's
    thousands separator), else $\\dfrac$, no \\left, a space after each comma (in a tuple or a list)."""
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", a)
    if m:
        return f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    if re.fullmatch(r"-?\d+", a):
        return a + ".0"
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+", a):  # "58, 500" would be two numbers
        return a.replace(",", "{,}")
    return "$" + a.replace("\\frac", "\\dfrac").replace("\\left", "").replace("\\right", "").replace(",", ", ") + "$"


def _digit_changed(a):
    """The answer with its first digit changed ('\\frac{14}{3}' -> '\\frac{24}{3}'), None without digits."""
    i = next((i for i, c in enumerate(a) if c.isdigit()), None)
    return None if i is None else a[:i] + str((int(a[i]) + 1) % 10) + a[i + 1:]


def math_checks(d):
    m5 = load(d, "math500_test.jsonl")
    gsm = [r["answer"].split("####")[-1].strip() for r in load(d, "gsm8k_test.jsonl")]
    aime = load(d, "aime24_test.jsonl")
    amc = [_answer(r["answer"]) for r in load(d, "amc23_test.jsonl")]
    boxed = lambda a: f"So the final answer is $\\boxed{{{a}}}$."  # noqa: E731
    answers = [r["answer"] for r in m5] + gsm + [str(r["answer"]) for r in aime] + amc

    def next_item(ans):  # each answer against the next item's, skipping identical answers
        pairs = [(ans[(i + 1) % len(ans)], a) for i, a in enumerate(ans)]
        return [("math", boxed(b), a) for b, a in pairs if "".join(b.split()) != "".join(a.split())]

    return [
        check("MATH500 reference solutions accepted", [("math", r["solution"], r["answer"]) for r in m5], True),
        check("GSM8K \\boxed{answer} accepted", [("math", boxed(a), a) for a in gsm], True),
        check("AIME24 \\boxed{answer} accepted", [("math", boxed(r["answer"]), r["answer"]) for r in aime], True),
        check("AIME24 reference solutions accepted", [("math", r["solution"], r["answer"]) for r in aime], True),
        check("AMC23 \\boxed{answer} accepted", [("math", boxed(a), a) for a in amc], True),
        check("MATH500 reformatted answers accepted", [("math", boxed(_reformatted(r["answer"])), r["answer"])
                                                       for r in m5], True),
        check("MATH500 next item's answer rejected", next_item([r["answer"] for r in m5]), False),
        check("GSM8K next item's answer rejected", next_item(gsm), False),
        check("MATH500 answer with a digit changed rejected",
              [("math", boxed(_digit_changed(r["answer"])), r["answer"]) for r in m5 if _digit_changed(r["answer"])],
              False),
        check("numeric answer + 1 rejected (all math sets)",
              [("math", boxed(_bumped(a)), a) for a in answers if _bumped(a)], False),
    ]


def mcq_checks(d):
    rows = [r for f in sorted(glob.glob(os.path.join(d, "sciknoweval_*.jsonl"))) for r in load(d, os.path.basename(f))]
    tagged = lambda x: f"<reasoning>\nComparing the options, {x} fits.\n</reasoning>\n<answer>\n{x}\n</answer>"  # noqa
    other = lambda x: "ABCD"[("ABCD".index(x) + 1) % 4]  # noqa: E731
    return [
        check("SciKnowEval <answer>letter</answer> accepted", [("mcq", tagged(r["answer"]), r["answer"]) for r in rows], True),
        check("SciKnowEval \\boxed{letter} / 'the answer is (X)' accepted",
              [("mcq", f"\\boxed{{{r['answer']}}}" if i % 2 else f"The answer is ({r['answer']}).", r["answer"])
               for i, r in enumerate(rows)], True),
        check("SciKnowEval other letter rejected", [("mcq", tagged(other(r["answer"])), r["answer"]) for r in rows], False),
    ]


def react(calls):
    """A realistic ReAct response making the given calls."""
    steps = []
    for c in calls:
        args = c["Action_Input"]
        args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
        steps.append(f"Thought: I should use {c['Action']}.\nAction: {c['Action']}\n"
                     f"Action Input: {json.dumps(args)}\nObservation: (the tool's response)")
    return "\n".join(steps) + "\nThought: I now know the final answer.\nFinal Answer: Done."


def _perturbed_value(calls):
    """The calls with one argument value changed (in the last call that has arguments), or None."""
    calls = json.loads(json.dumps(calls))
    for c in reversed(calls):
        args = json.loads(c["Action_Input"]) if isinstance(c["Action_Input"], str) and c["Action_Input"].strip() else {}
        if isinstance(args, dict) and args:
            key = sorted(args)[0]
            v = args[key]
            args[key] = v + 1 if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{v}-changed"
            c["Action_Input"] = json.dumps(args)
            return calls
    return None


def tool_checks(d):
    rows = load(d, "tooluse_test.jsonl")
    calls = [json.loads(r["answer"]) for r in rows]
    renamed = [[dict(c, Action=c["Action"] + "V2") if i == 0 else c for i, c in enumerate(cs)] for cs in calls]
    return [
        check("ToolUse reference calls accepted", [("tool", react(cs), r["answer"]) for cs, r in zip(calls, rows)], True),
        check("ToolUse wrong action name rejected", [("tool", react(cs), r["answer"]) for cs, r in zip(renamed, rows)], False),
        check("ToolUse wrong argument value rejected",
              [("tool", react(_perturbed_value(cs)), r["answer"]) for cs, r in zip(calls, rows) if _perturbed_value(cs)],
              False),
        check("ToolUse missing / extra call rejected",
              [("tool", react(cs[:-1] if len(cs) > 1 else cs + cs), r["answer"]) for cs, r in zip(calls, rows)], False),
    ]


def all_checks(d):
    return math_checks(d) + mcq_checks(d) + tool_checks(d)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default=DATA_DIR)
    args = p.parse_args()
    if not os.path.isdir(args.data_dir):
        sys.exit(f"error: benchmark files not found: {args.data_dir}")
    results = all_checks(args.data_dir)
    width = max(len(r["name"]) for r in results)
    print(f"{'check':<{width}}  {'agree':>11}  {'rate':>7}")
    for r in results:
        print(f"{r['name']:<{width}}  {r['ok']:>5}/{r['n']:<5}  {100 * r['rate']:6.2f}%")
        for f in r["failures"][:5]:
            print(f"    disagrees: answer {f['answer']!r} response ...{f['response']!r} -> {f['feedback']}")
    print(json.dumps({r["name"]: round(r["rate"], 4) for r in results}))
