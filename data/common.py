"""
Shared helpers for the real-benchmark data/<name>/prepare.py scripts: command-line arguments,
reading local JSON/JSONL sources, the paper's prompts, schema rows, atomic JSONL writing and
one-line error exits. Also EVAL_PRESETS, the named groups of eval sets that eval.py understands.

Every benchmark's prepare script downloads from the HF hub by default (`datasets.load_dataset`), or converts
local files with --from_file=PATH (repeatable, or a comma list; a file whose name holds
"train" / "test" feeds that split). It writes data/<name>/{train,test}.jsonl (or --out_dir), one
task a line: {"id", "domain", "kind", "messages": [{"role", "content"}...], "answer", ...extras}.
Nothing is half-written: every line is converted and checked first, then each file goes to a
temp file that is renamed into place. A generated set of your own needs only make_row and
write_splits, which checks each row as train.py will (except the characters a tokenizer
cannot encode: train.py checks those once it has read the tokenizer).
"""
import argparse
import json
import os
import random
import sys
import tempfile

from tqdm import tqdm

from configurator import UserError
from data import tasks as task_files
from data.checkers import CHECKS, answer_text

DATA_DIR = os.path.dirname(os.path.abspath(__file__))

# named groups of eval sets (folders under data/), for eval.py's --eval_sets=<preset>
EVAL_PRESETS = {
    "math": ["math500", "aime", "amc23", "gsm8k"],
    "science": ["sciknoweval/biology", "sciknoweval/chemistry", "sciknoweval/material", "sciknoweval/physics"],
    "tool": ["tooluse"],
    "code": ["livecodebench", "humaneval"],
    "general": ["gpqa", "mmlu_pro"],
}
EVAL_PRESETS["paper"] = (EVAL_PRESETS["math"] + EVAL_PRESETS["science"] + EVAL_PRESETS["tool"] + EVAL_PRESETS["code"]
                         + EVAL_PRESETS["general"])

# the paper's prompts
MATH_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def mcq_system(n_options=4):
    """SciKnowEval's system prompt (verbatim for 4 options), generalised to n options."""
    letters = ", ".join(LETTERS[:n_options - 1]) + (", or " if n_options > 2 else " or ") + LETTERS[n_options - 1]
    count = {2: "two", 4: "four", 10: "ten"}.get(n_options, str(n_options))
    return ("\nGiven a question and " + count + " options, please select the right answer. Respond in the "
            "following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n\nFor the answer, only "
            "output the letter corresponding to the correct option (" + letters + "), and nothing else. Do not "
            "restate the answer text. For example, if the answer is \"A\", just output:\n<answer>\nA\n</answer>\n")


def mcq_prompt(question, options):
    """SciKnowEval's user turn: the question, lettered options, then "Please reason step by step."."""
    lines = "\n".join(f"{LETTERS[i]}: {str(o).strip()}" for i, o in enumerate(options))
    return f"{str(question).strip()}\n\n{lines}\nPlease reason step by step."


def shuffled_options(correct, incorrect, key, seed=0):
    """(options, answer letter): the correct option placed by a shuffle seeded by (seed, key)."""
    options = [str(correct).strip()] + [str(o).strip() for o in incorrect]
    order = list(range(len(options)))
    random.Random(f"{seed}-{key}").shuffle(order)
    return [options[i] for i in order], LETTERS[order.index(0)]


def make_row(id, domain, kind, user, answer, system=None, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"id": str(id), "domain": domain, "kind": kind, "messages": messages, "answer": answer_text(answer).strip(), **extra}


def math_row(id, problem, answer, **extra):
    return make_row(id, "math", "math", str(problem).strip() + MATH_SUFFIX, answer, **extra)


# --- errors, arguments, reading --------------------------------------------------------------------

_open_bars = []  # progress bars to close before an error message, so that it is the last line


def die(msg):
    """One line on stderr, exit code 1."""
    for bar in _open_bars:
        bar.close()
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_args(name, doc, add_args=None):
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from_file", action="append", default=[], metavar="PATH",
                   help="convert a local JSON/JSONL file instead of downloading (repeatable or comma list)")
    p.add_argument("--out_dir", default=os.path.join(DATA_DIR, name), help="default: data/%s" % name)
    if add_args:
        add_args(p)
    args = p.parse_args()
    args.from_file = [x.strip() for item in args.from_file for x in item.split(",") if x.strip()]
    return args


_MISSING = object()


def field(rec, where, *names, default=_MISSING):
    """The first of names present in rec (not None, not a blank string: {"problem": "", "question": ...}
    takes the question); else default, else die 'WHERE: missing field'."""
    for n in names:
        value = rec.get(n)
        if value is not None and not (isinstance(value, str) and not value.strip()):
            return value
    if default is not _MISSING:
        return default
    die(f"{where}: missing field {names[0]!r}")


