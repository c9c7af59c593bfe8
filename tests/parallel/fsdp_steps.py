"""Run under torchrun (2 CPU ranks, gloo) by tests/test_parallel.py: FSDP steps against one process on
the same global batch, and the all-gathers of a generate call. Writes one JSON object to argv[1] (rank 0).

    torchrun --standalone --nproc_per_node=2 tests/parallel/fsdp_steps.py out.json

Each step's global batch is built once, identically on every rank, by an unsharded copy of the model
(build_batch in one process: the loss weights are the whole batch's); each rank trains its share of the
rows on the sharded model, the unsharded copy trains all of them. GRPO with the KL reference (a sharded
initial model, gathered through the loss) and SDPO with the EMA teacher (sharded, updated on its shards),
both copied from the sharded student as train.py copies them (frozen_copy: runtime.sharded_copy).
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.chdir(ROOT)
import runtime  # noqa: E402
import train  # noqa: E402
from conftest import defaults  # noqa: E402
from models import frozen_copy, load_model  # noqa: E402
from teacher import Teacher, load_teacher_init  # noqa: E402
from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # noqa: E402

STEPS = 3
CPU = torch.device("cpu")


def config(algo):
    cfg = dict(defaults(), algo=algo, n_layer=2, n_head=2, n_embd=32, block_size=128, batch_prompts=4, group_size=4,
               micro_batch_size=2, max_new_tokens=8, learning_rate=1e-2, warmup_iters=1, topk=10, loss_chunk=16,
               device="cpu", dataset="toy/sort")
    if algo == "grpo":
        cfg.update(kl_coef=0.1)
    else:
        cfg.update(teacher="ema", teacher_rate=0.3, success_threshold=0.0, density=0.5)
    return cfg


def max_diff(sharded_state, state):
    return max((sharded_state[k] - v).abs().max().item() for k, v in state.items())


def compare(algo, ddp):
    """STEPS steps both ways; the per-step losses and gradient norms, and the weights' largest gaps."""
    cfg = config(algo)
    model, tokenizer = load_model("scratch", CPU, scratch=cfg)
    train.disable_dropout(model).train()
    one = copy.deepcopy(model)
    ddp.shard(model)  # as train.py does: the student first, then its copies, born sharded (runtime.sharded_copy)
    initial, one_initial = (frozen_copy(model), frozen_copy(one)) if cfg["kl_coef"] > 0 else (None, None)
    teacher = Teacher.create(cfg, model, None)
    one_teacher = Teacher.create(cfg, one, None)
    adamw = dict(lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]), weight_decay=cfg["weight_decay"])
    opt, one_opt = torch.optim.AdamW(model.parameters(), **adamw), torch.optim.AdamW(one.parameters(), **adamw)
    tasks = train.load_tasks(cfg["dataset"], "train")[:cfg["batch_prompts"]]
    rows = cfg["batch_prompts"] * cfg["group_size"] // ddp.world
    out = {"loss": [], "one_loss": [], "grad_norm": [], "one_grad_norm": [], "passes": []}
    for step in range(STEPS):
        for o in (opt, one_opt):
            train.set_lr(o, step, learning_rate=cfg["learning_rate"], warmup_iters=1, total_iters=STEPS, decay_lr=False,
                         min_lr=0)
        batch, _ = train.build_batch(tasks, one, tokenizer, cfg, train.make_generator(step, CPU), CPU)
        # a random toy model earns no reward: fixed random advantages give GRPO's step a signal; and most of
        # rank 1's rows carry no weight, so it has fewer micro-batches than rank 0 and keeps step by lockstep
        batch.advantages = torch.randn(len(batch.advantages), generator=torch.Generator().manual_seed(step)).tolist()
        for i in range(rows + 2, 2 * rows):
            batch.pg_weight[i], batch.distill_weight[i] = batch.pg_weight[i] * 0, batch.distill_weight[i] * 0
        mine = batch.take(range(ddp.rank * rows, (ddp.rank + 1) * rows))
        passes = []
        with runtime.gathered(teacher and teacher.own, initial):
            got = train.loss_backward(model, mine, cfg, CPU, teacher=teacher, initial_model=initial,
                                      lockstep=lambda n: passes.append(n) or ddp.max_over_ranks(n))
        want = train.loss_backward(one, batch, cfg, CPU, teacher=one_teacher, initial_model=one_initial)
        out["loss"].append(ddp.global_sum([got["loss"]])[0])
        out["one_loss"].append(want["loss"])
        out["passes"].append(ddp.gather(passes[0]))
        out["grad_norm"].append(train.optimizer_step(model, opt, cfg["grad_clip"]))
        out["one_grad_norm"].append(train.optimizer_step(one, one_opt, cfg["grad_clip"]))
        for t, student in ((teacher, model), (one_teacher, one)):
            if t is not None:
                t.after_step(student)
    full = runtime.full_state_dict(model)
    teacher_full = runtime.full_state_dict(teacher.own) if teacher else None
    if ddp.master:
        out["weights_max_diff"] = max_diff(full, one.state_dict())
        start = load_model("scratch", CPU, scratch=cfg)[0].state_dict()
        out["moved"] = max((v - start[k]).abs().max().item() for k, v in one.state_dict().items())
        if teacher:
            out["teacher_max_diff"] = max_diff(teacher_full, one_teacher.own.state_dict())
    copies = [m for m in (model, initial, teacher and teacher.own) if m is not None]
    out["sharded"] = all(isinstance(p, runtime.DTensor) for m in copies for p in m.parameters())
    return out


