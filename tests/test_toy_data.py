"""The toy suite's data (data/toy/prepare.py): held-out tests, answer formats, and the
teacher-context copies the SFT base learns to use a demonstration from."""
import collections
import importlib.util
import json
import math
import os

import train


def load_prepare(toy_data):
    spec = importlib.util.spec_from_file_location("toy_prepare", os.path.join(toy_data, "toy", "prepare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(toy_data, name, split):
    with open(os.path.join(toy_data, "toy", name, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_test_questions_are_held_out_and_solutions_score_one(toy_data):
    prep = load_prepare(toy_data)
    for domain in prep.DOMAINS:
        train_rows, test_rows = read(toy_data, domain, "train"), read(toy_data, domain, "test")
        assert len(train_rows) == prep.N_TRAIN[domain] and len(test_rows) == prep.N_TEST
        test_questions = {r["messages"][0]["content"] for r in test_rows}
        assert len(test_questions) == prep.N_TEST
        assert not test_questions & {r["messages"][0]["content"] for r in train_rows}
        for r in train_rows[:50] + test_rows:
            assert train.reward(r["kind"], r["solution"], r["answer"])[0] == 1.0
    kinds = {read(toy_data, d, "test")[0]["kind"] for d in prep.DOMAINS}
    assert kinds == {"math", "exact"}  # \boxed{} and <answer></answer>: format leakage is measurable


def test_teacher_context_copies_per_domain(toy_data):
    """Each copy is a training task re-asked in the SDPO teacher-prompt form (a correct
    demonstration or feedback on a wrong attempt), about CONTEXT_FRACTION[domain] of the lines."""
    prep = load_prepare(toy_data)
    context = read(toy_data, "context", "train")
    counts = collections.Counter(r["domain"] for r in context)
    for domain in prep.DOMAINS:
        n, p = prep.N_TRAIN[domain], prep.CONTEXT_FRACTION[domain]
        assert abs(counts[domain] - n * p) < 5 * math.sqrt(n * p * (1 - p)), (domain, counts[domain], n * p)
    by_id = {r["id"]: r for d in prep.DOMAINS for r in read(toy_data, d, "train")}
    for r in context[::97]:
        original = by_id[r["id"][:-len("-ctx")]]
        question = original["messages"][0]["content"]
        content = r["messages"][0]["content"]
        assert content.startswith(question) and content.endswith("Correctly solve the original question.")
        assert ("Correct solution:" in content) != ("feedback" in content)
        assert r["answer"] == original["answer"] and r["solution"] == original["solution"]
        if "Correct solution:" in content:  # prepare.py writes train.teacher_prompt_text's form without importing train
            assert content == train.teacher_prompt_text(question, original["solution"], None, train.reprompt_template,
                                                        train.solution_template, train.feedback_template)


def test_the_toy_prepare_script_refuses_arguments_it_would_ignore(toy_data):
    """Its sets are fixed in the file: `--seed=3` printed 'wrote ...' and changed nothing."""
    import subprocess
    import sys
    script = os.path.join(toy_data, "toy", "prepare.py")  # (load_prepare's path)
    stamp = os.path.join(toy_data, "toy", "prepared.sha256")
    before = os.stat(stamp).st_mtime_ns
    proc = subprocess.run([sys.executable, script, "--seed=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == ("error: data/toy/prepare.py takes no arguments "
                                                             "(got --seed=3): run it alone")
    assert os.stat(stamp).st_mtime_ns == before  # nothing written
