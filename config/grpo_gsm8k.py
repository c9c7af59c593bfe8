# GRPO on GSM8K on one GPU: the same model, batch, budget, eval and memory knobs as sdpo_gsm8k.py,
# so the two compare side by side (wall-clock included). The paper's GRPO settings are train.py's
# defaults, so they are not restated: algo 'grpo', 32 prompts x 8 rollouts, lr 1e-5, 10 warmup
# steps, AdamW wd 0.01, grad clip 1, temperature 1, clip 0.2 / 0.28, no std normalisation, no KL;
# 100 iterations, an eval every 25 on the training set's test split (gsm8k/test.jsonl).
#   python data/gsm8k/prepare.py && python train.py config/grpo_gsm8k.py
# A 24 GB GPU (estimate: 18.2 GB peak, 20.3 GB with the allocator's slack (python tests/bench/memory_estimate.py --config=config/grpo_gsm8k.py
# --gpu_gb=24 --init_from=Qwen/Qwen3-0.6B --gen_batch_size=32 --micro_batch_size=8)):
#   python train.py config/grpo_gsm8k.py --init_from=Qwen/Qwen3-0.6B --gen_batch_size=32 --micro_batch_size=8 --out_dir=out/grpo_gsm8k_0.6b
# this run: GRPO on gsm8k's train split
out_dir = "out/grpo_gsm8k"
dataset = "gsm8k"
# 1.7B: 27.5 GB of fp32 state (weights, grads, AdamW) leaves an 80 GB GPU room to generate
init_from = "Qwen/Qwen3-1.7B"
# non-thinking GSM8K solutions run a few hundred tokens: 1024 is room enough (4096 is for competition math)
max_new_tokens = 1024
# in-loop eval: all 1319 test problems, one sample each (mean@1, std. error ~1 point): ~5 rollout batches
eval_n = 1
eval_max_prompts = 0
# memory (estimate: 68.7 GB peak, 76.3 GB with the allocator's slack (python tests/bench/memory_estimate.py --config=config/grpo_gsm8k.py --gpu_gb=80);
# the decode state -- the static KV cache of 128 rows + bf16 decode weights -- stays beside the train step)
gen_batch_size = 128
grad_checkpointing = True
micro_batch_size = 16
