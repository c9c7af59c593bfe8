# The paper's continual order at full scale: math -> science -> tool use, with its eval sets.
# Prepare first: python data/dapo_math/prepare.py; python data/sciknoweval/prepare.py;
# python data/tooluse/prepare.py; and the eval sets (math500, aime, amc23, gpqa, mmlu_pro).
#   python train.py config/continual_real.py                     # SDPO (EMA teacher)
#   python train.py config/continual_real.py --algo=grpo --out_dir=out/continual_real_grpo
out_dir = "out/continual_real"
init_from = "Qwen/Qwen3-4B"  # Qwen3-8B's fp32 weights + grads + AdamW + teacher (164 GB) fit no single GPU
gen_batch_size = 32  # rows decoded at once: bounds the KV cache (python tests/memory_estimate.py --config=config/continual_real.py: ~116 GB peak)
grad_checkpointing = True
algo = "sdpo"
stages = "dapo_math:100,sciknoweval/biology+sciknoweval/chemistry+sciknoweval/material+sciknoweval/physics:100,tooluse:100"
eval_sets = "math500,aime,amc23,sciknoweval/biology,sciknoweval/chemistry,sciknoweval/material,sciknoweval/physics,tooluse,gpqa,mmlu_pro"
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
max_reprompt_len = 10240
eval_interval = 0
eval_n = 16
eval_max_prompts = 0
save_interval = 50