def teacher_init_mix(ddp, folder):
    """Teacher.create with teacher_init (another model mixed in once) on a sharded student: the model read
    is sharded like the teacher and mixed in shard by shard. Its largest gap to the same mix unsharded, and
    how far the mix moved the teacher from the student (rank 0)."""
    cfg = dict(config("sdpo"), teacher_init=folder, teacher_init_alpha=0.25)
    if ddp.master:
        load_model("scratch", CPU, scratch=dict(cfg, seed=cfg["seed"] + 1))[0].save_pretrained(folder)
    ddp.barrier()
    model = load_model("scratch", CPU, scratch=cfg)[0]
    init = load_teacher_init(cfg, model, CPU)
    student, want = model.state_dict(), Teacher.create(cfg, copy.deepcopy(model), None, init).own.state_dict()
    ddp.shard(model)
    got = runtime.full_state_dict(Teacher.create(cfg, model, None, load_teacher_init(cfg, model, CPU)).own)
    return {"max_diff": max_diff(got, want), "moved": max_diff(got, student)} if ddp.master else None


def copy_of_a_model_its_config_does_not_rebuild(ddp):
    """A sharded model whose class, built from its config, has other parameters (here: bf16 weights where
    the config builds fp32 ones): frozen_copy refuses in one line instead of copying into the wrong dtype."""
    model = load_model("scratch", CPU, scratch=config("sdpo"))[0].to(torch.bfloat16)
    ddp.shard(model)
    try:
        frozen_copy(model)
        return None
    except runtime.UserError as e:
        return str(e)


def all_gathers(ddp):
    """How many all-gathers one generate call of 8 tokens costs, gathered once and not, and gathered with the
    model named twice (a frozen teacher that is also the KL reference)."""
    cfg = config("grpo")
    model, tokenizer = load_model("scratch", CPU, scratch=cfg)
    ddp.shard(model)
    calls = []
    real = _fsdp_param_group.foreach_all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    _fsdp_param_group.foreach_all_gather = counting
    sampling = dict(group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_ids=[-1], pad_id=tokenizer.pad_token_id)
    counts = {}
    for how in ("gathered", "twice", "per_step"):
        calls.clear()
        with runtime.gathered(*{"gathered": [model], "twice": [model, model], "per_step": []}[how]):
            batch = train.generate(model, [[5, 6, 7], [8, 9]], generator=train.make_generator(0, CPU), **sampling)
        counts[how] = len(calls)
        counts[f"{how}_tokens"] = [len(r) for r in batch.response_ids]
    _fsdp_param_group.foreach_all_gather = real
    counts["groups"] = sum(runtime.is_sharded(m) for m in model.modules())  # the blocks and the root
    return counts


def mixed_precision_and_collapse(ddp):
    """dtype=bfloat16: gathered weights are bf16, the shards fp32. A non-finite weight in one rank's shard
    only: does optimizer_step stop every rank (a DTensor norm is the global one) or just that rank?"""
    cfg = config("sft")
    model = load_model("scratch", CPU, scratch=cfg)[0]
    ddp.shard(model, param_dtype=torch.bfloat16)
    with runtime.gathered(model):
        gathered = sorted({str(p.dtype) for p in model.parameters()})
    out = {"gathered_dtypes": gathered, "shard_dtypes": sorted({str(runtime.local(p).dtype) for p in model.parameters()})}
    with torch.no_grad():
        if ddp.rank == 1:
            runtime.local(next(model.parameters())).view(-1)[0] = float("inf")
    try:
        train.optimizer_step(model, torch.optim.AdamW(model.parameters()), 1.0)
        out["collapse"] = ddp.gather(None)
    except train.Collapse as e:
        out["collapse"] = ddp.gather(str(e))
    return out


if __name__ == "__main__":
    ddp = runtime.Dist("cpu", "fsdp")
    result = {algo: compare(algo, ddp) for algo in ("grpo", "sdpo")}
    result["refused_copy"] = copy_of_a_model_its_config_does_not_rebuild(ddp)
    result["teacher_init"] = teacher_init_mix(ddp, os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "init"))
    result["all_gathers"] = all_gathers(ddp)
    result["mixed_precision_and_collapse"] = mixed_precision_and_collapse(ddp)
    if ddp.master:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    runtime.leave(0)  # not through the interpreter's shutdown, which races gloo's threads (runtime.leave)
