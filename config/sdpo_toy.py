# SDPO on the toy `sort` domain from the SFT toy base, with grpo_toy.py's batch and budget: the two
# are a side-by-side comparison. Try --density=0.5, --teacher=frozen, --alpha=1.
out_dir = "out/sdpo_toy"
init_from = "out/toy_base/ckpt"
algo = "sdpo"
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
# the toy vocabulary has 99 tokens: the student's top 20 hold nearly all the mass
topk = 20
