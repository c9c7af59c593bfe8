"""Benchmark: one GRPO iteration vs one SDPO iteration at equal batch, and the rollout
(train.generate) vs plain HF `model.generate`, on the toy model.

    python tests/bench/bench_step.py                                  # toy base if trained, else scratch
    python tests/bench/bench_step.py --init_from=scratch --iters=3
    python tests/bench/bench_step.py --dataset=toy/sort --max_new_tokens=24  # sort/rev answers are 23 tokens
    python tests/bench/bench_step.py --no_ctx             # without the train set's teacher-context copies
    python tests/bench/bench_step.py --threads=0          # torch's default thread count (default here: 1)
    python tests/bench/bench_step.py --device=cuda --static   # on a GPU (bf16 autocast; times synchronised)

Iterations are assembled the way train.main assembles them (build_batch -> loss_backward ->
optimizer_step -> ema_update), each algorithm on its own copy of the same initial weights, with
its own AdamW and (SDPO) its own teacher. Both see the same prompts and the same sampling seed
at the same iteration index. After one untimed warm-up iteration each, the timed iterations are
interleaved in ABBA order (grpo, sdpo, sdpo, grpo, ...) so that machine noise and cache effects
hit both alike; per-phase numbers are medians over the timed iterations.

Phases: gen (train.generate + decoding), reward, context (advantages, teacher prompts, density
masks: the rest of build_batch), reference (KL reference forward; 0 unless kl_coef > 0),
teacher (teacher forward, SDPO only), student (student forward + fused loss + backward),
optimizer (clip + AdamW), ema (teacher EMA update, SDPO with teacher='ema').

Note: GRPO drops groups whose rewards are all equal from the loss, and SDPO drops responses
without a successful peer, so "loss_seqs" (sequences that reach the student forward) is printed
for both: with a random scratch model nothing succeeds, GRPO trains on nothing, and the ratio
only compares rollout costs. For a scratch run success_threshold defaults to 0.0 so that every
response has a peer and the SDPO teacher forward actually runs.

The generation comparison runs train.generate and HF generate on the same (left-padded)
prompts, group_size samples each, interleaved, --gen_runs times each after a warm-up, and counts
generated tokens the same way for both: up to and including the first EOS. HF's generate is
called with top_k=0 (HF fills in top_k=50 by default, which would sample from a truncated
distribution and add a top-k filter per step); temperature 1, top_p 1, like the rollout.

The last line printed is one JSON object.
"""
import argparse
import copy
import json
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
import runtime  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402
from configurator import config_keys  # noqa: E402

DEFAULT_CKPT = os.path.join("out", "toy_base", "ckpt")
PHASES = ["gen_s", "reward_s", "context_s", "reference_s", "teacher_s", "student_s", "optimizer_s", "ema_s"]


