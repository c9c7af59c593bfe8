"""
MATH500 (HuggingFaceH4/MATH-500): the 500-problem test subset of MATH (Lightman et al.), test only.

    python data/math500/prepare.py                                        # from the HF hub
    python data/math500/prepare.py --from_file=local/math500_test.jsonl
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, field, from_files, hub_records, math_row, parse_args, write_splits  # noqa: E402


def to_row(rec, where, split, i):
    return math_row(f"math500-{rec.get('unique_id') or i}", field(rec, where, "problem"), field(rec, where, "answer"),
                    solution=rec.get("solution", ""), subject=rec.get("subject", ""), level=rec.get("level", ""))


if __name__ == "__main__":
    args = parse_args("math500", __doc__)
    sources = from_files(args.from_file, only="test") if args.from_file else hub_records("HuggingFaceH4/MATH-500")
    write_splits(args.out_dir, convert(sources, to_row, "math500"))
