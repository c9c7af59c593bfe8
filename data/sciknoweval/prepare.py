"""
SciKnowEval L3 multiple choice (hicai-zju/SciKnowEval), the paper's science training domains:
biology, chemistry, material, physics. As in the SDPO paper's code: level L3, types
mcq-4-choices and mcq-2-choices, one question per stem, a 90/10 train/test split (seed 42) per
domain; the system prompt asks for <reasoning>...</reasoning><answer>X</answer>.
Writes data/sciknoweval/<domain>/{train,test}.jsonl.

    python data/sciknoweval/prepare.py                                    # all four domains, HF hub
    python data/sciknoweval/prepare.py --domains=chemistry
    python data/sciknoweval/prepare.py --from_file=local/sciknoweval_biology_train.jsonl \\
        --from_file=local/sciknoweval_biology_test.jsonl
A local file holds records in the SDPO format (prompt, system, answer, idx); its domain and split
come from its name (sciknoweval_<domain>_<split>.jsonl) or --domains.
"""
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import (LETTERS, check_splits, convert, die, field, load_hub, make_row, mcq_prompt,  # noqa: E402
                         mcq_system, parse_args, read_records, split_of, write_splits)

DOMAINS = ["biology", "chemistry", "material", "physics"]


def to_row(rec, where, split, i, domain):
    answer, prompt = str(field(rec, where, "answer")).strip().upper(), str(field(rec, where, "prompt"))
    options = re.findall(r"^([A-Z]): ", prompt, re.M)  # mcq_prompt's "A: ..." lines
    if len(answer) != 1 or answer not in LETTERS or (options and answer not in options):
        die(f"{where}: answer {answer!r} is not one of the prompt's option letters ({', '.join(options) or 'none'})")
    return make_row(f"sciknoweval-{domain}-{rec.get('idx', i)}", "science", "mcq", prompt,
                    answer, system=rec.get("system") or mcq_system(4), subject=domain)


def from_hub(domain):
    """{split: [(where, SDPO-format record)]} for one domain, split as in the SDPO paper's code."""
    ds = load_hub("hicai-zju/SciKnowEval", None, "test")
    ds = ds.filter(lambda x: x["domain"] == domain.capitalize() and x["details"]["level"] == "L3"
                   and x["type"] in ("mcq-4-choices", "mcq-2-choices"))
    seen, keep = set(), []
    for i, x in enumerate(ds):  # the hub has several MCQ variants of one stem: keep the first
        if x["question"] not in seen:
            seen.add(x["question"])
            keep.append(i)
    parts = ds.select(keep).train_test_split(test_size=0.1, seed=42)
    return {split: [(f"SciKnowEval:{domain}:{split}[{i}]",
                     {"idx": i, "answer": x["answerKey"], "system": mcq_system(4),
                      "prompt": mcq_prompt(x["question"], x["choices"]["text"])})
                    for i, x in enumerate(parts[split])] for split in ("train", "test")}


if __name__ == "__main__":
    args = parse_args("sciknoweval", __doc__, lambda p: p.add_argument(
        "--domains", default=",".join(DOMAINS), help="comma list of " + ", ".join(DOMAINS)))
    domains = [d.strip().lower() for d in args.domains.split(",") if d.strip()]
    if any(d not in DOMAINS for d in domains):
        die(f"--domains must be among {', '.join(DOMAINS)}, got {args.domains!r}")
    sources = {}  # domain -> split -> records
    if args.from_file:
        for path in args.from_file:
            named = [d for d in DOMAINS if d in os.path.basename(path).lower()]
            domain = named[0] if named else domains[0] if len(domains) == 1 else None
            if domain is None:
                die(f"cannot tell the domain of {path}: name it sciknoweval_<domain>_<split>.jsonl or pass --domains")
            sources.setdefault(domain, {}).setdefault(split_of(path, "test"), []).extend(read_records(path))
    else:
        sources = {d: from_hub(d) for d in domains}
    # every domain converted and checked before any is written: a bad record leaves no domain rewritten
    converted = {d: convert(splits, functools.partial(to_row, domain=d), f"sciknoweval/{d}") for d, splits in sources.items()}
    for domain, splits in converted.items():
        check_splits(os.path.join(args.out_dir, domain), splits)
    for domain, splits in converted.items():
        write_splits(os.path.join(args.out_dir, domain), splits)
