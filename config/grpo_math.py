# GRPO on math at the paper's settings: train.py's defaults are GRPO's (no std normalisation, clip
# 0.2 / 0.28, no KL, 32 prompts x 8 rollouts, lr 1e-5), and the model, data, budget and memory
# knobs are sdpo_math.py's, so the two runs compare side by side (estimate: 99.0 GB peak, 110.0 GB with the allocator's slack (python tests/bench/memory_estimate.py
# --config=config/grpo_math.py); the decode state -- static KV cache + bf16 decode weights -- is freed before each train step).
#   python train.py config/grpo_math.py
out_dir = "out/grpo_math"
# the model, thinking off
init_from = "Qwen/Qwen3-4B"
# the data: DAPO-Math-17k to train, MATH500 / AIME 2024+2025 (one pooled set) / AMC23 to evaluate in domain,
# GPQA-Diamond across domains (the paper's cross-domain finding) (mean@16, every prompt)
dataset = "dapo_math"
eval_sets = "math500,aime,amc23,gpqa"
eval_n = 16
eval_max_prompts = 0
# competition math needs long answers
max_new_tokens = 4096
# the budget: 300 iterations, an eval and a checkpoint every 50
max_iters = 300
eval_interval = 50
save_interval = 50
# memory: decode 32 rows at a time, recompute blocks in the backward
gen_batch_size = 32
grad_checkpointing = True
micro_batch_size = 8
