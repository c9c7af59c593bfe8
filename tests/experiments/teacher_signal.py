"""Does the SDPO teacher signal exist on the toy suite? For the first N test prompts of each toy
domain, with the toy base model, compare the model without and with a demonstration in context
(the SDPO teacher prompt: train.teacher_prompt_text through the chat template):

  (a) log-probability of the *correct* reference response (task["solution"] + EOS), the same
      token ids scored after the plain prompt and after the teacher prompt: summed over the
      response, per response token, and summed over the answer's own tokens only;
  (b) accuracy, mean@n at temperature 0.6 / top_p 0.95 (train.sample_and_score), plain vs in context;
  (c) the same with a *wrong* demonstration (the solution with one character of the answer
      changed): does the teacher still prefer the correct response, or copy the demonstration?
      "wrong" columns score the wrong demonstration's own response, and copy@n is the fraction
      of samples that answer with the wrong demonstration's answer.
The toy code domain func (its answer is a JSON of hidden tests, not a string in the response) is
handled through its expression: the answer is the expression inside <answer></answer>, the wrong
demonstration is data/toy/prepare.py's wrong_attempt (one digit changed, as the toy copies have it),
and a fourth row, feedback-, is the teacher prompt with only the sandbox's feedback on that wrong
attempt ("f(4) gave 13, expected 9."): the teacher the feedback experiment's rows get when no peer succeeded.

    python tests/experiments/teacher_signal.py                             # out/toy_base/ckpt, 5 domains, N=100
    python tests/experiments/teacher_signal.py --domains=add,sort --n_prompts=50
    python tests/experiments/teacher_signal.py --init_from=scratch         # a random model: no signal expected
    python tests/experiments/teacher_signal.py --init_from=out/toy_base_code/ckpt --domains=func   # the code base

Rows: plain = the original prompt; demo+ = the teacher prompt with the correct solution;
demo- = the teacher prompt with the wrong solution; feedback- (code only) = the teacher prompt with the
feedback on it. The means over domains are over plain / demo+ / demo-. The last line printed is one JSON object.
"""
import argparse
import functools
import importlib.util
import json
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
import models  # noqa: E402
import train  # noqa: E402
from configurator import config_keys  # noqa: E402

