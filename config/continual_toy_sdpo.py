# The paper in miniature, SDPO arm: the same stages, batch and budget as continual_toy_grpo.py.
# Variants: --density=0.5, --density=0.25 (sparser supervision), --teacher=frozen (vs EMA tau 0.05).
out_dir = "out/continual_sdpo"
init_from = "out/toy_base/ckpt"
algo = "sdpo"
stages = "toy/add:30,toy/mul:30,toy/sort:30"
eval_sets = "toy/add,toy/sub,toy/mul,toy/sort,toy/rev"
batch_prompts = 16
group_size = 8
micro_batch_size = 128
max_new_tokens = 24
learning_rate = 3e-4
warmup_iters = 5
eval_interval = 0
eval_max_prompts = 100
teacher = "ema"
teacher_rate = 0.05
topk = 20
