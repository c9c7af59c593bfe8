"""train.py end to end on a tiny model: SFT, then GRPO, then SDPO, with the memory knobs, and the rollouts
it logs to samples.jsonl."""
import os

from conftest import TINY, math_isfinite, read_log, run_train, tiny_cfg

import train


def test_tiny_end_to_end_sft_then_grpo_then_sdpo(toy_data, tmp_path):
    base = tmp_path / "base"
    # the toy base's two stages (everything, then the teacher-context copies), 2 + 1 iterations
    run_train("config/toy_base.py", *TINY, f"--out_dir={base}", "--stages=toy/add+toy/sort+toy/context:2,toy/context:1",
              "--device=cpu")
    log = read_log(base)
    assert [r["iter"] for r in log if "loss" in r] == [1, 2, 3]
    assert os.path.exists(base / "ckpt" / "model.safetensors") and os.path.exists(base / "accuracy_matrix.json")
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(base / "ckpt")  # a plain HF folder
    for cfgfile, extra in (("config/grpo_toy.py", []), ("config/sdpo_toy.py", ["--success_threshold=0.0"])):
        out = tmp_path / cfgfile.split("/")[1][:-3]
        proc = run_train(cfgfile, *TINY, *extra, f"--init_from={base}/ckpt", f"--out_dir={out}", "--max_iters=2")
        rows = [r for r in read_log(out) if "loss" in r]
        assert len(rows) == 2 and all(math_isfinite(r["loss"]) for r in rows), proc.stdout
        assert "eval @ iter 0" in proc.stdout and "eval @ iter 2" in proc.stdout
    sdpo = [r for r in read_log(tmp_path / "sdpo_toy") if "loss" in r]
    assert all(r["peer_frac"] == 1.0 and r["distill_frac"] == 1.0 and r["div"] >= 0 for r in sdpo)


def test_memory_knobs_run_end_to_end(toy_data, tmp_path):
    """gen_batch_size (one group per generate call here) and grad_checkpointing through main:
    rollouts, the live teacher, the student backward and the evals all run."""
    out = tmp_path / "knobs"
    run_train("config/sdpo_toy.py", *TINY, "--init_from=scratch", "--success_threshold=0.0", "--teacher=live",
              "--gen_batch_size=4", "--grad_checkpointing=True", f"--out_dir={out}", "--max_iters=2", "--device=cpu")
    log = read_log(out)
    steps = [r for r in log if "loss" in r]
    assert [r["iter"] for r in steps] == [1, 2] and all(math_isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)
    assert steps[0]["tokens"] > 0 and steps[0]["peer_frac"] == 1.0  # every response had a peer: the teacher ran


def test_samples_jsonl_rows_come_from_several_groups():
    import metrics
    G, prompts = 3, 5
    batch = train.Batch(prompt_ids=[[i // G] for i in range(G * prompts)], response_ids=[[1]] * (G * prompts),
                        old_logprobs=[None] * (G * prompts), truncated=[False] * (G * prompts),
                        texts=[f"r{i}" for i in range(G * prompts)], rewards=[0.0] * (G * prompts),
                        teacher_prompt_ids=[None] * (G * prompts))
    tasks = [{"answer": str(p)} for p in range(prompts)]
    rows = metrics.sample_rows(batch, tasks, G, lambda ids: str(ids), iteration=7)
    assert [r["response"] for r in rows] == ["r0", "r1", "r3", "r4", "r6", "r7", "r9", "r10"]
    assert {r["answer"] for r in rows} == {"0", "1", "2", "3"}  # four prompts, not only the first


def test_an_eval_whose_responses_are_cut_off_says_so(toy_data, tmp_path, capsys):
    """A toy answer needs 11-23 tokens: at max_new_tokens=3 every eval scores 0, and only the cut-off share says why."""
    train.main(tiny_cfg(toy_data, tmp_path / "run", max_iters=1, max_new_tokens=3))
    evals = [r for r in read_log(tmp_path / "run") if "eval_tag" in r]
    assert evals and all(r["eval/toy/add/truncated"] == 1.0 and r["eval/toy/add/mean@2"] == 0.0 for r in evals)
    assert "toy/add mean@2 0.000 (100% cut off at max_new_tokens=3)" in capsys.readouterr().out
