# SDPO on code at the SDPO paper's rich-feedback settings (arXiv 2601.20802, lasgroup/SDPO
# experiments/rich_feedback/run_sdpo.sh): 32 prompts x 8 rollouts, lr 1e-6 without warmup, reverse KL
# (alpha 1) over the student's top-20 (+ tail), EMA teacher rate 0.01, no self-demonstrations, and
# the environment's feedback (the first failing test: input, expected, got / the error / the timeout)
# in the teacher's prompt when no peer succeeded -- their best teacher context; verl's token-mean
# normalisation (train.py's default distill_agg). Two differences, on
# purpose: one optimizer step per batch (theirs: ppo_mini_batch_size=1, several steps per batch) and
# Qwen3-4B (their 8B's training state fits no single GPU here). Needs an H200-class GPU (the memory
# estimate is beside gen_batch_size below) and the data:
#   python data/livecodebench/prepare.py --train_split && python data/humaneval/prepare.py
#   python train.py config/sdpo_code.py
out_dir = "out/sdpo_code"
algo = "sdpo"
init_from = "Qwen/Qwen3-4B"
# the data: SDPO's LCB v6 train split (the same 131 problems, half of the hidden tests) to train; the
# full tests (LiveCodeBench v6) and HumanEval to evaluate, mean@4 as in their script
dataset = "livecodebench"
eval_sets = "livecodebench,humaneval"
eval_n = 4
eval_max_prompts = 0
# the rich-feedback teacher context
use_feedback = True
feedback_only_without_solution = True
dont_reprompt_on_self_success = True
# the divergence and the teacher
alpha = 1.0
topk = 20
teacher = "ema"
teacher_rate = 0.01
# the optimizer
learning_rate = 1e-6
warmup_iters = 0
# programs are long; the teacher prompt holds a demonstration or the feedback
max_new_tokens = 4096
max_reprompt_len = 10240
# the budget: an eval and a checkpoint every 25 iterations
max_iters = 200
eval_interval = 25
save_interval = 25
# memory: decode 24 rows (3 groups) at a time, recompute blocks in the backward, 4 sequences a micro-batch
# (LCB prompts run to ~2k tokens; estimate: 117.5 GB peak, 130.5 GB with the allocator's slack
# (python tests/bench/memory_estimate.py --config=config/sdpo_code.py --prompt_tokens=2048); 32 rows would need 141.3)
gen_batch_size = 24
grad_checkpointing = True
micro_batch_size = 4
