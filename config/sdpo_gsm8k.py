# SDPO on GSM8K on one GPU: the rung between the toy runs and config/sdpo_math.py (Qwen3-4B, H200).
# The paper's settings are train.py's defaults, so they are not restated: 32 prompts x 8 rollouts,
# lr 1e-5, 10 warmup steps, AdamW wd 0.01, grad clip 1, temperature 1; EMA teacher tau 0.05,
# alpha 0.5, top-100 + tail, IS clip 2. Also defaults: 100 iterations, an eval every 25, and the
# eval set is the training set's test split (gsm8k/test.jsonl). Same run, GRPO: grpo_gsm8k.py.
#   python data/gsm8k/prepare.py && python train.py config/sdpo_gsm8k.py
# A 24 GB GPU: Qwen3-0.6B, decoding and training fewer rows at once (estimate: 20.6 GB peak, 22.9 GB with the allocator's slack
# (python tests/bench/memory_estimate.py --config=config/sdpo_gsm8k.py --gpu_gb=24 --init_from=Qwen/Qwen3-0.6B --gen_batch_size=32 --micro_batch_size=8)):
#   python train.py config/sdpo_gsm8k.py --init_from=Qwen/Qwen3-0.6B --gen_batch_size=32 --micro_batch_size=8 --out_dir=out/sdpo_gsm8k_0.6b
# this run: SDPO on gsm8k's train split
out_dir = "out/sdpo_gsm8k"
algo = "sdpo"
dataset = "gsm8k"
# 1.7B: 34 GB of fp32 state (weights, grads, AdamW, EMA teacher) leaves an 80 GB GPU room to generate
init_from = "Qwen/Qwen3-1.7B"
# non-thinking GSM8K solutions run a few hundred tokens: 1024 is room enough (4096 is for competition math)
max_new_tokens = 1024
# teacher prompt = question (< 512 tokens) + a <= 1024-token demonstration + templates: never truncated
max_reprompt_len = 2048
# in-loop eval: all 1319 test problems, one sample each (mean@1, std. error ~1 point): ~5 rollout batches
eval_n = 1
eval_max_prompts = 0
# memory (estimate: 67.9 GB peak, 75.5 GB with the allocator's slack (python tests/bench/memory_estimate.py --config=config/sdpo_gsm8k.py --gpu_gb=80);
# the decode state -- the static KV cache of 128 rows + bf16 decode weights -- is freed before each train step)
gen_batch_size = 128
grad_checkpointing = True
micro_batch_size = 16
