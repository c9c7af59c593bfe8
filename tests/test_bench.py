"""The benchmark scripts still run end to end (tiny sizes; their figures are not checked here:
speed is never asserted in a test), and tests/ holds tests: the scripts live in tests/bench/ and
tests/experiments/, run from any folder, and every path the docs give for them exists."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def run_script(*args):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_step_runs_and_reports_every_phase(toy_data):
    out = run_script("tests/bench/bench_step.py", "--init_from=scratch", "--iters=2", "--gen_runs=1",
                     "--batch_prompts=2", "--group_size=4", "--max_new_tokens=6")
    assert out["settings"]["iters"] == 2 and out["settings"]["init_from"] == "scratch"
    # a scratch model never succeeds, so the bench sets success_threshold 0: every response has a peer
    assert out["sdpo_teacher_seqs"] == 8 and out["sdpo_phases"]["teacher"] > 0
    assert 1 <= out["sdpo_teacher_unique_prompts"] <= out["sdpo_teacher_unique_pairs"] <= 8
    assert out["grpo_phases"]["teacher"] < out["sdpo_phases"]["teacher"]
    assert out["sdpo_over_grpo"] > 0 and out["rollout_speedup"] > 0 and out["rollout_tokens"] > 0


def test_bench_loss_runs_and_fused_matches_naive():
    out = run_script("tests/bench/bench_loss.py", "--size", "256", "32", "2048", "--runs=1")
    assert out["size"] == [256, 32, 2048] and out["other_sizes"] == []
    assert out["naive_s"] > 0 and out["fused_s"] > 0 and out["naive_peak_mb"] > 0
    assert out["max_abs_grad_diff"] < 1e-5


def estimate(capsys, *argv):
    """tests/bench/memory_estimate.py in this process (transformers and train.py imported once): its JSON."""
    from tests.bench import memory_estimate
    memory_estimate.main(list(argv))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_memory_estimate_counts_the_published_sizes(capsys):
    """Qwen3 parameter counts built on the meta device (no download), and the state they imply
    (the default config, sdpo_math.py: an EMA teacher); the script runs as a script."""
    for model, params in (("qwen3-0.6b", 0.596e9), ("qwen3-1.7b", 1.72e9), ("qwen3-4b", 4.02e9), ("qwen3-8b", 8.19e9)):
        out = run_script("tests/bench/memory_estimate.py", f"--model={model}") if model == "qwen3-4b" else \
            estimate(capsys, f"--model={model}")
        assert abs(out["params"] - params) / params < 0.005
        assert out["state_gb"] == round(out["params"] * (4 + 4 + 8 + 4) / 1e9, 1)  # weights, grads, AdamW, EMA teacher
        assert out["peak_gb"] > out["state_gb"]


def test_memory_estimate_reads_a_config_and_the_gsm8k_rung_fits_one_gpu(capsys):
    """--config reads a shipped config as train.py does (flags override it); the GSM8K configs fit
    an 80 GB GPU on Qwen3-1.7B and, with the overrides their comments give, 24 GB on Qwen3-0.6B,
    with the 10 % the estimate leaves for CUDA context and fragmentation."""
    small = ["--init_from=Qwen/Qwen3-0.6B", "--gen_batch_size=32", "--micro_batch_size=8"]
    for config in ("config/sdpo_gsm8k.py", "config/grpo_gsm8k.py"):
        big = estimate(capsys, f"--config={config}", "--gpu_gb=80")
        assert big["model"] == "qwen3-1.7b" and big["settings"]["max_new_tokens"] == 1024
        assert big["needs_gb"] <= 80 and big["peak_gb"] <= 0.9 * 80
        out = estimate(capsys, f"--config={config}", "--gpu_gb=24", *small)
        assert out["model"] == "qwen3-0.6b" and out["settings"]["gen_batch_size"] == 32  # the flags win
        assert out["needs_gb"] <= 24
        with open(os.path.join(ROOT, config)) as f:
            assert " ".join(small) in f.read()  # the config's comment gives these overrides
    sdpo = estimate(capsys, "--config=config/sdpo_gsm8k.py")
    assert sdpo["settings"]["algo"] == "sdpo" and sdpo["rows_gb"]["kv_teacher"] > 0
    assert big["settings"]["algo"] == "grpo" and big["rows_gb"]["kv_teacher"] == 0 and big["rows_gb"]["copies"] == 0
    # the fused loss's buffers; a bucket per rank only with DDP; no checkpointing: every block's activations
    assert sdpo["rows_gb"]["fused_loss"] > 0 and sdpo["rows_gb"]["ddp_bucket"] == 0
    ddp = estimate(capsys, "--config=config/sdpo_gsm8k.py", "--world_size=8")
    assert ddp["rows_gb"]["ddp_bucket"] == round(2 ** 24 * 4 / 1e9, 2)
    full = estimate(capsys, "--config=config/sdpo_gsm8k.py", "--grad_checkpointing=False")
    assert full["rows_gb"]["activations"] > 5 * sdpo["rows_gb"]["activations"]


def test_memory_estimate_counts_the_static_cache_the_weight_copies_and_what_stays_beside_the_train_step(capsys):
    """The paper-scale run (sdpo_math.py, Qwen3-4B): a bf16 static cache of gen_batch_size rows at the
    bucketed length, bf16 weight copies in both phases (the decode weights; autocast's, saved for the
    backward), and the decode state (that cache + the decode weights) freed before the train step on an
    H200 (it does not fit beside it) but kept on a GPU twice that size, through the optimizer step too."""
    out = estimate(capsys)
    rows, kv = out["rows_gb"], 36 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16
    assert rows["kv_generate"] == round(32 * 5120 * kv / 1e9, 2)  # 512 + 4096 tokens, bucketed to 5120
    assert rows["autocast_gen"] == rows["autocast_step"] == round(2 * out["params"] / 1e9, 2)
    assert not out["decode_state_kept"] and rows["decode_state_kept"] == 0 and out["needs_gb"] <= 141
    big = estimate(capsys, "--gpu_gb=282")
    assert big["decode_state_kept"]
    assert big["rows_gb"]["decode_state_kept"] == pytest.approx(rows["kv_generate"] + rows["autocast_gen"], abs=0.011)
    # kept, it is there through the optimizer step too (StepMemory measures the two as one step)
    assert big["rows_gb"]["decode_state_kept_opt"] == big["rows_gb"]["decode_state_kept"]
    assert big["phases_gb"]["optimizer"] == pytest.approx(big["rows_gb"]["adamw_step"] + big["rows_gb"]["decode_state_kept"],
                                                          abs=0.011)


SMALL_GPU = ["--gpu_gb=24", "--init_from=Qwen/Qwen3-0.6B", "--gen_batch_size=32", "--micro_batch_size=8"]  # the files' 0.6B lines
README_MEMORY = {  # README's configs table: each row's memory figures, in order, and the estimate each comes from
    "`grpo_gsm8k.py` / `sdpo_gsm8k.py`": [["--config=config/grpo_gsm8k.py", "--gpu_gb=80"],
                                         ["--config=config/sdpo_gsm8k.py", "--gpu_gb=80"],
                                         ["--config=config/grpo_gsm8k.py", *SMALL_GPU], ["--config=config/sdpo_gsm8k.py", *SMALL_GPU]],
    "`grpo_math.py` / `sdpo_math.py`": [["--config=config/grpo_math.py"], ["--config=config/sdpo_math.py"]],
    "`grpo_code.py` / `sdpo_code.py`": [["--config=config/grpo_code.py", "--prompt_tokens=2048"],
                                       ["--config=config/sdpo_code.py", "--prompt_tokens=2048"]],
    "`continual_real.py`": [["--config=config/continual_real.py"], ["--config=config/continual_real.py", "--prompt_tokens=2048"]],
    "`sdpo_math.py --parallel=fsdp` (torchrun, 8 ranks)": [
        ["--config=config/sdpo_math.py", "--parallel=fsdp", "--world_size=8", "--gpu_gb=80"],
        ["--config=config/sdpo_math.py", "--parallel=fsdp", "--world_size=8", "--gpu_gb=80", "--init_from=Qwen/Qwen3-8B",
         "--micro_batch_size=4"]],
    "`sdpo_math_lora.py`": [["--config=config/sdpo_math_lora.py", "--gpu_gb=24"],
                            ["--config=config/sdpo_math_lora.py", "--gpu_gb=24", "--teacher=frozen"]],
}


def test_readmes_memory_figures_are_what_memory_estimate_prints_today(capsys):
    """Every figure in README's configs table is the peak memory_estimate.py gives for its config now
    (a change to the estimate or to a config shows up here, not in a stale table)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        rows = {line.split("|")[1].strip(): line.split("|")[-2] for line in f if line.startswith("| `")}
    for name, commands in README_MEMORY.items():
        figures = [float(x) for x in re.findall(r"(\d+\.\d)(?![\dB])", rows[name])]  # GB figures, not "0.6B"
        assert figures == [estimate(capsys, *argv)["peak_gb"] for argv in commands], (name, rows[name])


