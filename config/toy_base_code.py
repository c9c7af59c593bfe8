# A second toy base: config/toy_base.py's recipe plus the toy code domain func ("find f from examples",
# answers checked in data/sandbox.py). The existing base and the miniature tables built on it stay as
# they are; the feedback experiment (tests/experiments/miniature.py --experiment=feedback) starts here.
out_dir = "out/toy_base_code"
algo = "sft"
# like toy_base: 1000 iterations on everything (func and its teacher-context copies included), then 150
# on the teacher-context copies alone, so the base uses a demonstration in context on func too. func is
# the slowest skill (mean@4 0.003 after 500 iterations, 0.022 after 1000, when the five are at 0.09-0.48):
# a third stage on func and its copies alone brings it into the RL range (0.107 after 1450), and the
# five others are forgotten there (<= 0.01): a base for the func experiments only (RESULTS.md)
stages = ("toy/add+toy/sub+toy/mul+toy/sort+toy/rev+toy/func+toy/context+toy/context_code:1000,"
          "toy/context+toy/context_code:150,toy/func+toy/context_code:300")
eval_sets = "toy/add,toy/sub,toy/mul,toy/sort,toy/rev,toy/func"
eval_interval = 500
max_new_tokens = 24
# from scratch: a large batch, a high learning rate, GPT-style AdamW
batch_prompts = 64
micro_batch_size = 16
learning_rate = 1e-3
warmup_iters = 50
weight_decay = 0.1
beta2 = 0.99
