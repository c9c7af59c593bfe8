"""
The task files: data_dir/<name>/{train,test}.jsonl, one task a line, written by data/<name>/prepare.py
and read (every record checked up front) by train.py:

    {"id": str, "domain": str, "kind": "math" | "mcq" | "tool" | "exact" | "code", "answer": str,
     "messages": [{"role": "system" | "user", "content": str}, ...], "solution": str (optional)}

`messages` is the prompt (an optional system turn, then the user turn); `kind` picks the answer
checker (data/checkers.py); `solution` is the reference response that SFT trains on. A "code" answer
is a JSON object of unit tests (its schema: data/checkers.py's code section), checked at load.
Standard library only.
"""
import json
import os

from configurator import UserError
from data.checkers import answer_text, code_answer_error


def load(name, split, data_dir="data", kinds=(), need_solution=False):
    """Read data_dir/<name>/<split>.jsonl ('a+b' mixes sets) and check every record up front, `kind`
    against `kinds`; each error is one line naming file:line, the field and the fix."""
    tasks = []
    for part in name.split("+"):
        path = os.path.join(data_dir, part, f"{split}.jsonl")
        if not os.path.exists(path):
            prepare = os.path.join(data_dir, part.split("/")[0], "prepare.py")
            raise UserError(f"{path} not found: run `python {prepare}` first")
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise UserError(f"{where}: not UTF-8 text: re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    task = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where}: not valid JSON ({e.msg})") from None
                check(task, where, kinds, need_solution)
                tasks.append(task)
    if not tasks:
        raise UserError(f"{name} ({split}) has no tasks: the file is empty; rerun its prepare.py")
    return tasks


def check(task, where, kinds, need_solution=False):
    """One record against the schema in the module docstring."""
    if not isinstance(task, dict):
        raise UserError(f"{where}: a task must be a JSON object with kind, messages and answer")
    if task.get("kind") not in kinds:
        raise UserError(f"{where}: kind={task.get('kind')!r} has no answer checker (one of {', '.join(kinds)})")
    msgs = task.get("messages")
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in msgs)):
        raise UserError(f"{where}: messages must be a non-empty list of {{\"role\": str, \"content\": str}} objects")
    if not answer_text(task.get("answer")).strip():
        raise UserError(f"{where}: answer is missing or empty: every task needs a reference answer")
    if task["kind"] == "code" and (error := code_answer_error(task["answer"])):
        raise UserError(f"{where}: answer: {error} (see data/checkers.py, the code section)")
    if need_solution and not (isinstance(task.get("solution"), str) and task["solution"].strip()):
        raise UserError(f"{where}: algo=sft needs a 'solution' (the reference response) in every training task")


def fitting(tasks, name, cap, length, say=print):
    """The tasks whose prompt is at most `cap` tokens (length(messages) counts them); the others are
    left out and counted. A prompt far longer in characters is left out without being tokenized
    (bounded time on any input); none left is an error."""
    kept = [t for t in tasks if sum(len(m["content"]) for m in t["messages"]) <= 64 * cap and length(t["messages"]) <= cap]
    if len(kept) < len(tasks):
        say(f"{name}: left out {len(tasks) - len(kept)} of {len(tasks)} prompts longer than {cap} tokens")
    if not kept:
        raise UserError(f"{name}: every prompt is longer than {cap} tokens: raise max_prompt_len (or use a model with a "
                        "longer context)")
    return kept
