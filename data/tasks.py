"""
The task files: data_dir/<name>/{train,test}.jsonl, one task a line, written by data/<name>/prepare.py
and read (every record checked up front) by train.py, eval.py and sample.py:

    {"id": str, "domain": str, "kind": "math" | "mcq" | "tool" | "exact" | "code" (data/checkers.py's CHECKS),
     "answer": str,
     "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...], "solution": str (optional)}

`messages` is the prompt (an optional system turn, then the user turn; earlier user / assistant
turns are few-shot examples); `kind` picks the answer checker (data/checkers.py) and the answer's
shape (checkers.answer_problem: an mcq letter, a tool call list); `solution` is the reference
response that SFT trains on. A "code" answer is a JSON object of unit tests (its schema:
data/checkers.py's code section), checked at load. Relative paths are looked for from the working
directory, then under the repository. Standard library only.
"""
import hashlib
import json
import os

from configurator import UserError
from data.checkers import answer_problem

ROLES = ("system", "user", "assistant")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(path):
    """A relative path as given when it exists from the working directory, else the same path
    under the repository when it exists there (`python ~/nanoSDPO/train.py` run from elsewhere
    still finds data/ and data/toy/tokenizer); else unchanged."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    beside = os.path.join(REPO, path)
    return beside if os.path.exists(beside) else path


def searched(path):
    """Where a missing relative path was looked for, for the error message (once, when both are one)."""
    if os.path.isabs(path) or os.path.abspath(path) == os.path.join(REPO, path):
        return os.path.abspath(path)
    return f"{os.path.abspath(path)} or {os.path.join(REPO, path)}"


def missing_set(data_dir, part, split, path):
    """The one line for a set whose file is missing: a set not prepared yet names its prepare.py; a name
    that is no set (a misspelling, the wrong data_dir) lists the sets that are there instead."""
    head, name = part.split("/")[0], os.path.basename(part)
    prepare = resolve(os.path.join(data_dir, head, "prepare.py"))
    parent = resolve(os.path.dirname(os.path.join(data_dir, part)))
    beside = sorted(n for n in (os.listdir(parent) if os.path.isdir(parent) else ()) if n != name and
                    any(os.path.exists(os.path.join(parent, n, f)) for f in (f"{split}.jsonl", "prepare.py")))
    prepared = any(os.path.exists(os.path.join(parent, n, f"{split}.jsonl")) for n in beside)
    line = f"{path} not found (looked for {searched(path)})"
    folder = resolve(os.path.join(data_dir, part))
    names = os.listdir(folder) if os.path.isdir(folder) else []
    others = sorted(f[:-len(".jsonl")] for f in names if f.endswith(".jsonl"))
    if others:  # the set is there, without this split (aime, math500 ... are test sets only)
        return f"{line}: the set {part} has no {split} split (only {', '.join(others)}): use a set that has one"
    inside = sorted(n for n in names if os.path.exists(os.path.join(folder, n, f"{split}.jsonl")))
    if inside:  # a folder of sets (data/toy), not a set
        return f"{line}: {part} is a folder of sets, not a set: name one of " + ", ".join(f"{part}/{n}" for n in inside)
    if os.path.exists(prepare) and (part == head or os.path.isdir(folder) or not prepared):
        return f"{line}: run `python {prepare}` first"
    if beside:
        return f"{line}: {os.path.join(data_dir, os.path.dirname(part)).rstrip('/')} has no set {name!r}; it has " + ", ".join(beside)
    return f"{line}, and there is no {os.path.join(data_dir, head, 'prepare.py')} to make it: check --data_dir and the set's name"


def load(name, split, data_dir="data", kinds=(), need_solution=False):
    """Read data_dir/<name>/<split>.jsonl ('a+b' mixes sets) and check every record up front, `kind`
    against `kinds`; each error is one line naming file:line, the field and the fix."""
    tasks = []
    for part in name.split("+"):
        path = resolve(os.path.join(data_dir, part, f"{split}.jsonl"))
        if not os.path.exists(path):
            raise UserError(missing_set(data_dir, part, split, path))
        tasks += read_jsonl(path, kinds, need_solution)
    if not tasks:
        raise UserError(f"{name} ({split}) has no tasks: the file is empty; rerun its prepare.py")
    return tasks


def read_lines(path):
    """[(lineno, text)] of a UTF-8 text file's non-blank lines (a relative path is also looked for
    under the repository); a directory, an unreadable file or bytes that are not UTF-8 are one line."""
    path = resolve(path)
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory, not a file")
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except FileNotFoundError:
        raise UserError(f"{path} not found (looked for {searched(path)})") from None
    except OSError as e:
        raise UserError(f"{path} cannot be read: {e.strerror or e}") from None
    lines = []
    for lineno, raw in enumerate(raw_lines, 1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path}:{lineno}: not UTF-8 text: re-encode the file as UTF-8") from None
        if line.strip():
            lines.append((lineno, line.rstrip("\r")))
    return lines


def read_jsonl(path, kinds, need_solution=False):
    """Every task line of one JSONL file, each checked (check)."""
    tasks = []
    for lineno, line in read_lines(path):
        where = f"{path}:{lineno}"
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg})") from None
        check(task, where, kinds, need_solution)
        tasks.append(task)
    return tasks


def check(task, where, kinds, need_solution=False):
    """One record against the schema in the module docstring."""
    if not isinstance(task, dict):
        raise UserError(f"{where}: a task must be a JSON object with kind, messages and answer")
    if task.get("kind") not in kinds:
        raise UserError(f"{where}: kind={task.get('kind')!r} has no answer checker (one of {', '.join(kinds)})")
    check_messages(task.get("messages"), where)
    problem = answer_problem(task["kind"], task.get("answer"))
    if problem:
        raise UserError(f"{where}: {problem}")
    if need_solution and not (isinstance(task.get("solution"), str) and task["solution"].strip()):
        raise UserError(f"{where}: algo=sft needs a 'solution' (the reference response) in every training task")


def check_messages(msgs, where):
    """A prompt: chat turns with a role the chat templates know, the user's turn last (the reply
    follows it, and the teacher rewrites it)."""
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in msgs)):
        raise UserError(f"{where}: messages must be a non-empty list of {{\"role\": str, \"content\": str}} objects")
    odd = next((m["role"] for m in msgs if m["role"] not in ROLES), None)
    if odd is not None:
        raise UserError(f"{where}: message role {odd!r} is not one of {', '.join(ROLES)}")
    if msgs[-1]["role"] != "user":
        raise UserError(f"{where}: the last message must be the user's turn (the response answers it), not "
                        f"{msgs[-1]['role']!r}")


def prompt_chars(task):
    return sum(len(m["content"]) for m in task["messages"])


def fitting(tasks, name, fits, say=print, *, what="prompts", why, fix, required=True):
    """The tasks for which fits(task) holds; the others are left out and counted in one line
    ("NAME: left out 3 of 100 prompts longer than 200 tokens"). None left is an error (naming the
    fix) when the set is required."""
    kept = [t for t in tasks if fits(t)]
    if len(kept) < len(tasks):
        say(f"{name}: left out {len(tasks) - len(kept)} of {len(tasks)} {what} {why}")
    if not kept and required:
        raise UserError(f"{name}: all {len(tasks)} {what} are {why}: {fix}")
    return kept


def fingerprint(*task_sets):
    """A short hash of {name: tasks} dicts: equal on every rank when they all read the same data."""
    return hashlib.sha256(json.dumps(task_sets, sort_keys=True).encode()).hexdigest()[:16]
