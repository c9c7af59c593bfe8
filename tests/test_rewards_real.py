"""Reward checkers and prepare scripts on real benchmark test files, local copies in
$NANOSDPO_BENCHMARK_DATA (default ../shared/data, next to the checkout; skipped when absent). The
rates are the ones tests/bench/agreement.py prints for the README."""
import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
DATA = os.environ.get("NANOSDPO_BENCHMARK_DATA", os.path.join(REPO, "..", "shared", "data"))
sys.path.insert(0, REPO)
from tests.bench import agreement  # noqa: E402
from tests.bench.agreement import R  # noqa: E402  (train.reward, over data/checkers.py)

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(DATA, "math500_test.jsonl")),
                                reason=f"real benchmark files not found in {os.path.normpath(DATA)}")


def assert_rate(result, at_least):
    for f in result["failures"]:
        print(f"{result['name']}: disagrees on answer {f['answer']!r}, response ...{f['response']!r} -> {f['feedback']}")
    assert result["rate"] >= at_least, f"{result['name']}: {result['ok']}/{result['n']}"


@pytest.fixture(scope="module")
def results():
    return {r["name"]: r for r in agreement.all_checks(DATA)}


@pytest.mark.parametrize("name,at_least", [
    ("MATH500 reference solutions accepted", 0.99),
    ("MATH500 reformatted answers accepted", 0.99),
    ("GSM8K \\boxed{answer} accepted", 1.0),
    ("AIME24 \\boxed{answer} accepted", 1.0),
    ("AIME24 reference solutions accepted", 0.95),
    ("AMC23 \\boxed{answer} accepted", 1.0),
    ("MATH500 next item's answer rejected", 0.99),  # the one pair accepted is "x=5" against "5"
    ("GSM8K next item's answer rejected", 0.99),
    ("MATH500 answer with a digit changed rejected", 0.99),
    ("numeric answer + 1 rejected (all math sets)", 1.0),
    ("SciKnowEval <answer>letter</answer> accepted", 1.0),
    ("SciKnowEval \\boxed{letter} / 'the answer is (X)' accepted", 1.0),
    ("SciKnowEval other letter rejected", 1.0),
    ("ToolUse reference calls accepted", 1.0),
    ("ToolUse wrong action name rejected", 1.0),
    ("ToolUse wrong argument value rejected", 1.0),
    ("ToolUse missing / extra call rejected", 1.0),
])
def test_agreement(results, name, at_least):
    assert_rate(results[name], at_least)


def test_feedback_on_real_items():
    m5 = agreement.load(DATA, "math500_test.jsonl")
    cut = m5[0]["solution"][:m5[0]["solution"].rfind("\\boxed{") + 10]
    assert R.reward("math", cut, m5[0]["answer"]) == (0.0, "The response was cut off before a final answer.")
    assert R.reward("math", "\\boxed{12}", m5[1]["answer"]) == (0.0, "Your final answer 12 is wrong.")
    tool = agreement.load(DATA, "tooluse_test.jsonl")[0]
    score, feedback = R.reward("tool", "Action: getAxolotlFacts\nAction Input: {}", tool["answer"])
    assert score == 0.0 and feedback.startswith("Action names do not match")


# --- prepare scripts on the shared files ---------------------------------------------------------

SKE = [f"sciknoweval_{d}_{s}.jsonl" for d in ("biology", "chemistry", "material", "physics") for s in ("train", "test")]
PREPARES = [  # (script, shared files, {output file: lines})
    ("math500", ["math500_test.jsonl"], {"test.jsonl": 500}),
    ("gsm8k", ["gsm8k_test.jsonl"], {"test.jsonl": 1319}),
    ("aime", ["aime24_test.jsonl"], {"test.jsonl": 30}),
    ("amc23", ["amc23_test.jsonl"], {"test.jsonl": 40}),
    ("dapo_math", ["math500_test.jsonl"], {"train.jsonl": 500}),  # MATH-format records, the fallback source
    ("tooluse", ["tooluse_test.jsonl"], {"test.jsonl": 68}),
    ("sciknoweval", SKE, {f"{d}/{s}.jsonl": n for d, s, n in [
        ("biology", "train", 450), ("biology", "test", 50), ("chemistry", "train", 1890), ("chemistry", "test", 210),
        ("material", "train", 841), ("material", "test", 94), ("physics", "train", 720), ("physics", "test", 80)]}),
]


def reference_response(row):
    """A response that states the row's reference answer in its kind's format."""
    if row["kind"] == "math":
        return f"... so the answer is $\\boxed{{{row['answer']}}}$."
    if row["kind"] == "mcq":
        return f"<reasoning>...</reasoning>\n<answer>\n{row['answer']}\n</answer>"
    return agreement.react(json.loads(row["answer"]))


@pytest.mark.parametrize("script,files,outputs", PREPARES, ids=[p[0] for p in PREPARES])
def test_prepare_from_shared_file(tmp_path, script, files, outputs):
    src = ",".join(os.path.join(DATA, f) for f in files)
    r = subprocess.run([sys.executable, os.path.join(REPO, "data", script, "prepare.py"), f"--from_file={src}",
                        f"--out_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    written = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert written == sorted(outputs)
    for out, n in outputs.items():
        with open(tmp_path / out, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) == n and len({row["id"] for row in rows}) == n
        for row in rows:
            assert isinstance(row["id"], str) and isinstance(row["domain"], str) and row["kind"] in ("math", "mcq", "tool")
            assert isinstance(row["answer"], str) and row["answer"]
            roles = [m["role"] for m in row["messages"]]
            assert roles in (["user"], ["system", "user"]) and all(isinstance(m["content"], str) for m in row["messages"])
            if row["kind"] == "math":
                assert row["messages"][-1]["content"].endswith(
                    "\n\nPlease reason step by step, and put your final answer within \\boxed{}.")
            if script == "sciknoweval":
                assert roles == ["system", "user"] and "<answer>" in row["messages"][0]["content"]
            if script == "tooluse":
                assert roles == ["user"] and "Action Input:" in row["messages"][0]["content"]
        # end to end: each line's own reference answer, in its format, earns reward 1
        assert all(R.reward(row["kind"], reference_response(row), row["answer"])[0] == 1.0 for row in rows)
