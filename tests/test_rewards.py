"""Reward checkers and prepare scripts, without the benchmark files: equivalence rules, feedback,
adversarial inputs (never raise, never hang), prepare-script errors and atomic writes."""
import functools
import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train  # noqa: E402  (the reward() dispatch)
from data import checkers as R  # noqa: E402  (the answer checkers)
from data.common import EVAL_PRESETS  # noqa: E402

reward = train.reward
TRUNCATED = "The response was cut off before a final answer."


# --- math ----------------------------------------------------------------------------------------

EQUAL = [
    ("432", "432"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac12"), ("\\dfrac{3}{4}", "0.75"), ("\\tfrac34", "3/4"),
    ("\\frac9{19}", "\\frac{9}{19}"), ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}"), ("1000", "1,000"),
    ("10080", "10,\\!080"), ("32348", "\\$32,\\!348"), ("5", "5 \\text{ cm}"), ("18", "18 dollars"),
    ("5.4", "5.4 \\text{ cents}"), ("864", "864 \\mbox{ inches}^2"), ("90", "90^\\circ"), ("30", "30^{\\circ}"),
    ("50", "50\\%"), ("27", "27.0"), ("25", "025"), ("5", "x = 5"), ("5", "y=5"), ("2x+3", "y = 2x + 3"),
    ("\\sqrt{2}", "\\sqrt2"), ("11\\sqrt{2}", "11\\sqrt2"), ("3\\sqrt{13}", "\\sqrt{117}"),
    ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}"), ("-q+p", "p - q"), ("2(k+1)", "2k+2"),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"), ("(3,\\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("-2,1", "1,-2"), ("\\{-2,1\\}", "1,-2"), ("6-5i", "6 - 5i"), ("C", "\\text{(C)}"), ("(C)", "\\text{(C)}"),
    ("evelyn", "\\text{Evelyn}"), ("\\frac95", "1\\frac{4}{5}"), ("1.8", "1\\frac{4}{5}"), ("137.5", "137 \\frac{1}{2}"),
    ("\\boxed{7}", "7"), ("7", "\\boxed{7}"), ("\\fbox{7}", "7"), ("\\textbf{(113) }", "113"), ("104.", "104"),
    ("x^5-x^4+x^3-x^2+x-1", "x(x^4-x^3+x^2-x+1)-1"), ("-5x+7y-11z-4=0", "5x - 7y + 11z + 4 = 0"),
    ("1-\\sqrt{19},1+\\sqrt{19}", "1 \\pm \\sqrt{19}"), ("[-2,7]", "x \\in [-2,7]"), ("(2,\\infty)", "(2, \\infty)"),
    ("(0,9)\\cup(9,36)", "(9,36) \\cup (0,9)"), ("\\frac{\\cos x}{\\sin x}", "\\cot x"), ("\\pi r^2", "r^2\\pi"),
    ("\\begin{pmatrix}-1/3\\\\2/3\\\\5/3\\end{pmatrix}", "\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}"),
    ("(-1/3,2/3,5/3)", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"), ("9^{9^9}", "9^{9^{9}}"),
    ("\u03c0/2", "\\frac{\\pi}{2}"), ("\u22122", "-2"), ("52_8", "52_{8}"),
    ("10^{-13}", "0.0000000000001"), ("2 \\cdot 10^{-13}", "0.0000000000002"), ("0", "0.0"),
    # LaTeX's {,} thousands separator; solution lists joined by "or" / "and"; a unary +\infty; "AB =", "f(2) =",
    # "5 = x"; a unit and a period; sqrt of a negative constant (the sign of -4's zero imaginary part)
    ("70{,}000", "70000"), ("\\$1{,}000{,}000", "1000000"), ("x = -2 \\text{ or } x = 1", "-2,1"),
    ("-2 \\text{ and } 1", "1,-2"), ("3, 5, \\text{ and } 7", "3,5,7"), ("x=3 \\text{ or } x=5", "3, 5"),
    ("(5, +\\infty)", "(5,\\infty)"), ("(-\\infty, 2) \\cup (3, +\\infty)", "(-\\infty,2)\\cup(3,\\infty)"),
    ("AB = 5", "5"), ("BC=2\\sqrt{3}", "2\\sqrt3"), ("f(2) = 5", "5"), ("5 = x", "x=5"),
    ("18\\text{ dollars}.", "18"), ("2i", "\\sqrt{-4}"), ("\\frac{-1+i\\sqrt{3}}{2}", "\\frac{-1+\\sqrt{-3}}{2}"),
]
DIFFERENT = [
    ("431", "432"), ("0.33", "\\frac{1}{3}"), (".0000673", ".0000672"), ("(3,4)", "(3,4]"), ("[3,4]", "(3,4]"),
    ("(1,-2)", "(-2,1)"), ("5-6i", "6-5i"), ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"), ("Evlyne", "\\text{Evelyn}"),
    ("\\text{(B)}", "\\text{(C)}"), ("2k", "2k+2"), ("x^5-x^4", "x^5+x^4"), ("\\sqrt{3}", "\\sqrt{2}"), ("R^2", "3R^2"),
    ("5x-7y+11z+5=0", "5x - 7y + 11z + 4 = 0"), ("1", "10"), ("", "5"), ("52_8", "52_9"), ("2^{2^{2^{100}}}", "5"),
    ("10^{400}", "10^{400}+1 \\cdot 0 + 1"),
    ("10^{-13}", "0"), ("0.0000000000001", "0"), ("10^{-13}", "1.0000001 \\cdot 10^{-13}"), ("-10^{-30}", "10^{-30}"),
    # an integer off by one at 1e9 (a 1e-9 tolerance took it), the conjugate root, two typed numbers are
    # not one with a thousands separator, an equation whose right side is a variable is not "5 = x"
    ("10^9 - 1", "1000000000"), ("2^{30}-1", "1073741824"), ("1073741823", "2^{30}"), ("-2i", "\\sqrt{-4}"),
    ("\\frac{-1-i\\sqrt{3}}{2}", "\\frac{-1+\\sqrt{-3}}{2}"), ("2100", "2, 100"), ("x+y=w", "x+y=z"),
]


@pytest.mark.parametrize("pred,ref", EQUAL)
def test_math_equal(pred, ref):
    assert R.math_equal(pred, ref), (pred, ref, R.normalize_math_answer(pred), R.normalize_math_answer(ref))
    assert reward("math", f"Thus the answer is $\\boxed{{{pred}}}$.", ref) == (1.0, None)


@pytest.mark.parametrize("pred,ref", DIFFERENT)
def test_math_different(pred, ref):
    assert not R.math_equal(pred, ref), (pred, ref)
    assert reward("math", f"\\boxed{{{pred}}}", ref)[0] == 0.0


def test_extract_boxed():
    assert R.boxed_answer("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert R.boxed_answer("\\boxed{{{x}}}") == "{{x}}"
    assert R.boxed_answer("\\fbox{3} then \\boxed 4$") == "4"
    assert R.boxed_answer("no box") is None and R.boxed_answer("\\boxed{1") is None
    assert R.boxed_answer("\\boxed{" + "{" * 5000 + "1" + "}" * 5001) == "{" * 5000 + "1" + "}" * 5000
    assert R.normalize_math_answer("\\left( 3, \\dfrac{\\pi}{2} \\right)") == "(3,\\frac{\\pi}{2})"
    assert R.normalize_math_answer("\\$1,000") == "1000" and R.normalize_math_answer("x = \\frac12") == "\\frac{1}{2}"


def test_math_feedback():
    assert reward("math", "so \\boxed{12}", "13") == (0.0, "Your final answer 12 is wrong.")
    assert reward("math", "the answer is 12", "12") == (0.0, "No final answer found: put it in \\boxed{}.")
    assert reward("math", "\\boxed{}", "12")[1].startswith("No final answer found")
    assert reward("math", "first \\boxed{12} then \\boxed{\\frac{1", "12") == (0.0, TRUNCATED)
    assert reward("math", "\\boxed{12}", 12.0) == (1.0, None)  # AMC-style float answers


# --- mcq, exact, tool ----------------------------------------------------------------------------

@pytest.mark.parametrize("response,score", [
    ("<reasoning>x</reasoning>\n<answer>\nB\n</answer>", 1.0), ("<answer>(B)</answer>", 1.0), ("<ANSWER> b </ANSWER>", 1.0),
    ("<answer>A</answer> no wait <answer>B</answer>", 1.0), ("\\boxed{B}", 1.0), ("\\boxed{\\text{B}}", 1.0),
    ("The answer is (B).", 1.0), ("Answer: **B**", 1.0), ("answer: B", 1.0), ("<answer>C</answer>", 0.0),
    ("<answer>B: 1.69</answer>", 0.0), ("The answer is Benzene", 0.0), ("B", 0.0), ("<answer>\nB", 0.0),
    ("<answer>$B$</answer>", 1.0), ("<answer>\n\\boxed{B}\n</answer>", 1.0), ("<answer>$\\boxed{B}$</answer>", 1.0),
    ("<answer>$\\boxed{C}$</answer>", 0.0), ("<answer>\\textsf{B}</answer>", 1.0), ("\\boxed{\\mathit{B}}", 1.0),
])
def test_mcq(response, score):
    assert reward("mcq", response, "B")[0] == score


def test_mcq_feedback():
    assert reward("mcq", "<answer>C</answer>", "B") == (0.0, "Your final answer C is wrong.")
    assert reward("mcq", "<answer>B: 1.69</answer>", "B") == (0.0, "The answer must be a single letter inside <answer></answer>.")
    assert reward("mcq", "<answer>\nB", "B") == (0.0, TRUNCATED)
    assert reward("mcq", "I think it is B", "B")[1].startswith("No final answer found")


def test_exact():
    assert reward("exact", "<answer>abcd</answer>", "abcd") == (1.0, None)
    assert reward("exact", "<answer> abcd </answer>", "abcd") == (1.0, None)
    assert reward("exact", "<answer>x</answer><answer>abcd</answer>", "abcd") == (1.0, None)
    assert reward("exact", "<answer>abdc</answer>", "abcd") == (0.0, "Your final answer abdc is wrong.")
    assert reward("exact", "abcd", "abcd")[0] == 0.0 and reward("exact", "<answer>abcd", "abcd") == (0.0, TRUNCATED)
    assert reward("exact", "\\boxed{abcd}", "abcd")[0] == 0.0  # another domain's format does not count


TOOL_REF = json.dumps([{"Action": "search", "Action_Input": "{\"q\": \"cats\", \"page\": 1}"},
                       {"Action": "getItem", "Action_Input": "{\"id\": 7}"}])


@pytest.mark.parametrize("response,score", [
    ("Thought: go\nAction: search\nAction Input: {\"q\": \"cats\", \"page\": 1}\nObservation: ok\n"
     "Action: getItem\nAction Input: {\"id\": 7}", 1.0),
    ("Action: getItem\nAction Input: {\"id\": 7}\nAction: search\nAction Input: {\"page\": 1, \"q\": \"cats\"}", 1.0),
    ("Action: search\nAction Input:\n{\"q\": \"cats\",\n \"page\": 1}\nAction: getItem\nAction Input: {\"id\": 7}", 1.0),
    ("Action: search\nAction Input: {\"q\": \"dogs\", \"page\": 1}\nAction: getItem\nAction Input: {\"id\": 7}", 0.0),
    ("Action: search\nAction Input: {\"q\": \"cats\", \"page\": 1, \"id\": 7}", 0.0),
    ("Action: search\nAction Input: {\"q\": \"cats\", \"page\": 1}\nAction: getItem\nAction Input: {\"id\": 7}\n"
     "Action: getItem\nAction Input: {\"id\": 7}", 0.0),
    ("Action: Search\nAction Input: {\"q\": \"cats\", \"page\": 1}\nAction: getItem\nAction Input: {\"id\": 7}", 0.0),
])
def test_tool(response, score):
    assert reward("tool", response, TOOL_REF)[0] == score


def test_tool_json_values_compare_by_type():
    """Python's == says True == 1 and 1 == 1.0; a tool call's JSON true is not the reference's 1."""
    ref = json.dumps([{"Action": "set", "Action_Input": "{\"on\": 1, \"tags\": [1, 2], \"x\": {\"y\": false}}"}])
    call = "Action: set\nAction Input: {}"
    assert reward("tool", call.format('{"on": 1, "tags": [1, 2], "x": {"y": false}}'), ref) == (1.0, None)
    for wrong in ('{"on": true, "tags": [1, 2], "x": {"y": false}}', '{"on": 1, "tags": [true, 2], "x": {"y": false}}',
                  '{"on": 1, "tags": [1, 2], "x": {"y": 0}}', '{"on": "1", "tags": [1, 2], "x": {"y": false}}'):
        score, feedback = reward("tool", call.format(wrong), ref)
        assert score == 0.0 and "wrong values for" in feedback, wrong
    assert reward("tool", call.format('{"on": 1.0, "tags": [1, 2], "x": {"y": false}}'), ref)[0] == 1.0  # one JSON number


def test_tool_feedback():
    one = json.dumps([{"Action": "search", "Action_Input": "{\"q\": \"cats\"}"}])
    assert reward("tool", "Action: find\nAction Input: {\"q\": \"cats\"}", one)[1].startswith("Action names do not match")
    fb = reward("tool", "Action: search\nAction Input: {\"q\": \"dogs\", \"n\": 2}", one)[1]
    assert "unexpected arguments: n" in fb and "wrong values for: q" in fb and "dogs" not in fb and "cats" not in fb
    assert reward("tool", "I will not use tools.", one)[1].startswith("No tool call found")
    assert reward("tool", "Action: search\nAction Input: {\"q\": \"ca", one) == (0.0, TRUNCATED)
    assert reward("tool", "Action: getRandom\nAction Input: {}", '[{"Action": "getRandom", "Action_Input": "{}"}]') == (1.0, None)


def test_tool_calls_match_as_name_and_arguments_pairs_in_any_order():
    """A repeated action's calls in another order are the same calls (merged Action Inputs made them
    differ), and its last call written twice is not the two calls (merging let it pass)."""
    ref = json.dumps([{"Action": "addItem", "Action_Input": "{\"item\": \"milk\", \"n\": 2}"},
                      {"Action": "addItem", "Action_Input": "{\"item\": \"eggs\", \"n\": 12}"}])

    def calls(*items):
        return "".join(f"Action: addItem\nAction Input: {{\"item\": \"{item}\", \"n\": {n}}}\nObservation: ok\n"
                       for item, n in items)
    assert reward("tool", calls(("milk", 2), ("eggs", 12)), ref) == (1.0, None)
    assert reward("tool", calls(("eggs", 12), ("milk", 2)), ref) == (1.0, None)
    assert reward("tool", calls(("eggs", 12), ("eggs", 12)), ref)[0] == 0.0
    assert reward("tool", calls(("milk", 12), ("eggs", 2)), ref)[0] == 0.0
    split = json.dumps([{"Action": "a", "Action_Input": "{\"x\": 1}"}, {"Action": "b", "Action_Input": "{\"y\": 2}"}])
    moved = "Action: a\nAction Input: {\"x\": 1, \"y\": 2}\nAction: b\nAction Input: {}"  # merged, the same
    assert reward("tool", moved, split) == (0.0, "The Action Input arguments do not match the calls they belong to.")


def test_numeric_equality_is_relative_at_every_magnitude():
    """|x - y| <= 1e-12 max(|x|, |y|): 10^{-13} and the plain 0.0000000000001 both differ from 0 (an
    absolute floor made the first equal 0 while the exact comparison kept the second apart)."""
    for small in ("10^{-13}", "0.0000000000001", "\\frac{1}{10^{13}}"):
        assert not R.math_equal(small, "0") and not R.math_equal("0", small)
        assert all(R.math_equal(small, other) for other in ("10^{-13}", "0.0000000000001", "\\frac{1}{10^{13}}"))
    assert R.math_equal("10^{20}", "10^{20}+1")  # within 1e-12 relative: the same float sum
    assert not R.math_equal("10^{20}", "1.00000001 \\cdot 10^{20}")


def test_a_malformed_action_input_in_a_response_is_not_no_arguments():
    """It once counted as {} and scored 1.0 against a reference call that takes no arguments."""
    none = '[{"Action": "getRandom", "Action_Input": "{}"}]'
    for bad in ("{oops}", "[1, 2]", "\"text\"", "q=cats", "{'q': 'cats'}"):
        score, feedback = reward("tool", f"Action: getRandom\nAction Input: {bad}\nObservation: ok", none)
        assert score == 0.0 and feedback.startswith("The Action Input of getRandom is not a JSON object"), bad
    assert reward("tool", "Action: getRandom\nAction Input: {oops", none) == (0.0, TRUNCATED)
    for fine in ("Action: getRandom\nAction Input: {}", "Action: getRandom", "Action: getRandom\nAction Input:\n"):
        assert reward("tool", fine, none) == (1.0, None), fine
    one = json.dumps([{"Action": "search", "Action_Input": "{\"q\": \"cats\"}"}])
    assert reward("tool", "Action: search\nAction Input: \"{\\\"q\\\": \\\"cats\\\"}\"", one) == (1.0, None)  # a JSON string of an object


def test_a_tool_reference_whose_action_input_is_not_json_cannot_score():
    """Such a reference once became {}: now it is refused at load (answer_problem) and scores 0 here."""
    bad = '[{"Action": "search", "Action_Input": "{q: cats}"}]'
    assert "Action_Input is not a JSON object" in R.answer_problem("tool", bad)
    assert reward("tool", "Action: search\nAction Input: {}", bad)[0] == 0.0
    assert R.answer_problem("tool", '[{"Action": "search", "Action_Input": {"q": "cats"}}]') is None


def test_unknown_kind_and_odd_types():
    assert reward("nope", "x", "y")[0] == 0.0
    for kind in ("math", "mcq", "tool", "exact", None, 3):
        for response, answer in [(None, None), (5, 5), (b"\\boxed{5}", "5"), ([1], {"a": 1}), ("x", float("nan"))]:
            score, feedback = reward(kind, response, answer)
            assert score in (0.0, 1.0) and (feedback is None or isinstance(feedback, str))


# --- adversarial inputs --------------------------------------------------------------------------

class Hang(BaseException):  # not an Exception: the checkers' catch-all must not swallow it
    pass


def _on_alarm(signum, frame):
    raise Hang("a single reward call ran for more than 20 s")


MB = 1 << 20
ADVERSARIAL = {
    "1 MB of text": "a" * MB, "1 MB of open braces": "{" * MB, "1 MB of close braces": "}" * MB,
    "1 MB of \\boxed{": "\\boxed{" * (MB // 7), "10k-deep nested boxed": "\\boxed{" + "{" * 10000 + "1" + "}" * 10001,
    "10k-deep unbalanced": "\\boxed{" + "{" * 10000 + "1",
    "unicode": "\u00fc\u2211\u222b\u221a\u03c0\U0001f600" * 50000 + "\\boxed{\u03c0}",
    "1 MB of tags": "<answer>" * 100000, "open/close tags": "</answer><answer>" * 50000,
    "many actions": "Action: x\nAction Input: {\"a\": \"" * 20000, "deep JSON": "Action: x\nAction Input: " + "[" * 100000,
    "deep JSON object": "Action: x\nAction Input: " + "{\"a\":" * 100000, "whitespace": " " * MB + "answer is" + " " * MB,
    "answer-is spam": "the answer is " * 70000, "nested fractions": "\\boxed{" + "\\frac{" * 60 + "1" + "}{2}" * 60 + "}",
    "nested roots": "\\boxed{" + "\\sqrt{" * 150 + "2" + "}" * 150 + "}",
    "power tower": "\\boxed{" + "9^{" * 100 + "9" + "}" * 100 + "}",
    "deep parens": "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", "many boxes": "\\boxed{1}" * 100000,
    "huge number": "\\boxed{" + "9" * 5000 + "}", "huge exponent": "\\boxed{10^{99999999999}}",
    "NULs": "\x00" * 1000 + "\\boxed{\x00}",
    "nested text": "\\boxed{" + "\\text{" * 200 + "a" + "}" * 200 + "}", "many \\pm": "\\boxed{" + "1\\pm" * 100 + "1}",
    "long list": "\\boxed{" + ",".join(["x^2"] * 130) + "}", "long union": "\\boxed{" + "\\cup".join(["(1,2)"] * 60) + "}",
    "wide matrix": "\\boxed{\\begin{pmatrix}" + "1&" * 100 + "\\end{pmatrix}}", "bare \\frac": "\\boxed{\\frac}",
    "bad \\sqrt[": "\\boxed{\\sqrt[3}", "dangling ^": "\\boxed{x^}", "lone backslash": "\\boxed{\\}",
    "lone surrogate": "\ud800\\boxed{1}", "python code": "\\boxed{__import__('os').system('echo hi')}",
}
ANSWERS = ["5", "\\frac{1}{2}", "x^2+1", "(1,2)", "1,2", "\\pi", "B", "abcd", TOOL_REF, "{" * 100000]


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_inputs(name):
    text = ADVERSARIAL[name]
    old = signal.signal(signal.SIGALRM, _on_alarm) if hasattr(signal, "SIGALRM") else None
    try:
        for kind in [k for k in R.CHECKS if k != "code"]:  # every kind, a new one too (code's hostile programs: test_code.py)
            # a hostile response against every reference valid for the kind: the checker itself must not raise
            # (train.reward would turn an exception into a 0); a hostile reference: through train.reward, which
            # must return (references are checked at load, answer_problem, and a checker may refuse one)
            valid = [a for a in ANSWERS if R.answer_problem(kind, a) is None]
            for response, answer, check in ([(text, a, R.CHECKS[kind]) for a in valid]
                                            + [("\\boxed{5} <answer>B</answer>", text, functools.partial(reward, kind))]):
                if old is not None:
                    signal.alarm(20)
                score, feedback = check(response, R.answer_text(answer))
                assert score in (0.0, 1.0) and (feedback is None or isinstance(feedback, str)), (kind, score)
                assert (score == 1.0) == (feedback is None)
            got = R.final_answer(kind, text)
            assert got is None or isinstance(got, str)
        for f in (R.boxed_answer, R.normalize_math_answer):
            f(text)
        assert isinstance(R.math_equal(text, text[:1000]), bool) and isinstance(R.math_equal(text[:300], "5"), bool)
    finally:
        if old is not None:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


# --- data prep -----------------------------------------------------------------------------------

def run_prepare(name, *args):
    return subprocess.run([sys.executable, os.path.join(REPO, "data", name, "prepare.py"), *args],
                          capture_output=True, text=True, timeout=120)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def check_schema(rows):
    for row in rows:
        assert isinstance(row["id"], str) and isinstance(row["domain"], str) and isinstance(row["answer"], str)
        assert row["kind"] in ("math", "mcq", "tool", "exact") and row["answer"]
        assert [m["role"] for m in row["messages"]][-1] == "user"
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in row["messages"])
    assert len({r["id"] for r in rows}) == len(rows)


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


GPQA_RECORDS = [{"Record ID": f"rec{i}", "Question": f"Which is heavier, case {i}?", "Correct Answer": "lead",
                 "Incorrect Answer 1": "feather", "Incorrect Answer 2": "air", "Incorrect Answer 3": "foam",
                 "Subdomain": "Physics"} for i in range(12)]


def test_prepare_gpqa_shuffles_deterministically(tmp_path):
    src = write_jsonl(tmp_path / "gpqa.jsonl", GPQA_RECORDS)
    outs = []
    for k in range(2):
        r = run_prepare("gpqa", f"--from_file={src}", f"--out_dir={tmp_path / str(k)}")
        assert r.returncode == 0, r.stderr
        outs.append(read_jsonl(tmp_path / str(k) / "test.jsonl"))
    assert outs[0] == outs[1] and not os.path.exists(tmp_path / "0" / "train.jsonl")
    rows = outs[0]
    check_schema(rows)
    assert len({r["answer"] for r in rows}) > 1  # the correct option moves around
    for row in rows:
        assert row["kind"] == "mcq" and row["messages"][0]["role"] == "system"
        assert f"\n{row['answer']}: lead\n" in row["messages"][-1]["content"]
        assert reward("mcq", f"<answer>{row['answer']}</answer>", row["answer"]) == (1.0, None)


def test_prepare_mmlu_pro(tmp_path):
    recs = [{"question_id": i, "question": f"Q{i}?", "options": [f"opt{j}" for j in range(10)], "answer": "ABCDEFGHIJ"[i % 10],
             "answer_index": i % 10, "category": "law"} for i in range(10)]
    r = run_prepare("mmlu_pro", f"--from_file={write_jsonl(tmp_path / 'm.jsonl', recs)}", f"--out_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    rows = read_jsonl(tmp_path / "out" / "test.jsonl")
    check_schema(rows)
    assert [r["answer"] for r in rows] == list("ABCDEFGHIJ") and "J: opt9" in rows[0]["messages"][-1]["content"]
    assert "(A, B, C, D, E, F, G, H, I, or J)" in rows[0]["messages"][0]["content"]


def test_prepare_dapo_formats(tmp_path):
    wrapped = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nFind $x$ if $x+1=3$.\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")
    dapo = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": wrapped}],
            "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": "abc"}}
    src = write_jsonl(tmp_path / "dapo.jsonl", [dapo, dapo])  # the hub repeats problems: kept once
    math_style = write_jsonl(tmp_path / "math.jsonl", [{"problem": "What is 1+1?", "solution": "It is $\\boxed{2}$."}])
    r = run_prepare("dapo_math", f"--from_file={src},{math_style}", f"--out_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    rows = read_jsonl(tmp_path / "out" / "train.jsonl")
    check_schema(rows)
    assert [r["answer"] for r in rows] == ["2", "2"] and not os.path.exists(tmp_path / "out" / "test.jsonl")
    assert rows[0]["messages"][0]["content"] == ("Find $x$ if $x+1=3$.\n\nPlease reason step by step, "
                                                 "and put your final answer within \\boxed{}.")


def test_prepare_errors_are_one_line_and_atomic(tmp_path):
    good = write_jsonl(tmp_path / "gpqa_ok.jsonl", GPQA_RECORDS)
    out = tmp_path / "out"
    assert run_prepare("gpqa", f"--from_file={good}", f"--out_dir={out}").returncode == 0
    before = (out / "test.jsonl").read_text()

    bad = tmp_path / "gpqa_bad.jsonl"
    bad.write_text(json.dumps(GPQA_RECORDS[0]) + "\n{not json\n")
    r = run_prepare("gpqa", f"--from_file={good}", f"--from_file={bad}", f"--out_dir={out}")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == f"error: {bad}:2: not valid JSON"

    missing = write_jsonl(tmp_path / "gpqa_missing.jsonl", [GPQA_RECORDS[0], {"Question": "?"}])
    r = run_prepare("gpqa", f"--from_file={missing}", f"--out_dir={out}")
    assert r.returncode == 1 and f"{missing}:2: missing field" in r.stderr.strip().splitlines()[-1]

    r = run_prepare("gpqa", f"--from_file={tmp_path / 'nope.jsonl'}", f"--out_dir={out}")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == f"error: source file not found: {tmp_path / 'nope.jsonl'}"

    assert (out / "test.jsonl").read_text() == before  # failed runs left the old file alone
    assert sorted(os.listdir(out)) == ["test.jsonl"]  # and no temp files behind

    r = run_prepare("math500", f"--from_file={tmp_path / 'gpqa_ok.jsonl'}", f"--out_dir={tmp_path / 'm'}")
    assert r.returncode == 1 and "gpqa_ok.jsonl:1: missing field 'problem'" in r.stderr and not os.path.exists(tmp_path / "m")


def test_prepare_on_non_utf8_input_is_one_line(tmp_path):
    latin = tmp_path / "gpqa_latin.jsonl"
    latin.write_bytes(json.dumps(GPQA_RECORDS[0]).encode() + b"\n" + json.dumps(GPQA_RECORDS[1]).replace("lead", "l\\u00e9ad")
                      .encode().replace(b"\\u00e9", b"\xe9") + b"\n")
    r = run_prepare("gpqa", f"--from_file={latin}", f"--out_dir={tmp_path / 'out'}")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"error: {latin}:2: not UTF-8 text (byte 0xe9): re-encode the file as UTF-8"
    assert not (tmp_path / "out").exists()
    r = run_prepare("gpqa", f"--from_file={tmp_path}", f"--out_dir={tmp_path / 'out'}")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == f"error: source file {tmp_path} is a directory, not a JSON/JSONL file"


def test_prepare_reads_real_records_as_their_source_means_them(tmp_path):
    """A raw U+2028 inside a JSON string is one line (str.splitlines split it in two); a blank field falls
    back to the next name; an answer of 0 is an answer; an AIME file's year is its own, not its folder's."""
    src = tmp_path / "gsm8k_test.jsonl"
    src.write_text(json.dumps({"question": "A\u2028B costs 5?", "answer": "so #### 5"}, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    assert "\u2028" in src.read_text(encoding="utf-8")
    r = run_prepare("gsm8k", f"--from_file={src}", f"--out_dir={tmp_path / 'g'}")
    assert r.returncode == 0, r.stderr
    assert "A\u2028B costs 5?" in read_jsonl(tmp_path / "g" / "test.jsonl")[0]["messages"][-1]["content"]
    amc = write_jsonl(tmp_path / "amc_test.jsonl", [{"problem": "  ", "question": "What is 2+3?", "answer": 5}])
    assert run_prepare("amc23", f"--from_file={amc}", f"--out_dir={tmp_path / 'a'}").returncode == 0
    assert read_jsonl(tmp_path / "a" / "test.jsonl")[0]["messages"][-1]["content"].startswith("What is 2+3?")
    dapo = write_jsonl(tmp_path / "math.jsonl", [{"problem": "What is 1-1?", "answer": 0}])
    assert run_prepare("dapo_math", f"--from_file={dapo}", f"--out_dir={tmp_path / 'd'}").returncode == 0
    assert read_jsonl(tmp_path / "d" / "train.jsonl")[0]["answer"] == "0"
    (tmp_path / "exp2025").mkdir()
    aime = write_jsonl(tmp_path / "exp2025" / "aime24_test.jsonl", [{"id": 60, "problem": "Find n.", "answer": "025"}])
    dated = write_jsonl(tmp_path / "aime_test.jsonl", [{"id": 1, "problem": "Find m.", "answer": "7",
                                                        "url": "https://artofproblemsolving.com/wiki/2024_AIME_I_Problems"}])
    assert run_prepare("aime", f"--from_file={aime},{dated}", f"--out_dir={tmp_path / 'y'}").returncode == 0
    assert [r["id"] for r in read_jsonl(tmp_path / "y" / "test.jsonl")] == ["aime24-60", "aime24-1"]


def test_prepare_bad_input_is_one_line_and_writes_nothing(tmp_path):
    """A lone surrogate, an out_dir that is a file, a JSON document's own error line, an answer letter that
    is no option, and sciknoweval's later domain failing after an earlier one converted: one line each, and
    no file (re)written."""
    def last_line(r):
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        return r.stderr.strip().splitlines()[-1]
    sur = tmp_path / "gsm8k_test.jsonl"
    sur.write_text('{"question": "bad \\ud83d here", "answer": "#### 5"}\n')
    assert "half of a UTF-16 pair" in last_line(run_prepare("gsm8k", f"--from_file={sur}", f"--out_dir={tmp_path / 's'}"))
    assert not (tmp_path / "s").exists()
    good = write_jsonl(tmp_path / "gsm8k_ok_test.jsonl", [{"question": "Q?", "answer": "#### 5"}])
    (tmp_path / "afile").write_text("x")
    assert "is a file, not a folder" in last_line(run_prepare("gsm8k", f"--from_file={good}", f"--out_dir={tmp_path / 'afile'}"))
    pretty = tmp_path / "amc_test.json"
    pretty.write_text("[\n" + "".join('  {"problem": "P", "answer": 1},\n' for _ in range(13)) + '  {"problem": "P" "answer": 1}\n]\n')
    assert f"{pretty}:15: not valid JSON" in last_line(run_prepare("amc23", f"--from_file={pretty}", f"--out_dir={tmp_path / 'p'}"))
    ske = tmp_path / "ske"
    ske.mkdir()
    row = {"prompt": "Which?\n\nA: x\nB: y\nPlease reason step by step.", "answer": "A", "idx": 0}
    bio = write_jsonl(ske / "sciknoweval_biology_test.jsonl", [row])
    chem = write_jsonl(ske / "sciknoweval_chemistry_test.jsonl", [row, dict(row, answer="C", idx=1)])
    line = last_line(run_prepare("sciknoweval", f"--from_file={bio},{chem}", f"--out_dir={ske / 'out'}"))
    assert "sciknoweval_chemistry_test.jsonl:2: answer 'C' is not one of the prompt's option letters (A, B)" in line
    assert not (ske / "out").exists()  # biology, converted first, was not written either


def test_a_set_without_the_split_asked_for_says_so(tmp_path):
    (tmp_path / "aime").mkdir()
    write_jsonl(tmp_path / "aime" / "test.jsonl", [])
    with pytest.raises(train.UserError, match="the set aime has no train split \\(only test\\)"):
        train.load_tasks("aime", "train", str(tmp_path))


def test_eval_presets_name_prepared_sets():
    assert set(EVAL_PRESETS) >= {"math", "science", "tool", "general", "paper"}
    names = {n for sets in EVAL_PRESETS.values() for n in sets}
    assert set(EVAL_PRESETS["paper"]) == names
    for name in names:
        assert os.path.exists(os.path.join(REPO, "data", name.split("/")[0], "prepare.py")), name


def test_math_checker_dispatch_and_cross_check():
    assert train.reward("math", "\\boxed{1/2}", "0.5") == (1.0, None)
    pytest.importorskip("math_verify", reason="math-verify is optional (pip install math-verify) and not installed")
    pairs = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{3}", "4", 0.0), ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
             ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}", 1.0), ("\\boxed{12", "12", 0.0), ("no box", "1", 0.0)]
    for response, answer, want in pairs:
        assert train.reward("math", response, answer, math_checker="math_verify")[0] == want, (response, answer)
        assert train.reward("math", response, answer)[0] == want, (response, answer)  # the builtin agrees


def test_a_checker_that_raises_scores_0_and_is_said_once_per_kind_and_error(monkeypatch, capsys):
    """A checker bug must not stop training, nor hide: a run would only see SDPO with no teacher."""
    def broken(response, answer):
        raise RuntimeError("index out of range in my new checker")
    monkeypatch.setitem(R.CHECKS, "broken", broken)
    monkeypatch.setattr(train, "_CHECKER_ERRORS", set())
    assert [reward("broken", "x", "1") for _ in range(3)] == [(0.0, "could not check the response (RuntimeError)")] * 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the 'broken' answer checker raised RuntimeError: index out of range" in err[0], err
