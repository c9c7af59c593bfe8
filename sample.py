"""
Generate from a checkpoint (or an HF model id) through its chat template.

    python sample.py --init_from=out/grpo_toy/ckpt --prompt="347+85"
    python sample.py --init_from=Qwen/Qwen3-4B --prompt_file=prompts.txt --num_samples=4 --temperature=0.6

--prompt_file: one prompt per line (or a data JSONL file: its `messages` are used and each
response is scored with train.reward). Same configurator as train.py.
"""
import json
import sys

import models
import train
from configurator import configure

init_from = "out/grpo_toy/ckpt"  # checkpoint folder or HF model id
prompt = "347+85"  # a single user prompt
prompt_file = ""  # a text file (one prompt per line) or a data .jsonl file; overrides prompt
system = ""  # optional system message
num_samples = 1  # responses per prompt
max_new_tokens = 256  # response length cap
temperature = 0.6  # sampling temperature (0 = greedy)
top_p = 0.95  # nucleus sampling
seed = 1337  # sampling seed
device = "auto"  # 'auto', 'cpu', 'cuda', ...
enable_thinking = False  # passed to the chat template (Qwen3)


def read_prompts(prompt, prompt_file, system):
    """-> list of (messages, task or None)."""
    sys_msg = [{"role": "system", "content": system}] if system else []
    if not prompt_file:
        return [(sys_msg + [{"role": "user", "content": prompt}], None)]
    if prompt_file.endswith(".jsonl"):
        out = []
        with open(prompt_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        task = json.loads(line)
                        out.append((task["messages"], task))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise train.UserError(f"{prompt_file}:{lineno}: not a task line with 'messages'") from None
        return out
    with open(prompt_file, encoding="utf-8") as f:
        return [(sys_msg + [{"role": "user", "content": line.rstrip("\n")}], None) for line in f if line.strip()]


def main(cfg):
    dev = models.pick_device(cfg["device"])
    if not cfg["prompt_file"] and not cfg["prompt"]:
        raise train.UserError("nothing to sample: give --prompt=... or --prompt_file=...")
    for key in ("num_samples", "max_new_tokens"):
        if cfg[key] < 1:
            raise train.UserError(f"{key}={cfg[key]} must be >= 1")
    if cfg["temperature"] < 0 or not 0 < cfg["top_p"] <= 1:
        raise train.UserError("temperature must be >= 0 (0 = greedy) and top_p in (0, 1]")
    try:
        prompts = read_prompts(cfg["prompt"], cfg["prompt_file"], cfg["system"])
    except FileNotFoundError:
        raise train.UserError(f"prompt_file {cfg['prompt_file']} not found") from None
    if not prompts:
        raise train.UserError(f"prompt_file {cfg['prompt_file']} holds no prompts (one per line, or task JSON lines)")
    model, tokenizer = models.load_model(cfg["init_from"], dev)
    model.eval()
    generator = train.make_generator(cfg["seed"], dev)
    for messages, task in prompts:
        ids = train.prompt_ids(tokenizer, messages, cfg["enable_thinking"])
        out = train.generate(model, [ids], group_size=cfg["num_samples"], max_new_tokens=cfg["max_new_tokens"],
                             temperature=cfg["temperature"], top_p=cfg["top_p"],
                             eos_ids=train.stop_token_ids(model, tokenizer), pad_id=tokenizer.pad_token_id,
                             generator=generator)
        print(f"### {messages[-1]['content']}")
        for text in tokenizer.batch_decode(out.response_ids, skip_special_tokens=True):
            score = f"  [reward {train.reward(task['kind'], text, task['answer'])[0]:.0f}]" if task else ""
            print(f"--> {text}{score}")


if __name__ == "__main__":
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except train.UserError as e:
        sys.exit(f"error: {e}")