def test_the_config_files_memory_comments_are_what_memory_estimate_prints_today(capsys):
    """Each config comment "X GB peak, Y GB with the allocator's slack (python tests/bench/memory_estimate.py
    ...)" holds that command's peak and needs, as it prints them now."""
    claims = []
    for f in sorted(glob.glob(os.path.join(ROOT, "config", "*.py"))):
        with open(f) as fh:  # the comments as one text: a claim may wrap over lines
            text = " ".join(line.strip().lstrip("#").strip() for line in fh if line.strip().startswith("#"))
        claims += [(os.path.basename(f), *m) for m in re.findall(
            r"(\d+\.\d) GB peak, (\d+\.\d) GB with the allocator's slack \(python tests/bench/memory_estimate\.py ([^)]*)\)", text)]
    assert len(claims) >= 12, claims
    for name, peak, needs, argv in claims:
        out = estimate(capsys, *argv.split())
        assert (out["peak_gb"], out["needs_gb"]) == (float(peak), float(needs)), (name, argv)


def test_every_shipped_qwen3_config_gets_an_estimate(capsys):
    from configurator import configure
    import train
    configs = sorted(f for f in os.listdir(os.path.join(ROOT, "config")) if f.endswith(".py"))
    named = []
    for f in configs:
        init_from = configure(dict(vars(train)), [os.path.join(ROOT, "config", f)], train.__file__)["init_from"]
        if init_from.startswith("Qwen/Qwen3-"):
            out = estimate(capsys, f"--config=config/{f}")
            assert out["init_from"] == init_from and out["model"] == init_from.split("/")[1].lower()
            assert out["peak_gb"] > out["state_gb"] > 0
            named.append(f)
    assert {"sdpo_gsm8k.py", "grpo_gsm8k.py", "sdpo_math.py", "grpo_math.py", "continual_real.py"} <= set(named)