def read_records(path):
    """[(where, record)] from a JSONL file, or a JSON file holding a list (or {"data": list}).
    `where` is "PATH:LINE" (or "PATH:ITEM") for error messages."""
    if not os.path.isfile(path):
        die(f"source file {path} is a directory, not a JSON/JSONL file" if os.path.isdir(path)
            else f"source file not found: {path}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        die(f"source file {path} cannot be read: {e.strerror or e}")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some Windows tools write, is not text
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        die(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}): re-encode the file as UTF-8")
    document_error = None
    if not path.endswith(".jsonl") and text.lstrip()[:1] in "[{":
        try:  # a whole-file JSON document; HF's to_json writes JSON lines into .json files, see below
            doc = json.loads(text)
            doc = doc.get("data", doc) if isinstance(doc, dict) else doc
            if isinstance(doc, list):
                records = [(f"{path}:{i + 1}", r) for i, r in enumerate(doc)]
                for where, r in records:
                    if not isinstance(r, dict):
                        die(f"{where}: not a JSON object")
                return records
        except json.JSONDecodeError as e:  # said if the file is not JSON lines either
            document_error = f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
    records = []
    # JSON lines end at "\n" only: str.splitlines() also splits at U+2028, U+2029 and U+0085, which
    # JSON strings may hold raw (and write_splits writes so, ensure_ascii=False)
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            die(document_error if document_error and not records else f"{path}:{n}: not valid JSON")
        if not isinstance(r, dict):
            die(f"{path}:{n}: not a JSON object")
        records.append((f"{path}:{n}", r))
    return records


def split_of(path, default):
    name = os.path.basename(path).lower()
    return "train" if "train" in name else "test" if "test" in name else default


def from_files(paths, default_split="test", only=None):
    """{split: [(where, record)]} from local files, each assigned to a split by its name
    (or all of them to `only`, for sets that have a single split)."""
    sources = {}
    for path in paths:
        sources.setdefault(only or split_of(path, default_split), []).extend(read_records(path))
    return sources


def load_hub(path, name=None, split=None, **kw):
    """datasets.load_dataset with a one-line error instead of a traceback."""
    try:
        from datasets import load_dataset
    except ImportError:
        die("downloading needs the `datasets` package (pip install datasets), or pass --from_file=PATH")
    print(f"loading {path}{'/' + name if name else ''} {split or ''} from the HF hub")
    try:
        return load_dataset(path, name, split=split, **kw)
    except Exception as e:  # no network, gated set, renamed split, ...
        die(f"could not load {path} from the HF hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"convert a local copy with --from_file=PATH")


def hub_records(path, name=None, splits=("test",), **kw):
    """{split: [(where, record)]} from the hub."""
    return {s: [(f"{path}:{s}[{i}]", dict(r)) for i, r in enumerate(load_hub(path, name, s, **kw))] for s in splits}


# --- converting and writing -------------------------------------------------------------------------

def convert(sources, fn, desc, dedup=False):
    """{split: [rows]}: fn(record, where, split, index) -> row or None (skipped), with progress bars.
    dedup: keep only the first row of each distinct prompt."""
    out = {}
    for split, records in sources.items():
        rows, seen = [], set()
        bar = tqdm(records, desc=f"{desc} {split}", unit="ex")
        _open_bars.append(bar)
        for i, (where, r) in enumerate(bar):
            row = fn(r, where, split, i)
            if row is None:
                continue
            if dedup:
                key = json.dumps(row["messages"])
                if key in seen:
                    continue
                seen.add(key)
            rows.append(row)
        _open_bars.remove(bar)
        out[split] = rows
    return out


def check_row(row, where):
    """The schema every training/eval line must satisfy: what train.py checks when it reads the file
    (data/tasks.py's check, the kinds of data/checkers.py's CHECKS), plus string id, domain and answer."""
    try:
        task_files.check(row, where, CHECKS)
    except UserError as e:
        die(str(e))
    odd = next((key for key in ("id", "domain", "answer") if not isinstance(row.get(key), str)), None)
    if odd:
        die(f"{where}: {odd} must be a string, not {type(row.get(odd)).__name__} (converted line: {json.dumps(row)[:160]})")


def check_splits(out_dir, splits):
    """What write_splits checks before it writes anything: out_dir can be a folder, every split has rows,
    every row fits the schema (check_row) and UTF-8, ids are unique in a split."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        die(f"out_dir {out_dir} is a file, not a folder: give --out_dir a folder")
    for split, rows in splits.items():
        if not rows:
            die(f"no {split} examples to write to {out_dir}")
        seen = set()
        for row in rows:
            check_row(row, f"{split} line {row.get('id')}")
            if row["id"] in seen:
                die(f"duplicate id {row['id']!r} in {split}")
            seen.add(row["id"])
            try:
                json.dumps(row, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate ("\\ud83d" in the source): not UTF-8 text
                die(f"{split} line {row['id']}: holds {e.object[e.start:e.end]!r}, half of a UTF-16 pair, which "
                    "UTF-8 cannot write: fix that record in the source")


def write_splits(out_dir, splits):
    """Check every row (check_splits), then write out_dir/<split>.jsonl atomically (temp file + os.replace)."""
    check_splits(out_dir, splits)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file where a parent folder should be
        die(f"out_dir {out_dir} cannot be made ({e.strerror}): give --out_dir a folder")
    tmps = []
    try:
        for split, rows in splits.items():
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{split}.", suffix=".tmp")
            tmps.append(tmp)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        for tmp, split in zip(tmps, splits):
            os.replace(tmp, os.path.join(out_dir, f"{split}.jsonl"))
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
    for split, rows in splits.items():
        print(f"wrote {len(rows)} lines to {os.path.join(out_dir, split + '.jsonl')}")
