"""
GPQA Diamond (Idavidrein/gpqa, config gpqa_diamond): 198 graduate-level science questions, test
only. The hub set is gated: accept its terms on huggingface.co and `huggingface-cli login` first.
The four options are shuffled deterministically (seeded by --seed and the record id) and the
answer is the letter of the correct one; the prompt is SciKnowEval's MCQ format (system prompt
asking for <answer>X</answer>, lettered options, "Please reason step by step.").

    python data/gpqa/prepare.py                                           # from the HF hub
    python data/gpqa/prepare.py --from_file=gpqa_diamond.jsonl            # records with the hub's fields
"""
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import (convert, field, from_files, hub_records, make_row, mcq_prompt, mcq_system,  # noqa: E402
                         parse_args, shuffled_options, write_splits)


def to_row(rec, where, split, i, seed=0):
    key = rec.get("Record ID") or i
    wrong = [field(rec, where, f"Incorrect Answer {k}") for k in (1, 2, 3)]
    options, letter = shuffled_options(field(rec, where, "Correct Answer"), wrong, key, seed)
    return make_row(f"gpqa-{key}", "science", "mcq", mcq_prompt(field(rec, where, "Question"), options), letter,
                    system=mcq_system(4), subject=rec.get("Subdomain") or rec.get("High-level domain") or "")


if __name__ == "__main__":
    args = parse_args("gpqa", __doc__, lambda p: p.add_argument("--seed", type=int, default=0, help="option shuffle seed"))
    sources = (from_files(args.from_file, only="test") if args.from_file
               else hub_records("Idavidrein/gpqa", "gpqa_diamond", ("train",)))
    sources = {"test": [x for records in sources.values() for x in records]}  # the hub calls its only split "train"
    write_splits(args.out_dir, convert(sources, functools.partial(to_row, seed=args.seed), "gpqa"))