def test_the_device_session_script_brings_back_the_table_json_console_and_logs(toy_data, tmp_path):
    """tests/bench/gpu_session.sh is what a lent GPU machine runs: gpu_check into a scratch folder, then
    into $OUT (which brings back at most 8 files) its table, JSON, console log and one logs archive."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tests/bench/gpu_session.sh", "d", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1", PATH=os.path.dirname(
                              sys.executable) + os.pathsep + os.environ["PATH"]))  # python3: this interpreter
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["console_d.log", "gpu_check_d.json", "gpu_check_d.md", "logs_d.tgz"]
    assert json.loads((out / "console_d.log").read_text().strip().splitlines()[-1])["correctness_ok"]
    assert "| sec | check | status | numbers |" in (out / "gpu_check_d.md").read_text()


def test_gpu_check_stopped_by_its_time_limit_still_writes_what_ran_and_stops_its_train_runs(toy_data, tmp_path):
    """gpu_session.sh stops gpu_check (timeout's SIGTERM) before the device's per-command limit would kill it
    whole: the table and JSON are still written (the section that was running an error, so the exit is 1),
    and the train.py run it had started is stopped, not left on the GPU. Started with SIGINT ignored, as a
    background job is: gpu_check sets its own handlers."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "tests/bench/gpu_check.py", "--cpu", "--only=e,d", f"--out={tmp_path}"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    for line in proc.stdout:
        if line.startswith("[e] train.py"):  # section e has just started its train.py run
            break
    time.sleep(2)  # (the child may still be starting: it is killed either way)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 1, rest[-3000:]
    out = json.loads(rest.strip().splitlines()[-1])
    assert "interrupted" in out["errors"]["e"] and out["sections"] == ["e", "d"] and "d" not in out["seconds"]
    assert not out["correctness_ok"] and "sections not run: d" in rest
    assert "interrupted" in (tmp_path / "gpu_check_ed.md").read_text()
    time.sleep(1)
    still = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path).encode() in
             open(f"/proc/{pid}/cmdline", "rb").read()] if os.path.isdir("/proc") else []
    assert not still, "the train.py run outlived gpu_check"


