# SDPO on the toy `sort` domain from the SFT toy base: same batch and budget as grpo_toy.py,
# so the two are a side-by-side comparison. Try --density=0.5, --teacher=frozen, --alpha=1.
out_dir = "out/sdpo_toy"
init_from = "out/toy_base/ckpt"
algo = "sdpo"
dataset = "toy/sort"
max_iters = 60
batch_prompts = 16
group_size = 8
micro_batch_size = 128
max_new_tokens = 24
learning_rate = 3e-4
warmup_iters = 5
eval_interval = 20
eval_max_prompts = 100
topk = 20
