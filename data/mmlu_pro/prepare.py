"""
MMLU-Pro (TIGER-Lab/MMLU-Pro): 12k ten-option questions over 14 subjects, test split only (its
70-question validation split holds few-shot examples we do not use). Answers are letters A-J;
the prompt is SciKnowEval's MCQ format generalised to the question's number of options.

    python data/mmlu_pro/prepare.py                                       # from the HF hub
    python data/mmlu_pro/prepare.py --from_file=mmlu_pro_test.jsonl       # records with the hub's fields
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import (LETTERS, convert, die, field, from_files, hub_records, make_row, mcq_prompt,  # noqa: E402
                         mcq_system, parse_args, write_splits)


def to_row(rec, where, split, i):
    options = field(rec, where, "options")
    if not isinstance(options, list) or not 2 <= len(options) <= 10:
        die(f"{where}: 'options' must be a list of 2 to 10 options")
    letter = rec.get("answer") or LETTERS[int(field(rec, where, "answer_index"))]
    if len(str(letter)) != 1 or letter not in LETTERS[:len(options)]:  # (not a substring: '' and 'AB' are in 'ABCD')
        die(f"{where}: answer {letter!r} is not one of the {len(options)} options")
    return make_row(f"mmlu_pro-{rec.get('question_id', i)}", "general", "mcq",
                    mcq_prompt(field(rec, where, "question"), options), letter,
                    system=mcq_system(len(options)), subject=rec.get("category", ""))


if __name__ == "__main__":
    args = parse_args("mmlu_pro", __doc__)
    sources = from_files(args.from_file, only="test") if args.from_file else hub_records("TIGER-Lab/MMLU-Pro")
    write_splits(args.out_dir, convert(sources, to_row, "mmlu_pro"))