def test_gpu_check_killed_outright_keeps_the_table_and_json_of_the_sections_that_finished(toy_data, tmp_path):
    """The device kills a command that outlives its limit with SIGKILL (no handler runs, and gpu_session.sh's
    lines after gpu_check do not either): the table and JSON, rewritten into --report-dir after every
    section, still hold the sections that had finished."""
    import signal
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "tests/bench/gpu_check.py", "--cpu", "--only=d,e", f"--out={tmp_path / 'scratch'}",
                             f"--report-dir={report}"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    for line in proc.stdout:
        if line.startswith("[e] train.py"):  # d has finished, e is running
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    out = json.loads((report / "gpu_check_de.json").read_text())
    assert out["not_finished"] == ["e"] and set(out["seconds"]) == {"d"} and out["checks"]
    assert {c["section"] for c in out["checks"]} == {"d"} and "not finished: e" in (report / "gpu_check_de.md").read_text()
    assert not [f for f in os.listdir(report) if f.endswith(".tmp")]


def test_gpu_check_runs_every_section_in_cpu_mode(toy_data, tmp_path):
    """tests/bench/gpu_check.py --cpu runs the GPU check's code paths at tiny sizes: every section reports,
    the correctness checks pass, and the last line is the JSON with them (speed is not checked)."""
    proc = subprocess.run([sys.executable, "tests/bench/gpu_check.py", "--cpu", f"--out={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[0] == "| sec | check | status | numbers |"
    assert {row.split("|")[1].strip() for row in rows[1:]} == {"a", "b", "c", "d", "e"}  # every section has a row
    assert out["mode"] == "cpu" and out["sections"] == ["a", "b", "c", "d", "e"] and out["errors"] == {}
    assert set(out["seconds"]) == {"a", "b", "c", "d", "e"}
    names = " / ".join(out["correctness"])
    for expected in ("fused == naive, fp32", "bf16 inputs", "bf16 products (autocast)", "static == dynamic",
                     "static ~ dynamic", "bf16 decode weights", "resume continues exactly", "SFT", "GRPO", "SDPO",
                     "the headline config's first 2 iterations"):
        assert expected in names, (expected, names)
    assert out["correctness_ok"] and set(out["correctness"].values()) == {"PASS"}
    assert len(lines[-1]) < 6000  # the short form: a device call returns 12,000 characters
    with open(out["files"]["json"]) as f:
        full = json.load(f)  # the table and the full JSON are written into --out
    with open(out["files"]["table"]) as f:
        assert f.read().splitlines()[2] == "| sec | check | status | numbers |"
    assert os.path.dirname(out["files"]["json"]) == str(tmp_path) and os.listdir(out["files"]["logs"])
    out = full
    checks = {c["name"]: c for c in out["checks"]}
    bench = next(c for c in out["checks"] if c["name"].startswith("fused speed"))["numbers"]
    assert bench["naive_bf16_s"] > 0 and bench["fused_s"] > 0  # the bf16-naive column ran
    liger = next(c for c in out["checks"] if "Liger" in c["name"])
    assert liger["status"] == "SKIP" and "CUDA" in liger["summary"]  # never a requirement
    assert checks["train.generate(static=True) tokens/s"]["numbers"]["tok_s"] > 0
    assert checks["compiles of the static decode step"]["numbers"]["warmup"] >= 1  # the counter sees the compile
    assert any("grad_checkpointing" in name and status == "PASS" for name, status in out["correctness"].items())
    assert next(c for c in out["checks"] if c["name"].startswith("static rollout"))["numbers"]["static_over_hf"] > 0


def test_gpu_check_reports_a_cpu_peak_of_zero_instead_of_failing_section_c(tmp_path, monkeypatch, capsys):
    """On the CPU a peak is RSS growth: a naive run whose memory the process already held measures 0 MB, so
    bench_loss has no memory ratio (None). Section c says so in its row; it once raised (a CI run's FAIL)."""
    import argparse
    from tests.bench import gpu_check
    result = {"size": [256, 32, 2048], "max_abs_grad_diff": 1e-3, "max_abs_grad": 1.0, "speedup_vs_bf16_naive": 1.1,
              "naive_bf16_s": 0.11, "fused_s": 0.1, "naive_s": 0.12, "naive_bf16_peak_mb": 0.0, "fused_peak_mb": 2.0,
              "naive_peak_mb": 9.0, "mem_frac_of_bf16_naive": None,
              "jsd": {"liger_skipped": "Liger's kernels are Triton (CUDA only)", "fused_s": 0.1, "fused_peak_mb": 8.0}}
    monkeypatch.setattr(gpu_check.bench_loss, "main", lambda argv: result)
    C = gpu_check.Check(argparse.Namespace(cpu=True, out=str(tmp_path)))
    gpu_check.section_c(C)
    row = next(r for r in C.rows if r["name"].startswith("fused peak"))
    assert row["status"] == "INFO" and "bf16 naive 0 MB, fused 2 MB: no ratio (a CPU peak is RSS growth" in row["summary"]
    assert [r["name"].split()[0] for r in C.rows] == ["fused", "fused", "fused", "fused"]  # every row of section c


def test_tests_top_level_holds_only_test_files_conftest_and_subfolders():
    tests = os.path.join(ROOT, "tests")
    files = [f for f in os.listdir(tests) if os.path.isfile(os.path.join(tests, f)) and not f.startswith(".")]
    stray = [f for f in files if f != "conftest.py" and not (f.startswith("test_") and f.endswith(".py"))]
    assert stray == [], f"scripts belong in tests/bench/ or tests/experiments/, not the top of tests/: {stray}"
    for folder in ("bench", "experiments"):  # pytest collects nothing there: the scripts are not tests
        assert not glob.glob(os.path.join(tests, folder, "test_*.py"))


def test_every_script_path_the_docs_and_scripts_name_exists():
    """README, RESULTS, the configs' comments and the scripts' own docstrings name each script by the
    path it is run by (`python tests/experiments/miniature.py ...`): none names a stale one."""
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "RESULTS.md"),
            *glob.glob(os.path.join(ROOT, "config", "*.py")),
            *glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)]
    named = set()
    for doc in docs:
        with open(doc) as f:
            named |= {(os.path.relpath(doc, ROOT), path) for path in re.findall(r"tests/[\w/]+\.py", f.read())}
    assert {path for _, path in named if path.startswith(("tests/bench/", "tests/experiments/"))}  # the check looks
    missing = sorted((doc, path) for doc, path in named if not os.path.isfile(os.path.join(ROOT, path)))
    assert missing == [], missing


