"""
Generate from a checkpoint (or an HF model id) through its chat template.

    python sample.py --init_from=out/grpo_toy/ckpt --prompt="75+8"
    python sample.py --init_from=Qwen/Qwen3-4B --prompt_file=prompts.txt --num_samples=4 --temperature=0.6

--prompt_file: one prompt per line (or a data JSONL file: its `messages` are used and each
response is scored with train.reward). Same configurator as train.py, and the same input checks:
every record as train.py checks its data, UTF-8 files, prompts that leave no room for
max_new_tokens in the model's context left out and counted.
"""
import sys

import checkpoint
import runtime
import models
import train
from configurator import check_seed, configure
from data import tasks as task_files

init_from = "out/grpo_toy/ckpt"  # checkpoint folder or HF model id
prompt = "75+8"  # a single user prompt
prompt_file = ""  # a text file (one prompt per line) or a data .jsonl file; overrides prompt
system = ""  # optional system message
num_samples = 1  # responses per prompt
max_new_tokens = 0  # response length cap (0: half the model's context, at most 1024 tokens)
temperature = 0.6  # sampling temperature (0 = greedy)
top_p = 0.95  # nucleus sampling
seed = 1337  # sampling seed
device = "auto"  # 'auto', 'cpu', 'cuda', ...
enable_thinking = False  # passed to the chat template (Qwen3)


def read_prompts(prompt, prompt_file, system):
    """-> list of tasks: {"messages"} for plain prompts, or the task records of a data .jsonl file,
    each checked as train.py checks its data (kind, messages, answer)."""
    sys_msg = [{"role": "system", "content": system}] if system else []
    if not prompt_file:
        return [{"id": "--prompt", "messages": sys_msg + [{"role": "user", "content": prompt}]}]
    if prompt_file.endswith(".jsonl"):  # --system replaces a task's own system turn, or adds one
        tasks = task_files.read_jsonl(prompt_file, kinds=train.REWARD_FNS)
        if system:
            tasks = [dict(t, messages=sys_msg + [m for m in t["messages"] if m["role"] != "system"]) for t in tasks]
        return tasks
    return [{"id": f"line {lineno}", "messages": sys_msg + [{"role": "user", "content": line}]}
            for lineno, line in task_files.read_lines(prompt_file)]


def default_response_cap(model):
    """max_new_tokens=0: half the model's context (the other half for the prompt), at most 1024 tokens
    (a toy model's 256-token context: 128; Qwen3's 40960: 1024)."""
    context = models.context_length(model)
    return max(1, min(1024, context // 2)) if context else 1024


def main(cfg):
    check_seed(cfg["seed"])
    if not cfg["prompt_file"] and not cfg["prompt"]:
        raise train.UserError("nothing to sample: give --prompt=... or --prompt_file=...")
    if cfg["num_samples"] < 1:
        raise train.UserError(f"num_samples={cfg['num_samples']} must be >= 1")
    if cfg["max_new_tokens"] < 0:
        raise train.UserError(f"max_new_tokens={cfg['max_new_tokens']} must be >= 1 (or 0: half the model's context)")
    if cfg["temperature"] < 0 or not 0 < cfg["top_p"] <= 1:
        raise train.UserError("temperature must be >= 0 (0 = greedy) and top_p in (0, 1]")
    tasks = read_prompts(cfg["prompt"], cfg["prompt_file"], cfg["system"])
    if not tasks:
        raise train.UserError(f"prompt_file {cfg['prompt_file']} holds no prompts (one per line, or task JSON lines)")
    dev = runtime.pick_device(cfg["device"])
    with checkpoint.reading(cfg["init_from"]):  # as eval.py: not while train.py swaps it in, else the complete copy a crash left
        model, tokenizer = models.load_model(checkpoint.newest_complete(cfg["init_from"]) or cfg["init_from"], dev)
    model.eval()
    max_new_tokens = cfg["max_new_tokens"] or default_response_cap(model)
    # as train.py: prompts that leave no room for max_new_tokens in the context are left out, and counted
    tasks = models.fit_tasks(tasks, cfg["prompt_file"] or "prompt", tokenizer,
                             cap=models.prompt_budget(model, max_new_tokens)[0], enable_thinking=cfg["enable_thinking"],
                             fix="shorten the prompt or lower max_new_tokens (or use a model with a longer context)")
    generator = train.make_generator(cfg["seed"], dev)
    rewards = []  # of the scored responses (a data .jsonl file's), for the mean at the end
    for task in tasks:
        messages = task["messages"]
        ids = train.prompt_ids(tokenizer, messages, cfg["enable_thinking"])
        out = train.generate(model, [ids], group_size=cfg["num_samples"], max_new_tokens=max_new_tokens,
                             temperature=cfg["temperature"], top_p=cfg["top_p"],
                             eos_ids=train.stop_token_ids(model, tokenizer), pad_id=tokenizer.pad_token_id,
                             generator=generator)
        print(f"### {messages[-1]['content']}")
        for text in tokenizer.batch_decode(out.response_ids, skip_special_tokens=True):
            score = ""
            if "kind" in task:
                rewards.append(train.reward(task["kind"], text, task["answer"])[0])
                score = f"  [reward {rewards[-1]:.3g}]"  # a code task's reward is the fraction of its tests passed
            print(f"--> {text}{score}")
    if rewards:
        print(f"mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} responses to {len(tasks)} prompts")


if __name__ == "__main__":
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except train.UserError as e:
        sys.exit(f"error: {e}")
