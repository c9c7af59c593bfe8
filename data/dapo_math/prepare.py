"""
DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k): the paper's math training set, train only.
The hub copy repeats each of its ~17k problems many times and wraps them in DAPO's
"Answer: $Answer" instructions; we keep each problem once, unwrapped, with the paper's
"\\boxed{}" prompt. All answers are integers.

Fallback (--source=math): the MATH training set (EleutherAI/hendrycks_math, 7 subjects, 7500
problems), the answer being the last \\boxed{} of the reference solution.

    python data/dapo_math/prepare.py                       # DAPO-Math-17k from the HF hub
    python data/dapo_math/prepare.py --source=math         # MATH train instead
    python data/dapo_math/prepare.py --from_file=dapo.jsonl   # DAPO records, or {problem, answer|solution}
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.checkers import boxed_answer  # noqa: E402
from data.common import (convert, die, field, from_files, hub_records, load_hub, math_row, parse_args,  # noqa: E402
                         write_splits)

MATH_SUBJECTS = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                 "number_theory", "prealgebra", "precalculus"]
_DAPO_WRAP = re.compile(r"^Solve the following math problem step by step\..*?\n\n(.*)\n\nRemember to put your "
                        r"answer on its own line after \"Answer:\"\.?\s*$", re.S)


def to_row(rec, where, split, i):
    if "prompt" in rec and "reward_model" in rec:  # a DAPO record
        prompt = rec["prompt"]
        text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
        m = _DAPO_WRAP.match(text)
        problem, answer = (m.group(1) if m else text).strip(), (rec["reward_model"] or {}).get("ground_truth")
        source, extra = "dapo", {"source_index": str((rec.get("extra_info") or {}).get("index", ""))}
    else:  # MATH-style: problem + answer, or problem + solution ending in \boxed{}
        problem = str(field(rec, where, "problem", "question")).strip()
        answer = field(rec, where, "answer", default=None)  # (not `or`: an answer of 0 is an answer)
        if answer is None:
            answer = boxed_answer(str(field(rec, where, "solution", "answer")))
        source, extra = "math", {"solution": rec["solution"]} if isinstance(rec.get("solution"), str) else {}
    if answer is None or str(answer).strip() == "":
        die(f"{where}: no answer (need 'answer', reward_model.ground_truth or a \\boxed{{}} solution)")
    return math_row(f"{source}-{i}", problem, answer, **extra)


if __name__ == "__main__":
    args = parse_args("dapo_math", __doc__, lambda p: p.add_argument(
        "--source", choices=["dapo", "math"], default="dapo", help="hub source: DAPO-Math-17k or MATH train"))
    if args.from_file:
        sources = from_files(args.from_file, only="train")
    elif args.source == "dapo":  # ~1.8M rows, each problem repeated: keep the first of each while reading
        seen, records = set(), []
        for i, rec in enumerate(load_hub("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")):
            if str(rec["prompt"]) not in seen:
                seen.add(str(rec["prompt"]))
                records.append((f"DAPO-Math-17k:train[{i}]", rec))
        sources = {"train": records}
    else:
        sources = {"train": [x for subject in MATH_SUBJECTS
                             for x in hub_records("EleutherAI/hendrycks_math", subject, ("train",))["train"]]}
    write_splits(args.out_dir, convert(sources, to_row, "dapo_math", dedup=True))
