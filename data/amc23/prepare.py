"""
AMC 2023 (math-ai/amc23): 40 problems, test only. Answers come as floats (27.0) and are written
as "27".

    python data/amc23/prepare.py                                          # from the HF hub
    python data/amc23/prepare.py --from_file=local/amc23_test.jsonl
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, field, from_files, hub_records, math_row, parse_args, write_splits  # noqa: E402


def to_row(rec, where, split, i):
    problem = field(rec, where, "problem", "question")
    return math_row(f"amc23-{rec.get('id', i)}", problem, field(rec, where, "answer"), url=rec.get("url", ""))


if __name__ == "__main__":
    args = parse_args("amc23", __doc__)
    sources = from_files(args.from_file, only="test") if args.from_file else hub_records("math-ai/amc23")
    write_splits(args.out_dir, convert(sources, to_row, "amc23"))
