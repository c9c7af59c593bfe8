"""
ToolUse: ToolAlpaca as used in the SDPO paper (the `datasets/tooluse` split of its code). Each
prompt holds the tool documentation, the ReAct format ("Thought: / Action: / Action Input:")
and the question; it becomes the user turn as is. The answer is the reference tool calls, a JSON
list of {"Action", "Action_Input"} (Action_Input a JSON string), checked by the `tool` reward.

    python data/tooluse/prepare.py                  # train.json/test.json from the SDPO repository
    python data/tooluse/prepare.py --from_file=local/tooluse_test.jsonl
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data.common import convert, die, field, from_files, load_hub, make_row, parse_args, write_splits  # noqa: E402

SDPO_DATA = "https://raw.githubusercontent.com/lasgroup/SDPO/main/datasets/tooluse/"


def to_row(rec, where, split, i):
    answer = field(rec, where, "answer")
    try:
        calls = json.loads(answer) if isinstance(answer, str) else answer
        assert isinstance(calls, list) and calls and all(isinstance(c, dict) and "Action" in c for c in calls)
    except (ValueError, AssertionError):
        die(f"{where}: answer is not a JSON list of {{\"Action\", \"Action_Input\"}} objects")
    answer = answer if isinstance(answer, str) else json.dumps(answer)
    return make_row(f"tooluse-{rec.get('idx', i)}", "tool", "tool", field(rec, where, "prompt"), answer,
                    system=rec.get("system") or None)


if __name__ == "__main__":
    args = parse_args("tooluse", __doc__)
    if args.from_file:
        sources = from_files(args.from_file, "test")
    else:
        ds = load_hub("json", data_files={s: SDPO_DATA + f"{s}.json" for s in ("train", "test")})
        sources = {s: [(f"tooluse:{s}[{i}]", dict(r)) for i, r in enumerate(ds[s])] for s in ("train", "test")}
    write_splits(args.out_dir, convert(sources, to_row, "tooluse"))
