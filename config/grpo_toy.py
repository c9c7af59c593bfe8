# GRPO on the toy `sort` domain from the SFT toy base (python train.py config/toy_base.py).
out_dir = "out/grpo_toy"
init_from = "out/toy_base/ckpt"
dataset = "toy/sort"
# a CPU-sized run: 60 iterations of 16 prompts x 8, short answers
max_iters = 60
batch_prompts = 16
micro_batch_size = 128
max_new_tokens = 24
# a tiny model learns at a far higher rate than a 4B one
learning_rate = 3e-4
warmup_iters = 5
eval_interval = 20
