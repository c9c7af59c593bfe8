"""
Generate from a checkpoint (or an HF model id) through its chat template.

    python sample.py --init_from=out/grpo_toy/ckpt --prompt="347+85"
    python sample.py --init_from=Qwen/Qwen3-4B --prompt_file=prompts.txt --num_samples=4 --temperature=0.6

--prompt_file: one prompt per line (or a data JSONL file: its `messages` are used and each
response is scored with train.reward). Same configurator as train.py.
"""
import json
import sys

import torch

import train
from configurator import configure

init_from = "out/grpo_toy/ckpt"  # checkpoint folder or HF model id
prompt = "347+85"  # a single user prompt
prompt_file = ""  # a text file (one prompt per line) or a data .jsonl file; overrides prompt
system = ""  # optional system message
num_samples = 1  # responses per prompt
max_new_tokens = 256  # response length cap
temperature = 0.6  # sampling temperature
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
    dev = train.pick_device(cfg["device"])
    if not cfg["prompt_file"] and not cfg["prompt"]:
        raise train.UserError("nothing to sample: give --prompt=... or --prompt_file=...")
    try:
        prompts = read_prompts(cfg["prompt"], cfg["prompt_file"], cfg["system"])
    except FileNotFoundError:
        raise train.UserError(f"prompt_file {cfg['prompt_file']} not found") from None
    model, tokenizer = train.load_model(cfg["init_from"], {}, dev, torch.float32)
    model.eval()
    generator = torch.Generator().manual_seed(cfg["seed"])
    for messages, task in prompts:
        ids = train.prompt_ids(tokenizer, messages, cfg["enable_thinking"])
        rollout = train.generate(model, [ids], cfg["num_samples"], cfg["max_new_tokens"], cfg["temperature"],
                                 cfg["top_p"], tokenizer.eos_token_id, tokenizer.pad_token_id, generator)
        print(f"### {messages[-1]['content']}")
        for text in train.decode_responses(tokenizer, rollout):
            score = f"  [reward {train.reward(task['kind'], text, task['answer'])[0]:.0f}]" if task else ""
            print(f"--> {text}{score}")


if __name__ == "__main__":
    try:
        main(configure(globals(), sys.argv[1:], __file__))
    except train.UserError as e:
        sys.exit(f"error: {e}")