# each script as `python <script> --help` would run it, one after another in one interpreter (one torch import,
# not five): before each, the repo's modules are forgotten and sys.path is the interpreter's own with the
# script's folder first, so a script without its own repo-root insert fails as it would alone
RUN_AS_SCRIPTS = """
import os, runpy, sys
root, scripts = sys.argv[1], sys.argv[2:]
base = [p for p in sys.path if p not in ("", os.getcwd())]
for script in scripts:
    for name, module in list(sys.modules.items()):
        where = [getattr(module, "__file__", None)]
        try:
            where += list(getattr(module, "__path__", []))  # a package's folders (tests/ is a namespace package)
        except TypeError:  # a torch namespace object that is not a list of folders
            pass
        if any(isinstance(w, str) and w.startswith(root + os.sep) for w in where):
            del sys.modules[name]
    sys.path[:] = [os.path.dirname(script), *base]
    sys.argv = [script, "--help"]
    print("=== " + script, flush=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (script, e.code)
"""


def test_the_scripts_that_import_a_sibling_run_as_scripts_from_any_folder(tmp_path):
    """`python tests/experiments/sort_fade.py` imports `tests.experiments.miniature` (and gpu_check.py
    `tests.bench.bench_loss`) through the one repo-root insert, wherever it is started from."""
    scripts = [os.path.join(ROOT, s) for s in (
        "tests/experiments/miniature.py", "tests/experiments/sort_fade.py", "tests/experiments/teacher_track.py",
        "tests/experiments/spectral_runs.py", "tests/bench/gpu_check.py")]
    proc = subprocess.run([sys.executable, "-c", RUN_AS_SCRIPTS, ROOT, *scripts], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    helps = proc.stdout.split("=== ")[1:]
    assert [h.split("\n", 1)[0] for h in helps] == scripts and all("usage:" in h for h in helps), proc.stdout[-2000:]


def test_every_test_the_docs_cite_by_name_exists():
    """README's failure-modes table and the scripts cite tests as `<file>.py::<test name>…` (a prefix):
    each still names a test in that file, so moving a test between files updates its citations."""
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "RESULTS.md"),
            *glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)]
    cited = set()
    for doc in docs:
        with open(doc) as f:
            cited |= {(os.path.relpath(doc, ROOT), *m) for m in re.findall(r"(test_\w+\.py)::(test_\w+)", f.read())}
    assert cited  # the check looks at something
    stale = []
    for doc, file, name in sorted(cited):
        path = os.path.join(ROOT, "tests", file)
        if not os.path.isfile(path) or f"def {name}" not in open(path).read():
            stale.append((doc, file, name))
    assert stale == [], stale


