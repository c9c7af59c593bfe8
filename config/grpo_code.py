# GRPO on code, the baseline of the SDPO paper's rich-feedback experiment (LCB v6: SDPO 48.8 %,
# GRPO 41.2 % with Qwen3-8B): the model, data, lr and budget are sdpo_code.py's so the two runs
# compare side by side (micro_batch_size 8, not 4: GRPO holds no teacher; the loss is normalised over
# the whole step, so no number changes with it); train.py's defaults are GRPO's otherwise (no std
# normalisation, clip 0.2 / 0.28, no KL). The feedback is computed but has no reader.
#   python data/livecodebench/prepare.py --train_split && python data/humaneval/prepare.py
#   python train.py config/grpo_code.py
out_dir = "out/grpo_code"
algo = "grpo"
init_from = "Qwen/Qwen3-4B"
dataset = "livecodebench"
eval_sets = "livecodebench,humaneval"
eval_n = 4
eval_max_prompts = 0
learning_rate = 1e-6
warmup_iters = 0
max_new_tokens = 4096
max_iters = 200
eval_interval = 25
save_interval = 25
# estimate: 103.4 GB peak, 114.9 GB with the allocator's slack (python tests/bench/memory_estimate.py --config=config/grpo_code.py --prompt_tokens=2048)
gen_batch_size = 24
grad_checkpointing = True
micro_batch_size = 8
