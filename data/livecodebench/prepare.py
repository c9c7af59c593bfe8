"""
LiveCodeBench v6 (livecodebench/code_generation_lite, release_v6) in the SDPO paper's window: the
problems of contests from 2025-02-01 up to (not including) 2025-05-01, 131 problems. Each becomes a
"code" task in LiveCodeBench's own prompt format (stdin/stdout problems, or LeetCode-style ones with
starter code and a method to call); the public tests (the examples in the statement) are public,
shown in feedback, and the private ones hidden: every test counts for the score.

    python data/livecodebench/prepare.py                          # test.jsonl from the HF hub
    python data/livecodebench/prepare.py --train_split            # + train.jsonl (below)
    python data/livecodebench/prepare.py --from_file=local/test6.jsonl --start=2025-02-01 --end=2025-05-01

The training set for the coding stage (--train_split) is the SDPO repository's: the same problems,
each with a seeded half of its tests (lasgroup/SDPO data/split_tests.py keeps 50 %; here half of the
private tests, and the public examples, which feedback shows, all kept): this is the
set behind the SDPO paper's rich-feedback result (LCB v6, SDPO 48.8 % vs GRPO 41.2 %), so the code
stage reproduces their setting with nothing beyond this loader; it is test-time training on the
benchmark's problems (the held-out part is the other half of the tests), as in their paper. The
continual paper's own coding set (allenai/Dolci-Think-RL-7B's code split) needs a converter for its
format, which was not available to check here.

Private tests on the hub are base64(zlib(pickle(json))): the pickle is read with an unpickler that
accepts a plain string and nothing else (no class can be loaded, so no code runs).
"""
import base64
import io
import json
import os
import pickle
import random
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, die, field, from_files, load_hub, make_row, parse_args, write_splits  # noqa: E402

HUB = "livecodebench/code_generation_lite"
V6_FILES = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]  # release_v6
PAPER_PROBLEMS = 131
TIMEOUT_S = 6  # per test, LiveCodeBench's evaluation timeout
SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
          "generate a correct Python program that matches the specification and passes all tests.")
STDIN_FORMAT = ("### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not "
                "directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure that "
                "when the python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
                "```python\n# YOUR CODE HERE\n```\n\n")
STARTER_FORMAT = ("### Format: You will use the following starter code to write the solution to the problem and "
                  "enclose your code within delimiters.\n```python\n{starter}\n```\n\n")
ANSWER_LINE = "### Answer: (use the provided format with backticks)\n\n"


class _StringOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: the test cases must be a plain string")


def decode_tests(value, where):
    """A list of {"input", "output", "testtype"} from LCB's JSON text or its compressed form."""
    if isinstance(value, list):
        return value
    text = str(value)
    try:
        tests = json.loads(text)
    except ValueError:
        try:
            raw = _StringOnly(io.BytesIO(zlib.decompress(base64.b64decode(text)))).load()
            tests = json.loads(raw if isinstance(raw, str) else raw.decode())
        except Exception as e:  # not base64 / not zlib / not a pickled string / not JSON
            die(f"{where}: test cases are neither JSON nor LiveCodeBench's compressed form ({type(e).__name__})")
    if not isinstance(tests, list) or not all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        die(f"{where}: test cases must be a list of {{\"input\", \"output\"}} objects")
    return tests


def prompt_text(rec, where):
    starter = str(rec.get("starter_code") or "").strip()
    fmt = STARTER_FORMAT.format(starter=starter) if starter else STDIN_FORMAT
    return f"### Question:\n{str(field(rec, where, 'question_content')).strip()}\n\n{fmt}{ANSWER_LINE}"


def code_answer(rec, where, tests):
    """The task's answer (data/checkers.py's code schema): stdin tests, or call tests with fn_name."""
    meta = rec.get("metadata") or {}
    meta = json.loads(meta) if isinstance(meta, str) and meta.strip() else meta if isinstance(meta, dict) else {}
    functional = any(t.get("testtype") == "functional" for t in tests)
    answer = {"tests": [{"input": str(t["input"]), "output": str(t["output"]), "public": bool(t["public"])}
                        for t in tests], "timeout": TIMEOUT_S}
    if functional:
        if not meta.get("func_name"):
            die(f"{where}: a functional (LeetCode) problem needs metadata.func_name")
        answer["fn_name"] = meta["func_name"]
    return answer


def in_window(rec, where, start, end):
    date = str(field(rec, where, "contest_date"))[:10]
    return start <= date < end


def make_converter(start, end, half_tests=False, seed=0):
    def to_row(rec, where, split, i):
        if not in_window(rec, where, start, end):
            return None
        public = [dict(t, public=True) for t in decode_tests(field(rec, where, "public_test_cases"), where)]
        private = [dict(t, public=False) for t in decode_tests(rec.get("private_test_cases") or "[]", where)]
        tests = public + private
        qid = str(field(rec, where, "question_id"))
        if half_tests and len(tests) > 1:  # SDPO's train split: a seeded half of the tests, public ones kept
            rng = random.Random(f"{seed}-{qid}")
            keep = set(rng.sample(range(len(public), len(tests)), max(1, len(private) // 2))) if private else set()
            tests = [t for k, t in enumerate(tests) if t["public"] or k in keep]
        if not tests:
            die(f"{where}: problem {qid} has no tests")
        return make_row(f"lcb-{qid}", "code", "code", prompt_text(rec, where), json.dumps(code_answer(rec, where, tests)),
                        system=SYSTEM, difficulty=str(rec.get("difficulty", "")), platform=str(rec.get("platform", "")),
                        contest_date=str(rec.get("contest_date", ""))[:10])
    return to_row


def add_args(p):
    p.add_argument("--start", default="2025-02-01", help="first contest date kept (the SDPO paper's v6 window)")
    p.add_argument("--end", default="2025-05-01", help="contest dates before this are kept")
    p.add_argument("--train_split", action="store_true", help="also write train.jsonl: SDPO's half-of-the-tests split")
    p.add_argument("--seed", type=int, default=0, help="seed of the half-of-the-tests split")


if __name__ == "__main__":
    args = parse_args("livecodebench", __doc__, add_args)
    if args.from_file:
        records = from_files(args.from_file, "test", only="test")["test"]
    else:
        ds = load_hub("json", data_files={"test": [f"hf://datasets/{HUB}/{f}" for f in V6_FILES]}, split="test")
        records = [(f"{HUB}:test[{i}]", dict(r)) for i, r in enumerate(ds)]
    splits = convert({"test": records}, make_converter(args.start, args.end), "livecodebench")
    if args.train_split:
        splits["train"] = convert({"train": records}, make_converter(args.start, args.end, True, args.seed),
                                  "livecodebench")["train"]
    n = len(splits["test"])
    if not n:
        die(f"none of the {len(records)} problems has a contest_date in the window [{args.start}, {args.end}) "
            "(dates are read as YYYY-MM-DD): set --start / --end")
    if (args.start, args.end) == ("2025-02-01", "2025-05-01") and not args.from_file and n != PAPER_PROBLEMS:
        print(f"note: {n} problems in the window, the SDPO paper reports {PAPER_PROBLEMS}", file=sys.stderr)
    write_splits(args.out_dir, splits)