def test_compare_runs_finds_a_rerun_identical_names_a_key_that_differs_and_refuses_bad_input(tmp_path):
    """tests/experiments/compare_runs.py, the check that a rerun of the miniature reproduces its runs."""
    from tests.experiments import compare_runs

    def run(name, loss):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "accuracy_matrix.json").write_text(json.dumps({"rows": [[0.5]], "base": {"toy/add": 0.1}}))
        (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
            {"iter": 1, "reward": 0.5, "loss": loss, "iter_s": 3.0}, {"eval_tag": "x", "iter": 1, "reward": 9.0})))
        return str(folder)

    a, again, other = run("a", 1.0), run("again", 1.0), run("other", 1.5)
    assert compare_runs.compare(a, again)[:3] == (True, 1, {})  # phase times (iter_s) never count
    assert compare_runs.compare(a, other)[:3] == (True, 1, {"loss": 0.5})
    proc = subprocess.run([sys.executable, "tests/experiments/compare_runs.py", a, str(tmp_path / "none")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "accuracy_matrix.json" in proc.stderr


def test_runs_table_shows_the_settings_that_differ_and_each_sets_first_last_and_best(finished_run, tmp_path):
    """tests/experiments/runs_table.py on a finished run and a copy of it whose settings and last eval were
    changed: one row per run, a column per differing setting (not out_dir), each set's scores."""
    from tests.experiments import runs_table
    other = tmp_path / "other"
    shutil.copytree(finished_run, other)
    state = other / "ckpt" / "trainer" / "state.json"
    saved = json.loads(state.read_text())
    saved["config"].update(learning_rate=0.5, out_dir="elsewhere")
    state.write_text(json.dumps(saved))
    rows = [json.loads(line) for line in (other / "log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_tag" in r]
    key = next(k for k in evals[0] if k.startswith("eval/") and "/mean@" in k)
    with open(other / "log.jsonl", "a") as f:
        f.write(json.dumps({"iter": 3, "eval_tag": "periodic", key: 0.75}) + "\n")
    first = evals[0][key]
    text = runs_table.table([str(finished_run), str(other)])
    lines = text.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:3] == ["run", "learning_rate", "iters"] and text.endswith("settings that differ: learning_rate")
    name = key[len("eval/"):key.rindex("/mean@")]  # the set, e.g. toy/add
    col = head.index(f"{name} mean@n: first → last (best)")
    mine, theirs = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:4])
    assert mine[0] == str(finished_run) and theirs[1] == "0.5" and mine[2] == theirs[2] == "2"
    assert theirs[col] == f"{first:.3f} → 0.750 (0.750)" and mine[col].startswith(f"{first:.3f} → ")
    with pytest.raises(SystemExit, match=f"{tmp_path} has no log.jsonl"):
        runs_table.table([str(finished_run), str(tmp_path)])


