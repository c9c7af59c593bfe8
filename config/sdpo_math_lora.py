# config/sdpo_math.py's run (SDPO, Qwen3-4B, DAPO-Math-17k -> MATH500 / AIME 2024+2025 / AMC23 / GPQA) on one 24 GB GPU:
# LoRA adapters train, the base stays frozen in bf16 (pip install peft). Arithmetic, not a measurement (no GPU
# has run it yet): 18.2 GB peak, 20.2 GB with the allocator's slack (python tests/bench/memory_estimate.py --config=config/sdpo_math_lora.py --gpu_gb=24)
#   python data/dapo_math/prepare.py && python data/math500/prepare.py && python data/aime/prepare.py && python data/amc23/prepare.py && python data/gpqa/prepare.py
#   python train.py config/sdpo_math_lora.py
# The EMA teacher is an EMA of the adapter (the base is shared: 0.26 GB); --teacher=frozen is the base
# with the adapter off (no copy at all). ckpt/ holds the merged model (serve it as is) and ckpt/adapter/.
# What differs from config/sdpo_math.py is marked "# LoRA:"; the rest is restated so the file stands alone.
out_dir = "out/sdpo_math_lora"  # LoRA:
algo = "sdpo"
init_from = "Qwen/Qwen3-4B"
dataset = "dapo_math"
eval_sets = "math500,aime,amc23,gpqa"
eval_max_prompts = 0
max_new_tokens = 4096
max_reprompt_len = 10240
max_iters = 300
eval_interval = 50
save_interval = 50
grad_checkpointing = True
# LoRA: rank-32 adapters on every linear layer but the LM head (attention and MLP projections: 66M params)
lora_rank = 32
lora_alpha = 32.0
# LoRA: the usual ~10x the full fine-tune's learning rate (1e-5) for adapters; not tuned here
learning_rate = 1e-4
# LoRA: memory. 8 rows decoded at once (one eval group of eval_n; 6 GB of KV cache at 4096 + 512 tokens),
# 2 sequences per forward/backward, mean@8 at eval instead of mean@16 (16 rows of cache would not fit)
gen_batch_size = 8
micro_batch_size = 2
eval_n = 8
