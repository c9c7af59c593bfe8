"""Continual training: stages in turn, the accuracy matrix and eval.py's continual metrics (forgetting,
BWT / FWT) and its heatmap, and the guard that lets an earlier domain be forgotten but not wiped out."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, run_train

import eval as ev
import metrics
import train


MATRIX = {"eval_sets": ["A", "B", "C"], "stages": ["A", "B", "C"], "base": {"A": 0.1, "B": 0.2, "C": 0.3},
          "rows": [[0.8, 0.3, 0.3],
                   [0.6, 0.9, 0.4],
                   [0.5, 0.7, 0.95]]}


def test_continual_metrics_on_a_hand_made_matrix():
    c = ev.continual_metrics(MATRIX)
    assert c["avg_final"] == pytest.approx((0.5 + 0.7 + 0.95) / 3)
    assert c["avg_acc"] == pytest.approx(c["avg_final"])  # every set trained on
    # A and B were trained on before the last stage; C only in the last one: no forgetting defined
    assert c["forgetting"]["A"] == pytest.approx(0.8 - 0.5)
    assert c["forgetting"]["B"] == pytest.approx(0.9 - 0.7)
    assert c["forgetting"]["C"] is None
    assert c["avg_forgetting"] == pytest.approx(0.25)
    # max drop covers every set, the base included
    assert c["max_drop"] == pytest.approx({"A": 0.3, "B": 0.2, "C": 0.4 - 0.95})
    assert c["bwt"] == pytest.approx(((0.5 - 0.8) + (0.7 - 0.9)) / 2)   # -0.25
    assert c["fwt"] == pytest.approx(((0.3 - 0.2) + (0.4 - 0.3)) / 2)   # 0.1
    assert c["gain"] == pytest.approx([0.8 - 0.1, 0.9 - 0.3, 0.95 - 0.4])
    assert c["stage_columns"] == [[0], [1], [2]]


def test_continual_metrics_mixed_stage_unevaluated_stage_and_single_stage():
    m = {"eval_sets": ["A", "B", "C"], "stages": ["A+B", "D", "C"], "base": {"A": 0.0, "B": 0.0, "C": 0.2},
         "rows": [[0.6, 0.4, 0.2], [0.5, 0.2, 0.3], [0.3, 0.1, 0.9]]}
    c = ev.continual_metrics(m)
    assert c["stage_columns"] == [[0, 1], [], [2]]
    # stage 'A+B' contributes the mean over its two sets; stage 'D' (not evaluated) is skipped
    assert c["bwt"] == pytest.approx(((0.3 - 0.6) + (0.1 - 0.4)) / 2)
    assert c["fwt"] == pytest.approx(0.3 - 0.2)
    assert c["forgetting"]["A"] == pytest.approx(0.3) and c["forgetting"]["B"] == pytest.approx(0.3)
    assert c["forgetting"]["C"] is None and c["gain"][1] is None
    assert c["avg_final"] == pytest.approx((0.3 + 0.1 + 0.9) / 3) and c["avg_acc"] == pytest.approx(c["avg_final"])
    one = ev.continual_metrics({"eval_sets": ["A", "B"], "stages": ["A"], "base": {"A": 0.1, "B": 0.5},
                                "rows": [[0.7, 0.4]]})
    assert one["avg_final"] == pytest.approx(0.55)
    assert one["avg_acc"] == pytest.approx(0.7)  # GEM's ACC: B was never trained on
    assert ev.continual_metrics(dict(m, stages=["D", "E", "F"]))["avg_acc"] is None  # no eval set trained on
    assert one["bwt"] is None and one["fwt"] is None and one["avg_forgetting"] is None
    assert one["forgetting"] == {"A": None, "B": None}
    assert one["max_drop"] == pytest.approx({"A": 0.1 - 0.7, "B": 0.1})


def test_in_a_continual_run_an_earlier_domain_may_be_forgotten_but_not_zeroed():
    """Forgetting an earlier stage's domain is what a continual run measures: only the current
    stage's sets are held to half their best; an earlier one is a collapse only at zero."""
    patience1 = {"collapse_patience": 1, "stop_on_collapse": True}
    guard = metrics.Guard(best={"add": 0.6, "mul": 0.4})
    long = {"add": 5.0, "mul": 5.0}
    assert metrics.check_eval(guard, {"add": 0.1, "mul": 0.4}, long, patience1, trained={"mul"})  # add forgotten
    with pytest.raises(metrics.Collapse, match="mul fell to 0.100"):  # the domain being trained halved
        metrics.check_eval(guard, {"add": 0.6, "mul": 0.1}, long, patience1, trained={"mul"})
    with pytest.raises(metrics.Collapse, match="add fell to 0.000"):  # an earlier domain wiped out
        metrics.check_eval(metrics.Guard(best={"add": 0.6, "mul": 0.4}), {"add": 0.0, "mul": 0.4}, long, patience1,
                           trained={"mul"})
    assert train.metrics.trained_sets([("add", 3), ("mul+sub", 3)], "mul+sub") == {"mul", "sub"}
    assert train.metrics.trained_sets([("add", 3)], "add") is None  # one stage: every set held to half its best


