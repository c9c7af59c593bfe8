# A second toy base: config/toy_base.py's recipe plus the toy code domain func ("find f from examples",
# answers checked in data/sandbox.py). The existing base and the miniature tables built on it stay as
# they are; the feedback experiment (tests/experiments/miniature.py --experiment=feedback) starts here.
out_dir = "out/toy_base_code"
algo = "sft"
# like toy_base: first everything (func and its teacher-context copies included), then 150 iterations on
# the teacher-context copies alone, so the base uses a demonstration in context on func too. func is
# weighted from the first stage (10,000 lines, ~23 % of it with its copies, data/toy/prepare.py) and the
# stage is 1200 iterations, not 1000, so the five others see as many examples as in toy_base. (A
# func-only third stage, the earlier recipe, erased the five others and memorised func's prompts.)
stages = ("toy/add+toy/sub+toy/mul+toy/sort+toy/rev+toy/func+toy/context+toy/context_code:1200,"
          "toy/context+toy/context_code:150")
eval_sets = "toy/add,toy/sub,toy/mul,toy/sort,toy/rev,toy/func"
eval_interval = 400
max_new_tokens = 24
# from scratch: a large batch, a high learning rate, GPT-style AdamW
batch_prompts = 64
micro_batch_size = 16
learning_rate = 1e-3
warmup_iters = 50
weight_decay = 0.1
beta2 = 0.99
