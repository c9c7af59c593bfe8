"""
GSM8K (openai/gsm8k, config main): grade-school math word problems, train 7473 / test 1319.
The answer is the number after "#### " in the reference; the reference, with its <<calculator>>
annotations removed and the number boxed, is kept as `solution` (for SFT).

    python data/gsm8k/prepare.py                                          # from the HF hub
    python data/gsm8k/prepare.py --from_file=local/gsm8k_test.jsonl
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, die, field, from_files, hub_records, math_row, parse_args, write_splits  # noqa: E402


def to_row(rec, where, split, i):
    reference = str(field(rec, where, "answer"))
    if "####" not in reference:
        die(f"{where}: answer has no '#### <final answer>'")
    rationale, final = reference.rsplit("####", 1)
    final = final.strip().replace(",", "")
    solution = re.sub(r"<<[^>]*>>", "", rationale).strip() + f"\n\nThe final answer is $\\boxed{{{final}}}$."
    return math_row(f"gsm8k-{split}-{rec.get('idx', i)}", field(rec, where, "question"), final, solution=solution)


if __name__ == "__main__":
    args = parse_args("gsm8k", __doc__)
    sources = from_files(args.from_file, "test") if args.from_file else hub_records("openai/gsm8k", "main", ("train", "test"))
    write_splits(args.out_dir, convert(sources, to_row, "gsm8k"))
