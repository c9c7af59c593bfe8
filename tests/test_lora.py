"""LoRA (lora_rank > 0, through peft): only the adapters train; the frozen teacher is the base with
the adapter off and no second model; the EMA teacher moves only its adapter copy; ckpt/ is the
merged model (no peft needed to load it) beside peft's adapter folder; a resume continues exactly;
a bad LoRA setting is one line before anything is written."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import (ROOT, TINY, TORCHRUN, assert_resume_continues_exactly, defaults, hand_made_batch, one_line_error,
                      read_log, run_train, run_train_here)

import checkpoint
import decoding
import models
import train
from runtime import Dist

NEEDS_PEFT = "LoRA needs peft (pip install peft; requirements-test.txt has it for CI)"


@pytest.fixture(scope="module")
def base_dir(toy_data, tmp_path_factory):
    """A tiny toy-tokenizer Qwen2 saved as an HF folder: the base a LoRA run adapts (init_from)."""
    pytest.importorskip("peft", reason=NEEDS_PEFT)
    cfg = dict(defaults(), tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), n_layer=1, n_head=2, n_embd=32,
               block_size=128)
    model, tokenizer = models.load_model("scratch", torch.device("cpu"), scratch=cfg)
    folder = tmp_path_factory.mktemp("lora") / "base"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def lora_cfg(toy_data, base_dir, out, **overrides):
    return {**defaults(), **dict(algo="sdpo", init_from=base_dir, lora_rank=4, lora_alpha=8.0, dataset="toy/add",
                                 batch_prompts=4, group_size=4, micro_batch_size=8, max_new_tokens=8, warmup_iters=1,
                                 eval_interval=0, eval_max_prompts=2, eval_n=2, topk=10, loss_chunk=16, max_iters=2,
                                 learning_rate=1e-2, success_threshold=0.0, out_dir=str(out), device="cpu",
                                 data_dir=toy_data), **overrides}


@contextlib.contextmanager
def trained(cfg):
    """setup + the training loop of train.main, with the Run kept for inspection (and its state before)."""
    ddp = Dist("cpu")
    with contextlib.ExitStack() as stack:
        run = train.setup(cfg, ddp, stack)
        before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        teacher_before = {n: p.detach().clone() for n, p in run.teacher.own.named_parameters()} \
            if run.teacher and run.teacher.own is not None else {}
        train.train_loop(run, cfg, ddp)
        yield run, before, teacher_before


def logits_of(model, ids):
    with torch.no_grad(), models.eval_mode(model):
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_lora_sdpo_trains_only_the_adapters_and_the_ema_teacher_moves_only_its_adapter(toy_data, base_dir, tmp_path,
                                                                                        one_thread):
    with trained(lora_cfg(toy_data, base_dir, tmp_path / "run", teacher="ema", max_iters=3)) as (run, before, t_before):
        params = dict(run.model.named_parameters())
        adapter = {n for n in params if ".lora_" in n}
        assert adapter and len(adapter) < len(params) and not any(n.startswith("lm_head") for n in adapter)
        # the optimizer holds the adapters and nothing else; the base takes no gradient
        held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        assert held == {id(params[n]) for n in adapter}
        assert all(not p.requires_grad for n, p in params.items() if n not in adapter)
        # base weights bit-identical after the steps, every adapter tensor moved
        assert all(torch.equal(params[n], before[n]) for n in params if n not in adapter)
        assert all(not torch.equal(params[n], before[n]) for n in adapter)
        # the EMA teacher: the student's base tensors themselves, its own adapter copy, moved towards the student's
        own = dict(run.teacher.own.named_parameters())
        assert own.keys() == params.keys()
        assert all(own[n] is params[n] for n in params if n not in adapter)
        assert all(own[n] is not params[n] and not own[n].requires_grad for n in adapter)
        moved = [n for n in adapter if not torch.equal(own[n], t_before[n])]
        assert moved and all(not torch.equal(own[n], params[n]) for n in moved)
        assert all(torch.equal(own[n], t_before[n]) for n in params if n not in adapter)


def test_the_frozen_lora_teacher_is_the_initial_model_and_no_second_copy(toy_data, base_dir, tmp_path, one_thread):
    with trained(lora_cfg(toy_data, base_dir, tmp_path / "run", teacher="frozen")) as (run, before, _):
        student = dict(run.model.named_parameters())
        assert all(any(p is q for q in student.values()) for p in run.teacher.own.parameters())  # nothing copied
        assert run.teacher.own is run.initial_model
        initial, tokenizer = models.load_model(base_dir, torch.device("cpu"))
        batch = hand_made_batch(tokenizer, with_teacher=True)
        (share,) = run.teacher.logits(run.model, batch.teacher_prompt_ids, batch.response_ids, torch.device("cpu"))
        want = models.shared_prompt_hidden(initial, batch.teacher_prompt_ids, batch.response_ids, torch.device("cpu"))
        torch.testing.assert_close(share.hidden, want)
        torch.testing.assert_close(share.weight, models.lm_head(initial)[0])
        ids = torch.tensor([batch.teacher_prompt_ids[0]])
        torch.testing.assert_close(logits_of(run.teacher.own, ids), logits_of(initial, ids))
        assert (logits_of(run.model, ids) - logits_of(initial, ids)).abs().max() > 1e-3  # the student did move


@pytest.mark.parametrize("override", [dict(teacher="trust_region"), dict(teacher="live"),
                                      dict(algo="grpo", kl_coef=0.1), dict(teacher="ema", teacher_stage_reset="initial")])
def test_every_teacher_kind_and_the_kl_reference_run_under_lora_with_no_copy_of_the_base(toy_data, base_dir, tmp_path,
                                                                                        override, one_thread):
    """trust_region's initial model, the KL reference and the stage-reset target are the base view;
    live reads the student; each trains the adapters and copies nothing of the base."""
    with trained(lora_cfg(toy_data, base_dir, tmp_path / "run", **override)) as (run, before, _):
        student = {id(p) for p in run.model.parameters()}
        for extra in (run.initial_model, run.teacher and run.teacher.own, run.teacher and run.teacher.initial):
            if extra is not None:
                assert all(id(p) in student or ".lora_" in n for n, p in extra.named_parameters())
        assert (run.initial_model is not None) == (override != dict(teacher="live"))
        changed = {n for n, p in run.model.named_parameters() if not torch.equal(p, before[n])}
        assert changed and all(".lora_" in n for n in changed)


def test_the_merged_checkpoint_loads_without_peft_and_gives_the_lora_models_logits(toy_data, base_dir, tmp_path,
                                                                                    one_thread):
    peft = pytest.importorskip("peft", reason=NEEDS_PEFT)
    from transformers import AutoModelForCausalLM
    with trained(lora_cfg(toy_data, base_dir, tmp_path / "run", teacher="frozen")) as (run, _, _):
        ckpt = tmp_path / "run" / "ckpt"
        ids = torch.tensor([[5, 17, 30, 42, 9, 3, 61]])
        want = logits_of(run.model, ids)
        top = {p.name for p in ckpt.iterdir()}
        assert {"config.json", "model.safetensors", "adapter", "trainer"} <= top
        assert not any(name.startswith("adapter_") for name in top)  # the top level stays a plain HF folder
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f, \
                safe_open(os.path.join(base_dir, "model.safetensors"), "pt") as g:
            assert set(f.keys()) == set(g.keys())  # the plain model's names, no base_layer / lora_ keys
        merged = AutoModelForCausalLM.from_pretrained(ckpt)
        assert not models.lora_layers(merged) and next(merged.parameters()).dtype == torch.float32
        torch.testing.assert_close(logits_of(merged, ids), want, atol=1e-5, rtol=1e-5)
        served, _ = models.load_model(str(ckpt), torch.device("cpu"))  # what eval.py and sample.py call
        torch.testing.assert_close(logits_of(served, ids), want, atol=1e-5, rtol=1e-5)
        # ckpt/adapter/ is peft's own folder: PeftModel puts it on the base and gives the same model
        with open(ckpt / "adapter" / "adapter_config.json") as f:
            assert json.load(f)["r"] == 4
        on_base = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(ckpt / "adapter"))
        torch.testing.assert_close(logits_of(on_base, ids), want)
        # the frozen teacher is the base: the checkpoint keeps none of it
        assert not (ckpt / "trainer" / "teacher.safetensors").exists()
        assert not (ckpt / "trainer" / "model_fp32.safetensors").exists()
        # eval.py compares the run's base with the one the adapter was trained on: the adapter's metadata holds
        # the base's fingerprint, which the plain base model (loaded without peft) reproduces
        import eval as ev
        saved = ev.read_run(str(tmp_path / "run"))["base_fingerprint"]
        assert saved and checkpoint.same_fingerprint(saved, AutoModelForCausalLM.from_pretrained(base_dir))


def test_a_lora_resume_continues_exactly(toy_data, base_dir, tmp_path):
    """3 iterations, checkpoint, 3 more == 6 uninterrupted (LoRA SDPO + EMA teacher: the base reloaded
    from init_from, the adapter, its optimizer state and the teacher's adapter from the checkpoint)."""
    common = ["config/sdpo_toy.py", *TINY, "--dataset=toy/add", f"--init_from={base_dir}", "--lora_rank=4",
              "--success_threshold=0.0", "--teacher=ema", "--density=0.5", "--learning_rate=1e-2", "--device=cpu"]
    assert_resume_continues_exactly(common, tmp_path)
    with open(tmp_path / "split" / "ckpt" / "trainer" / "state.json") as f:
        assert json.load(f)["base_init"] == base_dir
    for name in ("adapter/adapter_model.safetensors", "model.safetensors", "trainer/teacher.safetensors"):
        a, b = (load_file(str(tmp_path / run / "ckpt" / name)) for run in ("full", "split"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("override,message", [
    (dict(lora_targets="q_proj,nope"), "lora_targets: 'nope' names no module of Qwen2ForCausalLM: its linear layers are "
                                        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or 'all-linear')"),
    (dict(lora_targets="lm_head"), "lora_targets names lm_head, the LM head: nanoSDPO never adapts it"),
    (dict(lora_targets="mlp"), "'mlp' is a Qwen2MLP, not a linear layer of Qwen2ForCausalLM"),
    (dict(lora_targets="embed_tokens"), "'embed_tokens' is a Embedding, not a linear layer"),
    (dict(lora_targets=" , "), "lora_targets=' , ' names no module"),
    (dict(lora_rank=-1), "lora_rank=-1 must be >= 0"),
    (dict(lora_alpha=0.0), "lora_alpha=0.0 must be positive"),
    (dict(teacher_init="/some/model", teacher="frozen"), "a LoRA teacher shares the student's frozen base"),
    (dict(teacher="frozen", teacher_stage_reset="student"), "use teacher=ema --teacher_rate=0"),
    (dict(parallel="fsdp"), "lora_rank > 0 with parallel=fsdp is not supported"),
])
def test_a_bad_lora_setting_is_one_line_and_writes_nothing(toy_data, base_dir, tmp_path, override, message):
    cfg = lora_cfg(toy_data, base_dir, tmp_path / "run", **override)
    with pytest.raises(train.UserError) as e:
        train.main(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_bad_lora_target_from_the_command_line_is_one_line(toy_data, base_dir, tmp_path):
    proc = run_train_here("config/sdpo_toy.py", *TINY, f"--init_from={base_dir}", "--lora_rank=4", "--lora_targets=qproj",
                          f"--out_dir={tmp_path / 'run'}", "--device=cpu")
    assert "'qproj' names no module" in one_line_error(proc)
    assert not (tmp_path / "run").exists()


def test_lora_without_peft_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(train.UserError, match=r"^lora_rank=4 needs the peft package: pip install peft$"):
        train.check_config(dict(defaults(), lora_rank=4))
    train.check_config(defaults())  # lora_rank=0 never asks for it


def test_adapters_get_gradients_through_checkpointed_blocks_over_a_bf16_base(toy_data, base_dir):
    """On CUDA the frozen base is kept in bf16 (the autocast dtype) and the adapters in fp32; with
    grad_checkpointing the gradient still reaches them (the base takes none)."""
    model, _ = models.load_model(base_dir, torch.device("cpu"))
    models.apply_lora(model, rank=4, alpha=8.0, targets="all-linear", base_dtype=torch.bfloat16)
    models.enable_grad_checkpointing(model.train())
    params = dict(model.named_parameters())
    assert all(p.dtype == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, p in params.items())
    ids = torch.tensor([[5, 17, 30, 42, 9, 3, 61]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = models.response_hidden(model, [ids[0, :3].tolist()], [ids[0, 3:].tolist()], torch.device("cpu"))
    h.float().square().mean().backward()
    assert all(p.grad is None for n, p in params.items() if ".lora_" not in n)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in params.items() if ".lora_B." in n)
    # the export is merged and in save_dtype throughout (the bf16 base tensors too)
    weights = checkpoint.export_weights(model, "float32")
    assert weights and all(v.dtype == torch.float32 for v in weights.values()) and not any(".lora_" in k for k in weights)


def test_an_ema_lora_teacher_resets_to_the_base_or_the_student_at_a_stage_boundary(toy_data, base_dir):
    """teacher_stage_reset='initial' under LoRA: the base view has no adapter to copy, so the EMA
    teacher's B goes to 0 and its adapter adds nothing; 'student' copies the student's adapter."""
    model, tokenizer = models.load_model(base_dir, torch.device("cpu"))
    initial = models.frozen_copy(model)
    models.apply_lora(model, rank=4, alpha=8.0, targets="q_proj,v_proj")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_()
    teacher = train.Teacher("ema", 0.5, own=models.adapter_copy(model))
    ids = torch.tensor([[5, 17, 30, 42, 9, 3, 61]])
    assert (logits_of(teacher.own, ids) - logits_of(initial, ids)).abs().max() > 1e-3
    teacher.start_stage("initial", model, models.base_view(model))
    torch.testing.assert_close(logits_of(teacher.own, ids), logits_of(initial, ids))
    assert (logits_of(model, ids) - logits_of(initial, ids)).abs().max() > 1e-3  # the student is left alone
    teacher.start_stage("student", model, models.base_view(model))  # 'student': the student's adapter, copied
    torch.testing.assert_close(logits_of(teacher.own, ids), logits_of(model, ids))
    assert all(p is not q for p, q in zip(teacher.own.parameters(), model.parameters()) if p.requires_grad or q.requires_grad)


def test_memory_estimate_has_the_lora_figure_and_the_lora_config_fits_24_gb(capsys):
    """The LoRA state is the bf16 base + the adapters' fp32 state (an EMA teacher: one adapter copy;
    frozen: none), its adapter count is peft's, and config/sdpo_math_lora.py fits a 24 GB GPU."""
    peft = pytest.importorskip("peft", reason=NEEDS_PEFT)
    from tests.bench import memory_estimate
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def estimate(*argv):
        memory_estimate.main(list(argv))
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lora = estimate("--config=config/sdpo_math_lora.py", "--gpu_gb=24")
    full = estimate("--config=config/sdpo_math.py")
    n, n_ad = lora["params"], lora["lora_params"]
    assert n == full["params"] and 0 < n_ad < 0.02 * n
    assert lora["rows_gb"]["weights"] == round((2 * n + 4 * n_ad) / 1e9, 2)
    assert lora["state_gb"] == round((2 * n + (4 + 4 + 8 + 4) * n_ad) / 1e9, 1)  # base, adapter + grad + AdamW + EMA
    assert lora["needs_gb"] <= 24 < full["needs_gb"]
    frozen = estimate("--config=config/sdpo_math_lora.py", "--teacher=frozen")
    assert frozen["settings"]["teacher"] == "frozen" and frozen["rows_gb"]["copies"] == 0
    # the count is what peft adds on a (small) Qwen3 of the same shape family
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, tie_word_embeddings=True)
    memory_estimate.ARCH["tiny"] = small
    try:
        for targets in ("all-linear", "q_proj,down_proj"):
            model = Qwen3ForCausalLM(Qwen3Config(vocab_size=memory_estimate.VOCAB, **small))
            peft.inject_adapter_in_model(peft.LoraConfig(r=8, target_modules=models.check_lora_targets(model, targets)),
                                         model)
            want = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
            assert memory_estimate.lora_param_count("tiny", 8, targets) == want
    finally:
        del memory_estimate.ARCH["tiny"]


def test_lora_models_and_their_views_decode_on_the_static_cache_as_on_the_dynamic_one(toy_data, base_dir, monkeypatch):
    """The CUDA rollout path (static KV cache, the decode step through torch.compile; here dynamo with
    the eager backend) over peft's layers and the two views (the frozen teacher's base view, the EMA
    teacher's adapter copy), with the base in bf16 under autocast as on a GPU: the same tokens and
    log-probs as the dynamic-cache loop."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, backend="eager", **kw))
    model, _ = models.load_model(base_dir, torch.device("cpu"))
    models.apply_lora(model, rank=4, alpha=8.0, targets="all-linear", base_dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.5)
    prompts = [[1, 4, 5, 6, 7], [8, 9], [10]]
    for m in (model, models.base_view(model), models.adapter_copy(model)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs = [train.generate(m, prompts, group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_ids=[2],
                                   pad_id=0, generator=torch.Generator().manual_seed(5), static=static)
                    for static in (False, True)]
        assert runs[1].response_ids == runs[0].response_ids
        for a, b in zip(runs[1].old_logprobs, runs[0].old_logprobs):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)  # bf16 attention over another cache layout
    assert decoding._compiled_steps, "the static path went through torch.compile"


@pytest.mark.ranks
def test_two_ranks_of_lora_equal_one_process(toy_data, base_dir, tmp_path):
    """Data parallelism over LoRA: the ranks sum the adapters' gradients only (the frozen base has
    none to all-reduce) and the merged model after 2 steps equals the one-process run's."""
    def torchrun(nproc, *argv):
        cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "train.py", *argv]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    args = ["config/toy_base.py", *TINY, f"--init_from={base_dir}", "--lora_rank=4", "--stages=toy/add:2",
            "--batch_prompts=8", "--learning_rate=1e-2", "--eval_max_prompts=2", "--device=cpu"]
    torchrun(2, *args, f"--out_dir={tmp_path / 'two'}")
    run_train(*args, f"--out_dir={tmp_path / 'one'}")
    sums = [r["rank_param_sums"] for r in read_log(tmp_path / "two") if "rank_param_sums" in r]
    assert sums and all(len(s) == 2 and s[0] == s[1] for s in sums)
    two, one = (load_file(str(tmp_path / run / "ckpt" / "model.safetensors")) for run in ("two", "one"))
    assert any(not torch.equal(one[k], v) for k, v in load_file(os.path.join(base_dir, "model.safetensors")).items())
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)


def test_data_parallelism_all_reduces_the_adapters_gradients_only(toy_data, base_dir, monkeypatch):
    """Dist.all_reduce_grads gives a frozen base no zero gradients (a model-sized buffer) to sum."""
    model, _ = models.load_model(base_dir, torch.device("cpu"))
    models.apply_lora(model, rank=4, alpha=8.0, targets="all-linear")
    adapter = [p for n, p in model.named_parameters() if ".lora_" in n]
    for p in adapter[1:]:  # this rank's backward reached all adapters but the first; another rank's reached it
        p.grad = torch.ones_like(p)
    reduced = []

    def all_reduce(tensors):  # the "has a gradient" flags come first: the other rank's 1 for the first adapter
        if not reduced:
            tensors[0][0] += 1
        reduced.extend(tensors)
    monkeypatch.setattr(Dist, "_all_reduce", staticmethod(all_reduce))
    ranks = Dist.__new__(Dist)  # two ranks' bookkeeping, no process group: _all_reduce is recorded instead
    ranks.world = 2
    ranks.all_reduce_grads(model)
    assert sorted(map(id, reduced[1:])) == sorted(id(p.grad) for p in adapter)
    assert torch.equal(adapter[0].grad, torch.zeros_like(adapter[0]))  # zeros only where another rank has a gradient
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


def test_a_lora_resume_over_a_base_that_changed_since_is_one_line(toy_data, base_dir, tmp_path):
    """A resume rebuilds the model from init_from's base + ckpt/adapter/: if that base now holds
    other weights (retrained, overwritten), continuing would not be the same run."""
    import shutil
    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    cfg = lora_cfg(toy_data, str(base), tmp_path / "run", teacher="frozen", max_iters=1)
    train.main(cfg)
    with contextlib.ExitStack() as stack:  # the base unchanged: it resumes
        assert train.setup(dict(cfg, init_from="resume", max_iters=2), Dist("cpu"), stack).state.iter == 1
    other, tokenizer = models.load_model("scratch", torch.device("cpu"), scratch=dict(
        defaults(), tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"), seed=7, n_layer=1, n_head=2, n_embd=32,
        block_size=128))
    other.save_pretrained(base)
    with pytest.raises(train.UserError, match="holds other weights than the run's LoRA adapter was trained on"), \
            contextlib.ExitStack() as stack:
        train.setup(dict(cfg, init_from="resume", max_iters=2), Dist("cpu"), stack)


def test_lora_over_a_bf16_base_as_on_cuda_trains_exports_and_resumes(toy_data, base_dir, tmp_path, one_thread):
    """dtype=bfloat16 (what 'auto' is on CUDA): the frozen base is kept in bf16, the adapters in fp32;
    the fused loss reads the bf16 head; ckpt/ is in save_dtype; a resume reloads the base and goes on."""
    cfg = lora_cfg(toy_data, base_dir, tmp_path / "run", teacher="ema", dtype="bfloat16", save_dtype="bfloat16")
    with trained(cfg) as (run, before, _):
        dtypes = {n: p.dtype for n, p in run.model.named_parameters()}
        assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
        assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    with safe_open(str(tmp_path / "run" / "ckpt" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    train.main(dict(cfg, init_from="resume", max_iters=3))
    assert [r["iter"] for r in read_log(tmp_path / "run") if "loss" in r] == [1, 2, 3]
