# SDPO on math at the paper's settings (DESIGN.md "Real benchmarks"): Qwen3-4B, thinking off,
# 32 prompts x 8 rollouts, lr 1e-5, EMA teacher tau 0.05, alpha 0.5, top-100 + tail, IS clip 2.
# Needs a GPU and the data: python data/dapo_math/prepare.py && python data/math500/prepare.py ...
#   python train.py config/sdpo_math.py --density=0.5
out_dir = "out/sdpo_math"
init_from = "Qwen/Qwen3-4B"  # Qwen3-8B's fp32 weights + grads + AdamW + teacher (164 GB) fit no single GPU
gen_batch_size = 32  # rows decoded at once: bounds the KV cache (python tests/memory_estimate.py --config=config/sdpo_math.py: ~116 GB peak)
grad_checkpointing = True
algo = "sdpo"
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
teacher = "ema"
teacher_rate = 0.05
alpha = 0.5
distill = "topk"
topk = 100
tail = True
is_clip = 2.0
density = 1.0
max_reprompt_len = 10240
eval_interval = 50
eval_n = 16
eval_max_prompts = 0
save_interval = 50
