"""
What a run reports, beside the loop in train.py: one record per iteration and per eval in
out_dir/log.jsonl (and wandb), a few rollouts per eval in out_dir/samples.jsonl, and one printed
line per iteration. The per-iteration diagnostics are the ones RL users debug a run with:

  ratio_mean / ratio_max   exp(log π − log π_old) against the sampling policy (≈ 1: one update per batch)
  clip_frac                fraction of tokens outside the PPO clip range [1 − clip_low, 1 + clip_high]
  kl_sampler               k3 estimate of KL(π_old ‖ π), taken before the step: the trainer's forward against
                           the sampler's (≈ 0: bf16 decode weights, caches), not the size of the update
  entropy                  the student's entropy per response token (a collapsing policy loses it)
  (these five: over the response tokens of the rows in the loss only -- a nonzero advantage, kl_coef > 0,
  or a teacher: under GRPO a group whose rewards were all equal is left out, and a step where no row is
  in the loss logs none)
  div                      the distillation divergence per distilled token
  topk_mass                the probability mass of the student's top-k (distill='topk'; the rest is the tail)
  sampled_logratio(_ok, _failed)
                           log q(y) − log p(y) of the sampled tokens (teacher q, student p) per distilled
                           token, and split by whether the response succeeded. Its mean over tokens
                           sampled from p estimates −KL(p‖q): it is ≤ 0 however good the teacher is;
                           it measures how far apart they are, not which is better.
and from the rollout (train.build_batch): reward, acc, group_success, zero_signal_groups, peer_frac,
distill_frac, resp_len, truncated, reprompt_truncated, phase times (peer_frac: the fraction of responses
with a teacher prompt, a peer's or feedback).
"""
import dataclasses
import json
import math
import os
import statistics

import torch

