# GRPO on math at the paper's settings: the same model, batch and budget as sdpo_math.py;
# no std normalisation, clip 0.2 / 0.28, no KL.
#   python train.py config/grpo_math.py
out_dir = "out/grpo_math"
init_from = "Qwen/Qwen3-4B"  # Qwen3-8B's fp32 weights + grads + AdamW + teacher (164 GB) fit no single GPU
gen_batch_size = 32  # rows decoded at once: bounds the KV cache (python tests/memory_estimate.py --config=config/grpo_math.py: ~89 GB peak)
grad_checkpointing = True
algo = "grpo"
dataset = "dapo_math"
eval_sets = "math500,aime,amc23"
max_iters = 300
batch_prompts = 32
group_size = 8
micro_batch_size = 8
max_new_tokens = 4096
temperature = 1.0
learning_rate = 1e-5
warmup_iters = 10
weight_decay = 0.01
grad_clip = 1.0
norm_adv_std = False
clip_low = 0.2
clip_high = 0.28
kl_coef = 0.0
eval_interval = 50
eval_n = 16
eval_max_prompts = 0
save_interval = 50
