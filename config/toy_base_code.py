# A second toy base: config/toy_base.py's recipe plus the toy code domain func ("find f from examples",
# answers checked in data/sandbox.py). The existing base and the miniature tables built on it stay as
# they are; the feedback experiment (tests/experiments/miniature.py --experiment=feedback) starts here.
out_dir = "out/toy_base_code"
algo = "sft"
# one stage on everything, func and its teacher-context copies included (toy_base's recipe without its
# second stage). func is weighted from the start (10,000 lines, ~23 % of the rows with its copies,
# data/toy/prepare.py) and the stage is 1200 iterations, not 1000, so the five others see as many
# examples as in toy_base. No copies-only second stage: 150 iterations of it (the toy_base recipe)
# took add to 0.083 and rev to 0.072, out of the 10-90 % band (RESULTS.md); the copies mixed in here
# already put the demonstration teacher well above the student on func. (A func-only third stage, the
# recipe before, erased the five others and memorised func's prompts.)
stages = "toy/add+toy/sub+toy/mul+toy/sort+toy/rev+toy/func+toy/context+toy/context_code:1200"
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