def test_two_stage_run_then_eval(toy_data, tmp_path):
    run = str(tmp_path / "run")
    run_train("config/toy_base.py", *TINY, "--learning_rate=1e-2", "--stages=toy/add:2,toy/sort:2",
              "--eval_sets=toy/add,toy/sort", f"--out_dir={run}")
    assert os.path.exists(os.path.join(run, "accuracy_matrix.json"))
    assert os.path.isdir(os.path.join(run, "stage1_toy_add")) and os.path.isdir(os.path.join(run, "stage2_toy_sort"))
    proc = subprocess.run([sys.executable, "eval.py", f"--run_dir={run}", "--n=2", "--k=1,2", "--max_prompts=4",
                           "--drift_prompts=4", "--eval_sets=toy/add,toy/sort", "--plots=True"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run, "eval.json")) as f:
        r = json.load(f)
    assert {"config", "model", "base_model", "eval_sets", "accuracy", "accuracy_avg", "continual", "drift",
            "stage_drift"} <= set(r)
    assert r["base_model"] == "scratch" and r["eval_sets"] == ["toy/add", "toy/sort"]
    for name in ("toy/add", "toy/sort"):
        acc = r["accuracy"][name]
        assert set(acc["model"]) == {"mean@2", "pass@1", "pass@2"} and acc["n_prompts"] == 4
        assert acc["delta"]["mean@2"] == pytest.approx(acc["model"]["mean@2"] - acc["base"]["mean@2"])
        resp = r["drift"]["response"][name]
        assert {"mmd2", "bandwidth", "text_similarity"} <= set(resp) and resp["n_prompts"] == 4
        assert {"foreign_format", "repetition", "empty_answer", "mean_len"} <= set(r["drift"]["artifacts"][name]["model"])
    assert r["drift"]["param"]["overall"] > 0
    c = r["continual"]
    assert c["stages"] == ["toy/add", "toy/sort"] and len(c["rows"]) == 2
    assert {"avg_final", "forgetting", "bwt", "fwt"} <= set(c)
    curve = r["stage_drift"]
    assert [s["stage"] for s in curve] == [1, 2] and [s["name"] for s in curve] == ["toy/add", "toy/sort"]
    assert 0 < curve[0]["param"]["overall"] and curve[1]["param"]["overall"] == pytest.approx(r["drift"]["param"]["overall"])
    sp = r["drift"]["spectral"]
    assert sp["k"] == 0 and sp["overall"]["n"] == 7  # 1 layer x (q, k, v, o, gate, up, down)
    assert set(sp["by_module"]) == {"attn_q", "attn_k", "attn_v", "attn_o", "mlp"}
    for key in ("nss_left", "nss_right"):
        assert 0 < sp["overall"][key] < 1  # trained: the top-k subspaces moved, but not to orthogonal
    assert 0 < sp["overall"]["max_angle_left"] <= 90 and sp["overall"]["sv_change"] > 0
    last, final = curve[1]["spectral"]["overall"], sp["overall"]  # the last snapshot is the final model
    assert last.keys() == final.keys() and last["k"] == final["k"]  # k: the list of ranks used (exact)
    assert {key: v for key, v in last.items() if key != "k"} == pytest.approx({key: v for key, v in final.items() if key != "k"})
    assert curve[0]["spectral"]["overall"]["n"] == 7
    with open(os.path.join(run, "eval.md")) as f:
        md = f.read()
    for heading in ("## Accuracy", "## Continual", "## Parameter drift", "## Spectral drift", "## Response drift",
                    "## Format artifacts", "## Drift per stage snapshot"):
        assert heading in md
    # two base scores (eval.py's sample and train.py's iteration-0 eval): each table says which it shows
    assert "Both scored by this eval" in md and "the base row is its iteration-0 eval" in md
    assert "## Accuracy" in proc.stdout  # the table is printed too
    # the plots of a real report: the accuracy matrix and the drift curves over both stages, no temp file left
    assert r["plots"] == [os.path.join(run, "eval_matrix.png"), os.path.join(run, "eval_drift.png")]
    for path in r["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]
    # the miniature's reader takes its drift figures from this eval.json (it once looked for spectral drift
    # under the wrong key, so the row was always empty)
    from tests.experiments import miniature
    m = miniature.run_metrics(run)
    assert m["param_drift"] == pytest.approx(r["drift"]["param"]["overall"])
    assert m["spectral_nss"] == pytest.approx((final["nss_left"] + final["nss_right"]) / 2)
    assert m["spectral_angle"] == pytest.approx((final["max_angle_left"] + final["max_angle_right"]) / 2)
    assert m["response_mmd2"] is not None and m["foreign_format"] is not None


def test_plots_without_matplotlib_say_how_to_get_it(tmp_path, monkeypatch):
    report = {"continual": {**MATRIX, **ev.continual_metrics(MATRIX)}, "stage_drift": [], "drift": {}}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(train.UserError, match="pip install matplotlib"):
        ev.write_plots(report, str(tmp_path / "eval"))
    assert not os.listdir(tmp_path)