DOMAINS = ["add", "sub", "mul", "sort", "rev"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def defaults():
    """train.py's config defaults as a dict (the keys configurator.py accepts)."""
    return {k: getattr(train, k) for k in config_keys(vars(train), train.__file__)}


def wrong_answer(answer, rng):
    """One character of the answer changed (digit for digit, letter for letter; no new leading 0)."""
    i = rng.randrange(len(answer))
    if answer[i].isdigit():
        pool = [c for c in "0123456789" if c != answer[i] and not (c == "0" and i == 0 and len(answer) > 1)]
    else:
        pool = [c for c in LETTERS if c != answer[i]]
    return answer[:i] + rng.choice(pool) + answer[i + 1:]


@functools.lru_cache(maxsize=1)
def toy_prepare():
    """data/toy/prepare.py as a module (its wrong_attempt makes func's wrong demonstrations)."""
    spec = importlib.util.spec_from_file_location("toy_prepare", os.path.join(ROOT, "data", "toy", "prepare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_demo(task, solution, feedback=None):
    """A copy of the task whose user turn is the SDPO teacher prompt with `solution` as the demonstration
    (None: none) and/or `feedback`."""
    messages = [dict(m) for m in task["messages"]]
    messages[-1]["content"] = train.teacher_prompt_text(messages[-1]["content"], solution, feedback, train.reprompt_template,
                                                        train.solution_template, train.feedback_template)
    return dict(task, messages=messages)


def shown_answer(task, solution):
    """The answer as the response writes it: the task's answer, or for code (whose answer is its tests)
    the expression inside the solution's last <answer></answer>."""
    if task["kind"] != "code":
        return task["answer"]
    return solution.rsplit("<answer>", 1)[1].split("</answer>", 1)[0]


def wrong_demonstrations(tasks, rng):
    """(wrong answer as written, wrong solution) per task: one character of the answer changed; for code
    one digit of the expression (data/toy/prepare.py's wrong_attempt, so it stays an expression)."""
    out = []
    for t in tasks:
        if t["kind"] == "code":
            wrong_sol = toy_prepare().wrong_attempt(t["solution"], t["answer"], rng)
            out.append((shown_answer(t, wrong_sol), wrong_sol))
        else:
            w = wrong_answer(t["answer"], rng)
            out.append((w, t["solution"].replace(t["answer"], w)))
    return out


def answer_span(tokenizer, solution, answer):
    """(start, end) token positions of the answer inside the tokenized solution, or None."""
    at = solution.rfind(answer)
    if at < 0:
        return None
    start = len(tokenizer.encode(solution[:at], add_special_tokens=False))
    end = len(tokenizer.encode(solution[:at + len(answer)], add_special_tokens=False))
    return start, end


@torch.no_grad()
def score(model, prompts, responses, dev, batch=64):
    """Per-token log-probs of each response after its prompt: list of [n] tensors."""
    out = []
    weight = train.lm_head(model)[0]
    for a in range(0, len(prompts), batch):
        p, r = prompts[a:a + batch], responses[a:a + batch]
        h = models.response_hidden(model, p, r, dev)
        tokens = torch.tensor([t for x in r for t in x], device=dev)
        lp = train.sampled_logprobs(h, weight, tokens).cpu()
        out.extend(lp.split([len(x) for x in r]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init_from", default=os.path.join("out", "toy_base", "ckpt"), help="HF folder or 'scratch'")
    ap.add_argument("--domains", default=",".join(DOMAINS), help="comma-separated toy domains")
    ap.add_argument("--n_prompts", type=int, default=100, help="first N test prompts per domain")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt for mean@n")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top_p", type=float, default=0.95)
    ap.add_argument("--max_new_tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the toy model's ops are tiny, and on a shared 2-core CPU two OpenMP "
                         "threads thrash, up to 5x slower; 0 = torch's default)")
    args = ap.parse_args()
    os.chdir(ROOT)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t_start = time.time()
    cfg = defaults()
    dev = torch.device("cpu")
    torch.manual_seed(args.seed)
    try:
        if args.init_from != "scratch" and not os.path.exists(os.path.join(args.init_from, "config.json")):
            raise train.UserError(f"{args.init_from} is not a model folder: train the toy base first "
                                  "(python train.py config/toy_base.py) or pass --init_from=scratch")
        model, tokenizer = models.load_model(args.init_from, dev, scratch=cfg)
        domains = [d for d in args.domains.split(",") if d]
        all_tasks = {d: train.load_tasks(f"toy/{d}", "test", cfg["data_dir"])[:args.n_prompts] for d in domains}
    except train.UserError as e:
        sys.exit(f"error: {e}")
    model.eval()
    eos = tokenizer.eos_token_id
    print(f"model {args.init_from}; first {args.n_prompts} test prompts of {', '.join(domains)}; "
          f"mean@{args.n} at T={args.temperature} top_p={args.top_p}, max_new_tokens {args.max_new_tokens}")
    print("logp columns: mean over prompts of the log-prob of the correct response (sum over its tokens, per token, "
          "and over the answer's tokens only); 'wrong' = the wrong demonstration's response (sum)")

    results = {}
    for d in domains:
        tasks = all_tasks[d]
        rng = random.Random(f"{args.seed}-{d}")
        wrong, wrong_sol = map(list, zip(*wrong_demonstrations(tasks, rng)))
        variants = {"plain": tasks, "demo+": [with_demo(t, t["solution"]) for t in tasks],
                    "demo-": [with_demo(t, s) for t, s in zip(tasks, wrong_sol)]}
        code = all(t["kind"] == "code" for t in tasks)
        if code:  # the rich-feedback teacher: the sandbox's words on the wrong attempt, no demonstration
            feedback = [fb for _, fb in train.rewards_of(tasks, wrong_sol)]
            variants["feedback-"] = [with_demo(t, None, fb) for t, fb in zip(tasks, feedback)]
        correct_resp = [tokenizer.encode(t["solution"], add_special_tokens=False) + [eos] for t in tasks]
        wrong_resp = [tokenizer.encode(s, add_special_tokens=False) + [eos] for s in wrong_sol]
        spans = [answer_span(tokenizer, t["solution"], shown_answer(t, t["solution"])) for t in tasks]
        rows = {}
        for name, vt in variants.items():
            prompts = [train.prompt_ids(tokenizer, t["messages"]) for t in vt]
            lp_c = score(model, prompts, correct_resp, dev)
            lp_w = score(model, prompts, wrong_resp, dev)
            ans = [float(lp[a:b].sum()) for lp, (a, b) in zip(lp_c, spans)]
            gen = train.make_generator(args.seed, dev)  # the same sampling stream for every variant
            ev = train.sample_and_score(model, tokenizer, vt, n=args.n, temperature=args.temperature, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, batch_prompts=len(vt), generator=gen)
            copies = [train.reward("exact" if code else t["kind"], text, w)[0]  # code: the wrong expression's text
                      for t, w, texts in zip(tasks, wrong, ev["texts"]) for text in texts]
            rows[name] = {
                "logp_sum": sum(float(x.sum()) for x in lp_c) / len(tasks),
                "logp_tok": sum(float(x.sum()) for x in lp_c) / sum(len(x) for x in lp_c),
                "logp_answer": sum(ans) / len(ans),
                "wrong_logp_sum": sum(float(x.sum()) for x in lp_w) / len(tasks),
                f"mean@{args.n}": ev[f"mean@{args.n}"],
                f"copy@{args.n}": sum(copies) / len(copies),
                "prompt_len": sum(map(len, prompts)) / len(prompts),
                "_lp": [float(x.sum()) for x in lp_c],
            }
        plain_lp = rows["plain"].pop("_lp")
        for name in [v for v in rows if v != "plain"]:
            lp = rows[name].pop("_lp")
            rows[name]["frac_correct_up"] = sum(b > a for a, b in zip(plain_lp, lp)) / len(lp)
        rows["plain"]["frac_correct_up"] = None
        results[d] = rows

        print(f"\n{d} ({len(tasks)} prompts, e.g. {tasks[0]['messages'][-1]['content']!r} -> {tasks[0]['solution']!r}, "
              f"wrong demo {wrong_sol[0]!r})")
        print(f"{'prompt':<8}{'len':>6}{'logp_sum':>10}{'logp_tok':>10}{'logp_ans':>10}{'wrong':>10}"
              f"{'up':>7}{f'mean@{args.n}':>9}{f'copy@{args.n}':>9}")
        for name, r in rows.items():
            up = "" if r["frac_correct_up"] is None else f"{r['frac_correct_up']:.2f}"
            print(f"{name:<8}{r['prompt_len']:>6.0f}{r['logp_sum']:>10.3f}{r['logp_tok']:>10.3f}{r['logp_answer']:>10.3f}"
                  f"{r['wrong_logp_sum']:>10.3f}{up:>7}{r[f'mean@{args.n}']:>9.3f}{r[f'copy@{args.n}']:>9.3f}", flush=True)

    keys = ["logp_sum", "logp_tok", "logp_answer", "wrong_logp_sum", f"mean@{args.n}", f"copy@{args.n}"]
    overall = {v: {k: sum(results[d][v][k] for d in domains) / len(domains) for k in keys} for v in ("plain", "demo+", "demo-")}
    print("\nmean over domains ('up' = fraction of prompts whose correct-response log-prob rose vs plain)")
    print(f"{'prompt':<8}" + "".join(f"{k:>15}" for k in keys))
    for v, r in overall.items():
        print(f"{v:<8}" + "".join(f"{r[k]:>15.3f}" for k in keys))
    signal = {
        "teacher_minus_plain_logp_tok": overall["demo+"]["logp_tok"] - overall["plain"]["logp_tok"],
        "teacher_minus_plain_logp_answer": overall["demo+"]["logp_answer"] - overall["plain"]["logp_answer"],
        "teacher_minus_plain_acc": overall["demo+"][f"mean@{args.n}"] - overall["plain"][f"mean@{args.n}"],
        "wrong_demo_minus_plain_acc": overall["demo-"][f"mean@{args.n}"] - overall["plain"][f"mean@{args.n}"],
        "wrong_demo_copy_rate": overall["demo-"][f"copy@{args.n}"],
        "plain_copy_rate": overall["plain"][f"copy@{args.n}"],
    }
    for k, v in signal.items():
        print(f"{k}: {v:+.3f}")
    elapsed = time.time() - t_start
    print(f"({elapsed:.0f}s)")

    def rnd(x):
        if isinstance(x, float):
            return round(x, 4)
        if isinstance(x, dict):
            return {k: rnd(v) for k, v in x.items()}
        return x
    print(json.dumps(rnd({"init_from": args.init_from, "n_prompts": args.n_prompts, "n": args.n,
                          "temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens,
                          "seed": args.seed, "domains": results, "overall": overall, "signal": signal,
                          "seconds": elapsed})))


if __name__ == "__main__":
    main()