def defaults():
    """train.py's config defaults as a dict (the keys configurator.py accepts)."""
    return {k: getattr(train, k) for k in config_keys(vars(train), train.__file__)}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class Runner:
    """One algorithm's model, optimizer, teacher and iteration counter."""

    def __init__(self, algo, base, tokenizer, cfg, dev):
        self.algo, self.tokenizer, self.dev = algo, tokenizer, dev
        self.autocast = runtime.make_autocast(dev, cfg["dtype"])
        self.cfg = dict(cfg, algo=algo)
        train.check_config(self.cfg)
        self.model = copy.deepcopy(base).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["learning_rate"],
                                           betas=(cfg["beta1"], cfg["beta2"]), weight_decay=cfg["weight_decay"])
        self.initial = None
        if (algo == "sdpo" and train.Teacher.needs_initial(cfg["teacher"])) or cfg["kl_coef"] > 0:
            self.initial = models.frozen_copy(self.model)
        self.teacher = train.Teacher.create(self.cfg, self.model, self.initial)
        self.it = 0
        self.records = []

    def step(self, tasks, seed):
        """One iteration as train.main runs it; returns the record of phase times."""
        cfg, model = self.cfg, self.model
        generator = train.make_generator(seed, self.dev)
        t0 = clock(self.dev)
        train.set_lr(self.optimizer, self.it, learning_rate=cfg["learning_rate"], warmup_iters=cfg["warmup_iters"],
                     total_iters=cfg["max_iters"], decay_lr=cfg["decay_lr"], min_lr=cfg["min_lr"])
        batch, metrics = train.build_batch(tasks, model, self.tokenizer, cfg, generator, self.dev, autocast=self.autocast)
        t1 = clock(self.dev)
        m = train.loss_backward(model, batch, cfg, self.dev, teacher=self.teacher, initial_model=self.initial)
        t2 = clock(self.dev)
        train.optimizer_step(model, self.optimizer, cfg["grad_clip"])
        t3 = clock(self.dev)
        if self.teacher is not None:
            self.teacher.after_step(model)
        t4 = clock(self.dev)
        self.it += 1
        n_seq = len(batch.response_ids)
        used = [i for i in range(n_seq) if batch.pg_weight[i].any() or batch.distill_weight[i].any()]
        loss_seqs = len(used)
        teachers = [i for i in used if batch.teacher_prompt_ids[i] is not None and batch.distill_weight[i].any()]
        teacher_seqs = len(teachers)
        rec = {
            "gen_s": metrics["gen_s"], "reward_s": metrics["reward_s"],
            "context_s": (t1 - t0) - metrics["gen_s"] - metrics["reward_s"],
            "reference_s": m["reference_s"], "teacher_s": m["teacher_s"], "student_s": m["student_s"],
            "loss_other_s": (t2 - t1) - m["reference_s"] - m["teacher_s"] - m["student_s"],
            "optimizer_s": t3 - t2, "ema_s": t4 - t3, "iter_s": t4 - t0,
            "tokens": metrics["tokens"], "acc": metrics["acc"], "loss_seqs": loss_seqs, "teacher_seqs": teacher_seqs,
            "seqs": n_seq, "reward": metrics["reward"],
            "prompt_max_len": max(len(p) for p in batch.prompt_ids),
            # tokens through the student forward+backward and through the teacher forward (unpadded, before
            # its sharing), how many distinct teacher prompts (each prefilled once) and distinct
            # (teacher prompt, response) pairs (each read once) there were in the step
            "student_seq_tokens": sum(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in used),
            "teacher_seq_tokens": sum(len(batch.teacher_prompt_ids[i]) + len(batch.response_ids[i]) for i in teachers),
            "teacher_prompt_tokens": sum(len(batch.teacher_prompt_ids[i]) for i in teachers),
            "teacher_unique_prompts": len({tuple(batch.teacher_prompt_ids[i]) for i in teachers}),
            "teacher_unique_pairs": len({(tuple(batch.teacher_prompt_ids[i]), tuple(batch.response_ids[i])) for i in teachers}),
        }
        rec["tok_s"] = rec["tokens"] / rec["iter_s"]
        return rec


