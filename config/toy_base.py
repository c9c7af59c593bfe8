# SFT a small Qwen2-architecture model from scratch on all five toy domains, to partial competence:
# the starting point of every toy RL run (init_from="out/toy_base/ckpt"). init_from='scratch' is the default.
out_dir = "out/toy_base"
algo = "sft"
# 1000 iterations on everything, then 150 on the teacher-context copies alone: the base learns to
# use a demonstration in context (the SDPO teacher) on every domain, not only on arithmetic
stages = "toy/add+toy/sub+toy/mul+toy/sort+toy/rev+toy/context:1000,toy/context:150"
eval_sets = "toy/add,toy/sub,toy/mul,toy/sort,toy/rev"
eval_interval = 500
max_new_tokens = 24
# from scratch: a large batch, a high learning rate, GPT-style AdamW
batch_prompts = 64
micro_batch_size = 16
learning_rate = 1e-3
warmup_iters = 50
weight_decay = 0.1
beta2 = 0.99