def test_teacher_signal_runs_on_a_scratch_model(toy_data):
    """tests/experiments/teacher_signal.py end to end at a tiny size (a random model: no signal is
    expected, so only the report's shape and ranges are checked)."""
    out = run_script("tests/experiments/teacher_signal.py", "--init_from=scratch", "--domains=add", "--n_prompts=2",
                     "--n=1", "--max_new_tokens=4")
    rows = out["domains"]["add"]
    assert set(rows) == set(out["overall"]) == {"plain", "demo+", "demo-"} and out["n_prompts"] == 2
    assert all(r["logp_sum"] < 0 and r["logp_tok"] < 0 and 0 <= r["mean@1"] <= 1 and 0 <= r["copy@1"] <= 1
               for r in rows.values())
    assert rows["plain"]["frac_correct_up"] is None and 0 <= rows["demo+"]["frac_correct_up"] <= 1
    assert rows["demo+"]["prompt_len"] > rows["plain"]["prompt_len"]  # the demonstration is in the teacher's prompt


def test_teacher_signal_reads_func_through_its_expression_and_adds_the_feedback_teacher(toy_data):
    """func's answer is its hidden tests, not text in the response: the answer scored is the
    expression in the tags, a wrong demonstration is one digit of it changed (still an expression, one
    the sandbox rejects with the feedback the toy copies have), and func gets a feedback-only row."""
    import random
    import train
    from tests.experiments import teacher_signal
    tasks = train.load_tasks("toy/func", "test", os.path.join(ROOT, "data"))[:20]
    for t, (wrong, wrong_sol) in zip(tasks, teacher_signal.wrong_demonstrations(tasks, random.Random(0))):
        assert teacher_signal.shown_answer(t, t["solution"]) in t["solution"] and wrong_sol == f"<answer>{wrong}</answer>"
        score, feedback = train.reward("code", wrong_sol, t["answer"])
        assert score == 0.0 and feedback == teacher_signal.toy_prepare().func_feedback(wrong_sol, t["answer"])
        assert train.reward("exact", wrong_sol, wrong)[0] == 1.0  # how a copy of the wrong demonstration is counted
    out = run_script("tests/experiments/teacher_signal.py", "--init_from=scratch", "--domains=func", "--n_prompts=2",
                     "--n=1", "--max_new_tokens=4")
    rows = out["domains"]["func"]
    assert set(rows) == {"plain", "demo+", "demo-", "feedback-"} and set(out["overall"]) == {"plain", "demo+", "demo-"}
    assert rows["feedback-"]["prompt_len"] > rows["plain"]["prompt_len"] and rows["feedback-"]["logp_answer"] < 0


def test_miniature_finishes_a_run_that_a_crash_left_half_written(toy_data, tmp_path, monkeypatch):
    """A train.py killed after its first stage leaves accuracy_matrix.json and log.jsonl, and a second
    train.py refuses that folder (it holds an earlier run): run_one trains it again from the start
    (--overwrite=True), then evaluates it; --no_run's test (finished) does not take the half-written
    folder for a finished one."""
    from tests.experiments import miniature as mini
    tiny = ["--init_from=scratch", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128", "--eval_max_prompts=2",
            "--eval_n=2", "--batch_prompts=2", "--group_size=2", "--micro_batch_size=4", "--max_new_tokens=4",
            "--stages=toy/add:1,toy/mul:1"]
    monkeypatch.setitem(mini.ARMS, "grpo", mini.arm(mini.G, *tiny, evaluate=False))
    full = tmp_path / "grpo_s1"
    full.mkdir()
    (full / "accuracy_matrix.json").write_text(json.dumps({"eval_sets": ["toy/add"], "stages": ["toy/add"], "rows": [[0.3]],
                                                            "base": {"toy/add": 0.2}}))
    (full / "log.jsonl").write_text(json.dumps({"iter": 1, "stage": "toy/add", "reward": 0.1}) + "\n")
    assert not mini.finished(str(full))
    assert mini.run_one("grpo", 1, str(tmp_path)) == (str(full), None)
    assert mini.finished(str(full)) and "--overwrite=True" in (full / "run.out").read_text()
    matrix = json.loads((full / "accuracy_matrix.json").read_text())
    assert matrix["stages"] == ["toy/add", "toy/mul"] and len(matrix["rows"]) == 2  # the rerun's, not the crash's row
    assert mini.run_metrics(str(full))["collapse"] in (0.0, 1.0)
