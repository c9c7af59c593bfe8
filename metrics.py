"""
What a run reports, beside the loop in train.py: one record per iteration and per eval in
out_dir/log.jsonl (and wandb), a few rollouts per eval in out_dir/samples.jsonl, and one printed
line per iteration. The per-iteration diagnostics are the ones RL users debug a run with:

  ratio_mean / ratio_max   exp(log π − log π_old) against the sampling policy (≈ 1: one update per batch)
  clip_frac                fraction of tokens outside the PPO clip range [1 − clip_low, 1 + clip_high]
  kl_sampler               k3 estimate of KL(π_old ‖ π): how far the step moved from what was sampled
  entropy                  the student's entropy per response token (a collapsing policy loses it)
  div                      the distillation divergence per distilled token
  topk_mass                the probability mass of the student's top-k (distill='topk'; the rest is the tail)
  sampled_logratio(_ok, _failed)
                           log q(y) − log p(y) of the sampled tokens (teacher q, student p) per distilled
                           token, and split by whether the response succeeded. Its mean over tokens
                           sampled from p estimates −KL(p‖q): it is ≤ 0 however good the teacher is;
                           it measures how far apart they are, not which is better.
and from the rollout (train.build_batch): reward, acc, group_success, zero_signal_groups, peer_frac,
distill_frac, resp_len, truncated, reprompt_truncated, phase times.
"""
import json
import os

import torch

TOKEN_SUMS = ("tokens", "ratio_sum", "clipped", "kl_sampler_sum", "entropy_sum", "distill_tokens", "div_sum",
              "topk_mass_sum", "logratio_ok_sum", "logratio_ok_n", "logratio_failed_sum", "logratio_failed_n")
STUCK_ITERS = 5  # iterations in a row before "nothing is learning" is said out loud


class RunLog:
    """log.jsonl, samples.jsonl, wandb and the console, written by rank 0 only."""

    def __init__(self, out_dir, jsonl, wandb_run, master):
        self.out_dir, self.jsonl, self.wandb, self.master = out_dir, jsonl, wandb_run, master

    def say(self, *args):
        if self.master:
            print(*args, flush=True)

    def record(self, record):
        if self.master and self.jsonl:
            self._append("log.jsonl", [record])
        if self.wandb:
            self.wandb.log(record, step=record["iter"])

    def samples(self, rows):
        if self.master:
            self._append("samples.jsonl", rows)

    def _append(self, name, records):
        with open(os.path.join(self.out_dir, name), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def token_sums(stats, old_logp, div_rows, success, clip_low, clip_high):
    """The TOKEN_SUMS of one micro-batch, then its largest ratio: 0-d tensors (no host sync).
    stats: the token loss's per-token logp, div, teacher_logp, entropy, topk_mass; success: bool per
    token (its response succeeded), or None."""
    log_ratio = stats["logp"] - old_logp
    ratio = log_ratio.exp()
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    logratio = (stats["teacher_logp"] - stats["logp"]) * div_rows
    ok = div_rows & success if success is not None else torch.zeros_like(div_rows)
    failed = div_rows & ~ok
    return [ratio.new_tensor(float(len(ratio))), ratio.sum(), clipped.sum().float(), (ratio - 1 - log_ratio).sum(),
            stats["entropy"].sum(), div_rows.sum().float(), (stats["div"] * div_rows).sum(), stats["topk_mass"].sum(),
            (logratio * ok).sum(), ok.sum().float(), (logratio * failed).sum(), failed.sum().float(), ratio.max()]


def iteration_record(record, rollout, losses, *, algo, distill, world, global_sum, ratio_max):
    """The iteration's record: the rollout metrics (mean over ranks), the loss (a sum), and the
    token diagnostics as means over every rank's tokens (ratio_max: already the max over ranks)."""
    keys = sorted(rollout)
    sums = global_sum([rollout[k] for k in keys] + [losses[k] for k in ("loss",) + TOKEN_SUMS])
    record.update({k: v / world for k, v in zip(keys, sums)})
    record["tokens"] *= world
    t = dict(zip(("loss",) + TOKEN_SUMS, sums[len(keys):]))
    record["loss"] = t["loss"]
    if algo != "sft" and t["tokens"]:
        record.update(ratio_mean=t["ratio_sum"] / t["tokens"], ratio_max=ratio_max,
                      clip_frac=t["clipped"] / t["tokens"], kl_sampler=t["kl_sampler_sum"] / t["tokens"],
                      entropy=t["entropy_sum"] / t["tokens"])
    if t["distill_tokens"]:
        record.update(div=t["div_sum"] / t["distill_tokens"],
                      sampled_logratio=(t["logratio_ok_sum"] + t["logratio_failed_sum"]) / t["distill_tokens"])
        if distill == "topk":
            record["topk_mass"] = t["topk_mass_sum"] / t["distill_tokens"]
        for part in ("ok", "failed"):
            if t[f"logratio_{part}_n"]:
                record[f"sampled_logratio_{part}"] = t[f"logratio_{part}_sum"] / t[f"logratio_{part}_n"]
    record.update({k: losses[k] for k in ("reference_s", "teacher_s", "student_s")})
    return record


def console_line(stage, record):
    """The one line printed per iteration."""
    shown = " | ".join(f"{k} {record[k]:.4g}" for k in ("loss", "reward", "acc", "resp_len", "div") if k in record)
    return (f"{stage} iter {record['iter']} | {shown} | tok/s {record['tokens'] / record['iter_s']:.0f}"
            + (f" | gen {record['gen_s']:.2f}s" if "gen_s" in record else "") + f" train {record['train_s']:.2f}s")


def stuck_warnings(record, counts, algo):
    """The most common silent failure of GRPO / SDPO runs is training on nothing. Count the
    iterations in a row with each sign of it; return the warnings (cause and knob) due now."""
    signs = {
        "zero_signal_groups": (record.get("zero_signal_groups") == 1, "every group's rewards were equal, so GRPO had no "
                               "signal: raise group_size, or use a dataset this model solves sometimes"),
        "peer_frac": (algo == "sdpo" and record.get("peer_frac") == 0, "no response had a successful peer, so SDPO "
                      "had no teacher: lower success_threshold, raise group_size, or set use_feedback=True"),
        "truncated": (record.get("truncated") == 1, "every response hit max_new_tokens before an EOS: raise max_new_tokens"),
    }
    out = []
    for key, (bad, advice) in signs.items():
        counts[key] = counts.get(key, 0) + 1 if bad else 0
        if counts[key] == STUCK_ITERS:
            out.append(f"warning: for {STUCK_ITERS} iterations in a row {advice}")
    return out


def sample_rows(batch, tasks, group_size, decode, iteration, k=4, per_group=2):
    """A few rollouts of a training batch, per_group from each of its first k groups (prompts): what
    the policy writes, and what its teacher reads."""
    rows, n = [], len(batch.texts or [])
    picked = [g * group_size + j for g in range(min(k, -(-n // group_size))) for j in range(min(per_group, group_size))]
    for i in (i for i in picked if i < n):
        teacher = batch.teacher_prompt_ids[i] if batch.teacher_prompt_ids else None
        rows.append({"iter": iteration, "prompt": decode(batch.prompt_ids[i]), "response": batch.texts[i],
                     "reward": batch.rewards[i], "answer": tasks[i // group_size]["answer"],
                     "teacher_prompt": decode(teacher) if teacher else None})
    return rows