from configurator import UserError

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
        path = os.path.join(self.out_dir, name)
        try:
            with open(path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        except OSError as e:  # a full or read-only disk (a half-written line is dropped on resume)
            raise UserError(f"cannot write {path} ({e.strerror or e}): free space (or make it writable), then continue "
                            "with --init_from=resume") from None


@dataclasses.dataclass
class TokenSums:
    """The token diagnostics of the loss (module docstring), each summed over the tokens, but
    ratio_max (the largest ratio). token_sums gives one micro-batch's as 0-d tensors (no host sync);
    on_host makes them floats, and add sums the micro-batches of a step."""
    tokens: float = 0.0
    ratio_sum: float = 0.0
    clipped: float = 0.0  # tokens outside the PPO clip range
    kl_sampler_sum: float = 0.0
    entropy_sum: float = 0.0
    distill_tokens: float = 0.0
    div_sum: float = 0.0
    topk_mass_sum: float = 0.0
    logratio_ok_sum: float = 0.0  # log q − log p at distilled tokens of successful responses
    logratio_ok_n: float = 0.0
    logratio_failed_sum: float = 0.0  # ... and of failed ones
    logratio_failed_n: float = 0.0
    ratio_max: float = 0.0

    def on_host(self, *extra):
        """(this record as floats, the extra 0-d tensors as floats), in one host sync."""
        names = [f.name for f in dataclasses.fields(self)]
        values = torch.stack([getattr(self, n) for n in names] + list(extra)).tolist()
        return TokenSums(**dict(zip(names, values))), values[len(names):]

    def add(self, other):
        """Add another micro-batch's (floats): the sums add up, ratio_max is the larger."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "ratio_max" else mine + theirs)


TOKEN_SUMS = tuple(f.name for f in dataclasses.fields(TokenSums) if f.name != "ratio_max")  # summed over ranks


def token_sums(stats, old_logp, div_rows, success, clip_low, clip_high):
    """One micro-batch's TokenSums, as 0-d tensors (no host sync). stats: the token loss's per-token
    logp, div, teacher_logp, entropy, topk_mass; success: bool per token (its response succeeded), or None."""
    log_ratio = stats["logp"] - old_logp
    ratio = log_ratio.exp()
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    logratio = (stats["teacher_logp"] - stats["logp"]) * div_rows
    ok = div_rows & success if success is not None else torch.zeros_like(div_rows)
    failed = div_rows & ~ok
    return TokenSums(tokens=ratio.new_tensor(float(len(ratio))), ratio_sum=ratio.sum(), clipped=clipped.sum().float(),
                     kl_sampler_sum=(ratio - 1 - log_ratio).sum(), entropy_sum=stats["entropy"].sum(),
                     distill_tokens=div_rows.sum().float(), div_sum=(stats["div"] * div_rows).sum(),
                     topk_mass_sum=stats["topk_mass"].sum(), logratio_ok_sum=(logratio * ok).sum(),
                     logratio_ok_n=ok.sum().float(), logratio_failed_sum=(logratio * failed).sum(),
                     logratio_failed_n=failed.sum().float(), ratio_max=ratio.max())


def iteration_record(record, rollout, losses, *, algo, distill, world, global_sum, ratio_max):
    """The iteration's record: the rollout metrics (mean over ranks), the loss (a sum), and the
    token diagnostics as means over every rank's tokens (ratio_max: already the max over ranks)."""
    keys = sorted(rollout)
    sums = global_sum([rollout[k] for k in keys] + [losses[k] for k in ("loss",) + TOKEN_SUMS])
    record.update({k: v / world for k, v in zip(keys, sums)})
    for count in ("tokens", "reprompt_truncated", "distilled"):  # counts: the step's total, not a rank's mean
        if count in record:
            record[count] *= world
    if "distilled" in record:  # a share of the step's tokens (ranks' token counts differ), not a mean of ranks' shares
        record["distill_frac"] = record.pop("distilled") / max(record["tokens"], 1)
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


def console_line(stage, record, total_iters):
    """The one line printed per iteration: the signals a run lives on (SDPO: how many tokens had a teacher;
    any run: the share of responses cut off at max_new_tokens, once there are some)."""
    keys = ("loss", "reward", "acc", "resp_len", "distill_frac", "div")
    shown = [f"{k} {record[k]:.4g}" for k in keys if k in record]
    if record.get("truncated"):  # 255 of 256 cut off must not read as 1, the all-cut-off warning's value
        cut = record["truncated"]
        shown.append("truncated " + (f"{cut:.3g}" if cut == 1 or f"{cut:.3g}" != "1" else ">0.999"))
    shown = " | ".join(shown)
    return (f"{stage} iter {record['iter']}/{total_iters} | {shown} | tok/s {record['tokens'] / record['iter_s']:.0f}"
            + (f" | gen {record['gen_s']:.2f}s" if "gen_s" in record else "") + f" train {record['train_s']:.2f}s")


def stuck_warnings(record, counts, algo, grpo_in_loss=True):
    """The most common silent failure of GRPO / SDPO runs is training on nothing. Count the
    iterations in a row with each sign of it; return the warnings (cause and knob) due now.
    grpo_in_loss: whether the GRPO term is in the loss (not for SDPO at grpo_mix=0)."""
    signs = {
        "zero_signal_groups": (grpo_in_loss and record.get("zero_signal_groups") == 1, "every group's rewards were equal, "
                               "so GRPO had no signal: raise group_size, or use a dataset this model solves sometimes"),
        "peer_frac": (algo == "sdpo" and record.get("peer_frac") == 0, "no response had a teacher prompt (no "
                      "successful peer, no feedback), so SDPO had no signal: lower success_threshold, raise "
                      "group_size, or set use_feedback=True"),
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


# ----------------------------------------------------------------------------- eval scores
def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def accuracy_summary(scores, ks=None, threshold=1.0):
    """Per-prompt lists of n scores -> mean@n (the mean score) and pass@k for each k <= n in ks
    (default: k = n), the unbiased estimator over the samples with score >= threshold (and above 0:
    at threshold 0 a sample that earned nothing is not solved)."""
    n = len(scores[0])
    correct = [sum(s >= threshold and s > 0 for s in row) for row in scores]
    out = {f"mean@{n}": sum(map(sum, scores)) / (n * len(scores))}
    for k in ks or [n]:
        if k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    return out


# ----------------------------------------------------------------------------- the collapse guard
# It watches training, not the disk: after every eval (every eval set, not only the one trained on)
# and after every loss. Its memory is saved with each checkpoint (state.json "guard"), so a resumed
# run judges by the same bests; ckpt_good/ is the last checkpoint that passed it, or the initial model.
COLLAPSED_BELOW = 0.5  # an eval set under this fraction of its best mean@n has collapsed (zero after learning too)
EMPTY_RESPONSE = 2.0  # a mean response under this many tokens: the policy stopped answering
RUNAWAY = 10  # a loss this many times its running median (or ln vocab, before one exists) diverged
MEDIAN_OVER, MEDIAN_FROM = 20, 10  # the running median: of the last 20 losses, once 10 exist


class Collapse(Exception):
    """Training diverged or collapsed; the last good checkpoint is kept."""


@dataclasses.dataclass
class Guard:
    best: dict  # each eval set's best mean@n so far, the initial model's included
    good: dict = None  # ckpt_good/: {"iter", "acc"}; iteration 0 is the initial model (saved before the first step)
    bad_evals: int = 0  # unhealthy evals in a row
    losses: list = dataclasses.field(default_factory=list)  # the last MEDIAN_OVER losses


def eval_problems(row, lengths, best, trained=None):
    """What makes an eval unhealthy, one phrase per eval set (none: healthy): (nearly) empty
    responses, or mean@n below COLLAPSED_BELOW of the set's best. `trained`: the sets judged by that
    relative rule (None: all); the others (a continual run's earlier domains, whose forgetting is
    what the run measures) are unhealthy only at zero after a best above it."""
    out = []
    for name, acc in row.items():
        floor = COLLAPSED_BELOW * best.get(name, 0.0) if trained is None or name in trained else 0.0
        if lengths[name] < EMPTY_RESPONSE:
            out.append(f"{name} answers nothing (mean response {lengths[name]:.1f} tokens)")
        elif acc < floor or (acc == 0.0 < best.get(name, 0.0)):
            out.append(f"{name} fell to {acc:.3f} from its best {best[name]:.3f}")
    return out


def trained_sets(stages, stage_name):
    """The eval sets the collapse guard judges against half their best: all in a one-stage run; in
    a continual run the current stage's own (an earlier domain may be forgotten, down to zero)."""
    return set(stage_name.split("+")) if len(stages) > 1 else None


def check_eval(guard, row, lengths, cfg, trained=None):
    """One eval through the guard: True when healthy (the checkpoint that follows becomes ckpt_good).
    After cfg's collapse_patience unhealthy evals in a row it raises Collapse (with stop_on_collapse;
    else it only counts). trained: as in eval_problems."""
    problems = eval_problems(row, lengths, guard.best, trained)
    guard.best.update({name: max(guard.best.get(name, 0.0), acc) for name, acc in row.items()})
    guard.bad_evals = guard.bad_evals + 1 if problems else 0
    if cfg["stop_on_collapse"] and guard.bad_evals >= cfg["collapse_patience"]:
        raise Collapse(f"{'; '.join(problems)} ({guard.bad_evals} evals in a row)")
    return not problems


def check_loss(guard, loss, *, log_vocab, stop):
    """Divergence the eval guard would see too late: a non-finite loss (always stops), or a runaway
    one (stops with stop): above RUNAWAY × ln vocab before a running median exists, then above
    RUNAWAY × median + ln vocab. ln vocab, a uniform guess's loss per token, is the absolute scale: a
    run that diverges at its first steps stops there, and a median near 0 (GRPO steps without signal)
    is no hair trigger."""
    if not math.isfinite(loss):
        raise Collapse(f"loss is {loss}")
    recent = guard.losses[-MEDIAN_OVER:]
    if len(recent) >= MEDIAN_FROM:
        median = statistics.median(map(abs, recent))
        limit, why = RUNAWAY * median + log_vocab, f"{RUNAWAY} × its running median {median:.4g} + ln vocab"
    else:
        limit, why = RUNAWAY * log_vocab, f"{RUNAWAY} × ln vocab, before a running median exists"
    if stop and abs(loss) > limit:
        raise Collapse(f"loss {loss:.4g} is above {limit:.4g} ({why}): diverging")
    guard.losses = recent[-(MEDIAN_OVER - 1):] + [loss]


def collapse_message(ckpt_dir, iteration, good, error):
    """Where the run stopped and which checkpoint to go back to, truthfully."""
    what = "the initial model" if good["iter"] == 0 else f"iteration {good['iter']}"
    acc = ", ".join(f"{k} {v:.3f}" for k, v in good["acc"].items())
    return (f"training stopped after {iteration} iterations: {error}. The last checkpoint that passed the collapse "
            f"guard: {ckpt_dir}_good ({what}, eval {acc})")