def clock(dev):
    """perf_counter after the device has finished its queued work (CUDA runs asynchronously)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def bench_generate(model, tokenizer, prompts, args, dev, autocast):
    """Median seconds and tokens/s of train.generate vs HF generate, interleaved (ABBA)."""
    eos, pad = train.stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    ids, mask = models.pad_batch(prompts, pad, left=True)
    ids, mask = ids.to(dev), mask.to(dev)
    width = ids.shape[1]

    def ours(seed, static=False):
        g = train.make_generator(seed, dev)
        t0 = clock(dev)
        with autocast():
            r = train.generate(model, prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                               temperature=1.0, top_p=1.0, eos_ids=eos, pad_id=pad, generator=g, static=static)
        dt = clock(dev) - t0
        return dt, sum(len(x) for x in r.response_ids)

    def static(seed):
        return ours(seed, static=True)

    def hf(seed):
        torch.manual_seed(seed)
        t0 = clock(dev)
        with torch.no_grad(), autocast():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 num_return_sequences=args.group_size, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=pad, eos_token_id=eos)
        dt = clock(dev) - t0
        return dt, int(train.response_mask(out[:, width:].cpu(), eos).sum())

    methods = [("rollout", ours), ("hf", hf)] + ([("static", static)] if args.static else [])
    for _, fn in methods:
        fn(args.seed)  # warm-up (for static: the torch.compile of the decode step)
    res = {name: [] for name, _ in methods}
    for r in range(args.gen_runs):
        order = methods if r % 2 == 0 else methods[::-1]
        for name, fn in order:
            res[name].append(fn(args.seed + 100 + r))
    out = {}
    for name, runs in res.items():
        out[name] = {"s": median([t for t, _ in runs]), "tokens": median([n for _, n in runs]),
                     "tok_s": median([n / t for t, n in runs]), "runs_s": [round(t, 4) for t, _ in runs]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init_from", default=None,
                    help=f"'scratch' or an HF folder (default: {DEFAULT_CKPT} if it exists, else scratch)")
    ap.add_argument("--dataset", default="toy/add")
    ap.add_argument("--no_ctx", action="store_true",
                    help="drop the toy train set's teacher-context copies (ids ending in -ctx) from the prompts; "
                         "training samples them, so by default they stay")
    ap.add_argument("--batch_prompts", type=int, default=16)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--iters", type=int, default=15,
                    help="timed iterations per algorithm (after 1 warm-up each; fewer than ~10 give unstable medians here)")
    ap.add_argument("--gen_runs", type=int, default=3, help="timed generation runs per method (after 1 warm-up each)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (bf16 autocast there, as train.py's dtype='auto')")
    ap.add_argument("--static", action="store_true",
                    help="also time train.generate(static=True): static KV cache + torch.compile'd step (compiles first)")
    ap.add_argument("--success_threshold", type=float, default=None,
                    help="SDPO peer threshold (default: train.py's 1.0; 0.0 for a scratch model, whose responses never succeed)")
    ap.add_argument("--micro_batch_size", type=int, default=train.micro_batch_size, help="sequences per forward/backward")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the toy model's ops are tiny, and on a shared 2-core CPU two OpenMP "
                         "threads thrash, up to 5x slower; 0 = torch's default)")
    args = ap.parse_args()
    os.chdir(ROOT)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.init_from is None:
        args.init_from = DEFAULT_CKPT if os.path.exists(os.path.join(DEFAULT_CKPT, "config.json")) else "scratch"
    scratch = args.init_from == "scratch"
    if args.success_threshold is None:
        args.success_threshold = 0.0 if scratch else train.success_threshold
    cfg = dict(defaults(), init_from=args.init_from, batch_prompts=args.batch_prompts, group_size=args.group_size,
               max_new_tokens=args.max_new_tokens, seed=args.seed, success_threshold=args.success_threshold,
               micro_batch_size=args.micro_batch_size, dataset=args.dataset)
    dev = runtime.pick_device(args.device)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    try:
        base, tokenizer = models.load_model(args.init_from, dev, scratch=cfg)
        tasks = train.load_tasks(args.dataset, "train", cfg["data_dir"])
        n_ctx = sum(str(t.get("id", "")).endswith("-ctx") for t in tasks)
        if args.no_ctx:
            tasks = [t for t in tasks if not str(t.get("id", "")).endswith("-ctx")]
    except train.UserError as e:
        sys.exit(f"error: {e}")
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model {args.init_from} ({n_params / 1e6:.2f}M params, vocab {len(tokenizer)}), {args.dataset}, "
          f"{args.batch_prompts} prompts x {args.group_size} rollouts, max_new_tokens {args.max_new_tokens}, "
          f"torch threads {torch.get_num_threads()}; train set has {n_ctx} teacher-context copies (-ctx), "
          + ("dropped (--no_ctx)" if args.no_ctx else "sampled like the others (as training does)"))
    print(f"SDPO: teacher={cfg['teacher']} distill={cfg['distill']} topk={cfg['topk']} alpha={cfg['alpha']} "
          f"success_threshold={args.success_threshold}"
          + (" (scratch model: 0.0 so every response has a peer and the teacher forward runs)" if scratch else ""),
          flush=True)

    runners = {a: Runner(a, base, tokenizer, cfg, dev) for a in ("grpo", "sdpo")}
    data_rng = random.Random(args.seed)
    batches = []
    for k in range(args.iters + 1):
        step_tasks = [data_rng.choice(tasks) for _ in range(args.batch_prompts)]
        if k > 0:
            batches.append(step_tasks)
        order = ["grpo", "sdpo"] if k % 2 == 1 or k == 0 else ["sdpo", "grpo"]  # ABBA after the warm-up
        recs = {a: runners[a].step(step_tasks, args.seed + k) for a in order}
        if k > 0:
            for a in order:
                runners[a].records.append(recs[a])
        print(f"  iter {k}{' (warm-up)' if k == 0 else ''}: " + ", ".join(
            f"{a} {recs[a]['iter_s']:.3f}s ({recs[a]['tokens']} tok, {recs[a]['loss_seqs']} seqs in loss)"
            for a in ("grpo", "sdpo")) + f"; longest prompt {recs['grpo']['prompt_max_len']} tokens", flush=True)

    summ = {}
    for a, r in runners.items():
        recs = r.records
        summ[a] = {key: median([x[key] for x in recs]) for key in
                   PHASES + ["loss_other_s", "iter_s", "tokens", "tok_s", "acc", "reward", "loss_seqs", "teacher_seqs", "seqs",
                    "student_seq_tokens", "teacher_seq_tokens", "teacher_prompt_tokens", "teacher_unique_prompts",
                    "teacher_unique_pairs", "prompt_max_len"]}
    g, s = summ["grpo"], summ["sdpo"]
    ratio = s["iter_s"] / g["iter_s"]
    # the same ratio pair by pair (each pair ran back to back)
    pair_ratios = [b["iter_s"] / a["iter_s"] for a, b in zip(runners["grpo"].records, runners["sdpo"].records)]

    print(f"\nper-iteration medians over {args.iters} timed iterations (seconds)")
    print(f"{'phase':<14}{'grpo':>10}{'sdpo':>10}{'sdpo-grpo':>11}")
    for key in PHASES + ["loss_other_s", "iter_s"]:
        print(f"{key[:-2]:<14}{g[key]:>10.4f}{s[key]:>10.4f}{s[key] - g[key]:>+11.4f}")
    print("(gen = train.generate + decode; context = advantages, teacher prompts, density masks; "
          "student = student forward + fused loss + backward)")
    for key, label, fmt in (("prompt_max_len", "max prompt", ".0f"), ("tokens", "resp tokens", ".0f"), ("tok_s", "resp tok/s", ".0f"), ("reward", "reward", ".3f"),
                            ("loss_seqs", "seqs in loss", ".0f"), ("student_seq_tokens", "student tok", ".0f"),
                            ("teacher_seqs", "teacher seqs", ".0f"), ("teacher_seq_tokens", "teacher tok", ".0f"),
                            ("teacher_prompt_tokens", "  of prompt", ".0f"), ("teacher_unique_prompts", "uniq t.prompts", ".0f"),
                            ("teacher_unique_pairs", "uniq t.pairs", ".0f")):
        print(f"{label:<14}{g[key]:>10{fmt}}{s[key]:>10{fmt}}")
    print(f"sdpo/grpo iteration time: {ratio:.3f} (median of medians); pairwise ratios "
          f"{', '.join(f'{x:.2f}' for x in pair_ratios)}; median {median(pair_ratios):.3f}  [target <= 1.3]")
    if g["loss_seqs"] == 0:
        print("note: GRPO had no sequence with signal (all-equal rewards), so its iteration is rollout + reward only")

    gen_model = copy.deepcopy(base).eval()
    prompts = [train.prompt_ids(tokenizer, t["messages"]) for t in batches[0]]  # the first timed iteration's prompts
    plens = sorted(len(p) for p in prompts)
    gb = bench_generate(gen_model, tokenizer, prompts, args, dev, runtime.make_autocast(dev, cfg["dtype"]))
    speedup = gb["hf"]["s"] / gb["rollout"]["s"]
    print(f"\ngeneration, {args.batch_prompts} prompts (those of the first timed iteration; prompt lengths "
          f"{plens[0]}..{plens[-1]}, median {plens[len(plens) // 2]}) x {args.group_size} samples, "
          f"max_new_tokens {args.max_new_tokens}, median of {args.gen_runs} interleaved runs")
    print(f"{'method':<16}{'seconds':>10}{'tokens':>10}{'tok/s':>10}   runs")
    for name, label in (("rollout", "train.generate"), ("hf", "HF generate"), ("static", "static+compile")):
        if name in gb:
            x = gb[name]
            print(f"{label:<16}{x['s']:>10.4f}{x['tokens']:>10.0f}{x['tok_s']:>10.0f}   {x['runs_s']}")
    print(f"rollout speedup (hf_generate_s / rollout_s): {speedup:.2f}  [target >= 1.0]")
    if "static" in gb:
        print(f"static speedup (rollout_s / static_s): {gb['rollout']['s'] / gb['static']['s']:.2f}")

    result = {
        "grpo_iter_s": g["iter_s"], "sdpo_iter_s": s["iter_s"], "sdpo_over_grpo": ratio,
        "sdpo_over_grpo_pairwise_median": median(pair_ratios),
        "grpo_phases": {k[:-2]: g[k] for k in PHASES}, "sdpo_phases": {k[:-2]: s[k] for k in PHASES},
        "grpo_tok_s": g["tok_s"], "sdpo_tok_s": s["tok_s"], "grpo_tokens": g["tokens"], "sdpo_tokens": s["tokens"],
        "grpo_loss_seqs": g["loss_seqs"], "sdpo_loss_seqs": s["loss_seqs"], "sdpo_teacher_seqs": s["teacher_seqs"],
        "grpo_reward": g["reward"], "sdpo_reward": s["reward"],
        "grpo_student_seq_tokens": g["student_seq_tokens"], "sdpo_student_seq_tokens": s["student_seq_tokens"],
        "sdpo_teacher_seq_tokens": s["teacher_seq_tokens"], "sdpo_teacher_prompt_tokens": s["teacher_prompt_tokens"],
        "sdpo_teacher_unique_prompts": s["teacher_unique_prompts"], "sdpo_teacher_unique_pairs": s["teacher_unique_pairs"],
        "rollout_s": gb["rollout"]["s"], "hf_generate_s": gb["hf"]["s"], "rollout_speedup": speedup,
        "rollout_tok_s": gb["rollout"]["tok_s"], "hf_generate_tok_s": gb["hf"]["tok_s"],
        "rollout_tokens": gb["rollout"]["tokens"], "hf_generate_tokens": gb["hf"]["tokens"],
        "static_rollout_s": gb["static"]["s"] if "static" in gb else None,
        "settings": {"init_from": args.init_from, "dataset": args.dataset, "batch_prompts": args.batch_prompts,
                     "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "iters": args.iters,
                     "gen_runs": args.gen_runs, "seed": args.seed, "no_ctx": args.no_ctx, "success_threshold": args.success_threshold,
                     "teacher": cfg["teacher"], "distill": cfg["distill"], "topk": cfg["topk"],
                     "micro_batch_size": cfg["micro_batch_size"], "threads": torch.get_num_threads(),
                     "params": n_params, "vocab": len(tokenizer), "device": str(dev)},
    }
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
