"""
AIME 2024 (HuggingFaceH4/aime_2024) and AIME 2025 (yentinglin/aime_2025), 30 problems each, in
one test file with ids "aime24-..." / "aime25-..." (eval can split them by that prefix).
Answers are integers 0-999 (written without leading zeros).

    python data/aime/prepare.py                                           # both years from the HF hub
    python data/aime/prepare.py --from_file=local/aime24_test.jsonl
A task's year comes from its record's year / url fields, else its file's name (aime24, 2025, ...).
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, field, hub_records, math_row, parse_args, read_records, write_splits  # noqa: E402

HUB = {"24": ("HuggingFaceH4/aime_2024", "train"), "25": ("yentinglin/aime_2025", "train")}


def year_of(*texts):
    for t in texts:
        m = re.search(r"(?:aime[_-]?|20)(2[0-9])(?!\d)", str(t or "").lower())
        if m:
            return m.group(1)
    return None


def to_row(rec, where, split, i):
    answer = str(field(rec, where, "answer")).strip()
    answer = str(int(float(answer))) if re.fullmatch(r"\d+(\.0*)?", answer) else answer  # "025" -> "25"
    source = os.path.basename(where.rsplit(":", 1)[0])  # the file's (or hub set's) own name, not its folders'
    year = year_of(rec.get("year"), rec.get("url"), source)  # the record's own year first
    prefix = f"aime{year}" if year else "aime"
    extra = {"solution": rec["solution"]} if isinstance(rec.get("solution"), str) else {}
    return math_row(f"{prefix}-{rec.get('id', i)}", field(rec, where, "problem", "question"), answer, **extra)


if __name__ == "__main__":
    args = parse_args("aime", __doc__)
    if args.from_file:
        records = [x for path in args.from_file for x in read_records(path)]
    else:
        records = [x for path, split in HUB.values() for x in hub_records(path, None, (split,))[split]]
    write_splits(args.out_dir, convert({"test": records}, to_row, "aime"))
