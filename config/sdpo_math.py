# SDPO on math at the paper's settings (arXiv 2607.01763): train.py's defaults are those settings
# (32 prompts x 8 rollouts, lr 1e-5, 10 warmup steps, EMA teacher tau 0.05, alpha 0.5, top-100 +
# tail, IS clip 2), so only what differs is set here. Needs an H200-class GPU
# (estimate: 123.2 GB peak, 136.9 GB with the allocator's slack (python tests/bench/memory_estimate.py --config=config/sdpo_math.py))
# and the data:
#   python data/dapo_math/prepare.py && python data/math500/prepare.py && python data/aime/prepare.py && python data/amc23/prepare.py && python data/gpqa/prepare.py
#   python train.py config/sdpo_math.py --density=0.5
# On 8 x 80 GB, FSDP2-sharded (estimate per GPU: 55.4 GB peak, 61.6 GB with the allocator's slack (python tests/bench/memory_estimate.py
# --config=config/sdpo_math.py --parallel=fsdp --world_size=8 --gpu_gb=80)); --init_from=Qwen/Qwen3-8B --micro_batch_size=4 for the 8B:
#   torchrun --nproc_per_node=8 train.py config/sdpo_math.py --parallel=fsdp
out_dir = "out/sdpo_math"
algo = "sdpo"
# the model: Qwen3-4B, thinking off; Qwen3-8B's fp32 weights + grads + AdamW + teacher (164 GB) fit no single GPU
init_from = "Qwen/Qwen3-4B"
# the data: DAPO-Math-17k to train, MATH500 / AIME 2024+2025 (one pooled set) / AMC23 to evaluate in domain,
# GPQA-Diamond across domains (the paper's cross-domain finding) (mean@16, every prompt)
dataset = "dapo_math"
eval_sets = "math500,aime,amc23,gpqa"
eval_n = 16
eval_max_prompts = 0
# competition math needs long answers; the teacher prompt holds a whole demonstration of that length
max_new_tokens = 4096
max_reprompt_len = 10240
# the budget: 300 iterations, an eval and a checkpoint every 50
max_iters = 300
eval_interval = 50
save_interval = 50
# memory: decode 32 rows at a time (a whole batch's KV cache would be 174 GB), recompute blocks in the backward
gen_batch_size = 32
grad_checkpointing = True
micro_batch_size = 8
