# The paper in miniature, SDPO arm (EMA teacher, tau 0.05): the stages, batch and budget of
# continual_toy_grpo.py. Variants: --density=0.5, --density=0.25, --density_select=disagree,
# --teacher=frozen, --teacher_rate=0.01, --teacher=trust_region, --distill_agg=seq-mean.
out_dir = "out/continual_sdpo"
init_from = "out/toy_base/ckpt"
algo = "sdpo"
stages = "toy/add:30,toy/mul:30,toy/sort:30"
eval_sets = "toy/add,toy/sub,toy/mul,toy/sort,toy/rev"
batch_prompts = 16
micro_batch_size = 128
max_new_tokens = 24
learning_rate = 1e-4  # see continual_toy_grpo.py
warmup_iters = 5
eval_interval = 0  # evals only at stage ends: the accuracy matrix is the measurement
stop_on_collapse = False  # the miniature counts collapses: a run always finishes its stages
# the toy vocabulary has 99 tokens: the student's top 20 hold nearly all the mass
topk = 20
