# GRPO on the toy `sort` domain, starting from the SFT toy base (python train.py config/toy_base.py).
out_dir = "out/grpo_toy"
init_from = "out/toy_base/ckpt"
algo = "grpo"
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
