"""The statistics of tests/experiments/miniature.py (pure functions; no training runs)."""
import json
import math

import pytest

from tests.experiments import miniature as mini  # conftest.py puts the repo root on sys.path


def test_mean_se_matches_the_textbook_formula():
    m, se = mini.mean_se([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and math.isclose(se, math.sqrt(5 / 3) / 2)
    assert math.isnan(mini.mean_se([1.0])[1]) and math.isnan(mini.mean_se([])[0])
    assert mini.mean_se([1.0, None, 3.0])[0] == 2.0  # missing values are dropped


def test_bootstrap_ci_is_reproducible_brackets_the_mean_and_shrinks_with_n():
    xs = [0.1, 0.4, 0.35, 0.2, 0.3, 0.25, 0.15, 0.5]
    lo, hi = mini.bootstrap_ci(xs)
    assert (lo, hi) == mini.bootstrap_ci(xs) and lo < sum(xs) / len(xs) < hi
    assert mini.bootstrap_ci([0.3] * 5) == (0.3, 0.3)
    lo4, hi4 = mini.bootstrap_ci(xs * 4)
    assert hi4 - lo4 < hi - lo
    # a normal-theory check: for many samples the interval is about mean ± 1.96 SE
    big = [((i * 7919) % 1000) / 1000 for i in range(400)]
    lo, hi = mini.bootstrap_ci(big)
    m, se = mini.mean_se(big)
    assert math.isclose(hi - lo, 2 * 1.96 * se, rel_tol=0.1)


def test_t_quantile_matches_tables():
    for df, q in ((1, 12.706), (2, 4.303), (3, 3.182), (7, 2.365), (8, 2.306), (15, 2.131), (30, 2.042)):
        assert abs(mini.t_quantile(0.975, df) - q) < 0.001, df


def test_t_ci_is_mean_plus_minus_t_with_n_minus_1_degrees_of_freedom():
    lo, hi = mini.t_ci([1.0, 2.0, 3.0, 4.0])  # mean 2.5, SE sqrt(5/3)/2, t(0.975, df=3) = 3.182446
    h = 3.182446305284263 * math.sqrt(5 / 3) / 2
    assert math.isclose(lo, 2.5 - h, rel_tol=1e-9) and math.isclose(hi, 2.5 + h, rel_tol=1e-9)
    assert all(math.isnan(v) for v in mini.t_ci([1.0]))


def test_wilson_interval_known_values():
    lo, hi = mini.wilson(0, 8)
    assert lo == 0.0 and math.isclose(hi, 0.3244, abs_tol=1e-3)
    lo, hi = mini.wilson(4, 8)
    assert math.isclose(lo, 0.2152, abs_tol=1e-3) and math.isclose(hi, 0.7848, abs_tol=1e-3)
    lo, hi = mini.wilson(8, 8)
    assert hi == 1.0 and math.isclose(lo, 0.6756, abs_tol=1e-3)


def test_paired_diff_uses_pairs_and_verdict_needs_both_intervals():
    a = [0.30, 0.42, 0.25, 0.38, 0.33, 0.29, 0.41, 0.36]
    b = [x - 0.05 + 0.01 * (i % 3 - 1) for i, x in enumerate(a)]  # a consistently 0.04-0.06 higher
    d = mini.paired_diff(a, b)
    assert d["n"] == 8 and math.isclose(d["mean"], 0.05, abs_tol=0.005) and d["ci"][0] > 0 and d["t_ci"][0] > 0
    assert mini.verdict(d, "sdpo", "grpo") == "sdpo > grpo"
    assert mini.verdict(mini.paired_diff(b, a), "sdpo", "grpo") == "sdpo < grpo"
    # the same means unpaired would not separate (seed spread 0.06 >> 0.05), but pairing removes it
    noisy = mini.paired_diff([0.1, 0.5, 0.2, 0.6], [0.5, 0.1, 0.6, 0.2])
    assert mini.verdict(noisy, "x", "y") == "no difference resolved"
    # one interval excluding 0 is not enough
    assert mini.verdict({"ci": (0.01, 0.1), "t_ci": (-0.02, 0.13)}, "x", "y") == "no difference resolved"
    assert mini.verdict({"ci": (-0.1, -0.01), "t_ci": (-0.13, 0.02)}, "x", "y") == "no difference resolved"
    # pairs with a missing side are dropped
    assert mini.paired_diff([1.0, None, 3.0], [0.0, 1.0, None])["n"] == 1
    # equal scores summed in another order (float noise in the last bits) are no difference; equal real ones are
    assert mini.verdict(mini.paired_diff([0.1 + 0.2] * 8, [0.3] * 8), "x", "y") == "no difference resolved"
    assert mini.verdict(mini.paired_diff([0.31] * 8, [0.3] * 8), "x", "y") == "x > y"


def test_mcnemar_exact():
    assert mini.mcnemar_exact([1] * 6 + [0] * 2, [0] * 8) == 2 / 2 ** 6
    assert mini.mcnemar_exact([1, 0, 1, 0], [1, 0, 1, 0]) == 1.0
    assert math.isclose(mini.mcnemar_exact([1, 1, 0], [0, 0, 1]), 1.0)


def test_summarize_binary_gets_a_wilson_rate_and_report_has_a_verdict_column():
    s = mini.summarize([1.0, 0.0, 0.0, 1.0], binary=True)
    assert s["k"] == 2 and s["n"] == 4 and "wilson" in s
    assert "wilson" not in mini.summarize([0.0, 0.0, 1.0])  # a rate that happens to be 0 or 1 is not a count
    seeds = [1, 2, 3, 4, 5, 6]
    per_run = {}
    for s_ in seeds:
        per_run[("grpo", s_)] = {"avg_final": 0.30 + 0.01 * s_, "collapse": 0.0}
        per_run[("sdpo", s_)] = {"avg_final": 0.20 + 0.01 * s_ + 0.002 * (s_ % 2), "collapse": float(s_ < 3)}
    lines, out = mini.report(["grpo", "sdpo"], seeds, per_run)
    text = "\n".join(lines)
    assert "sdpo < grpo" in text and "2/6" in text and "McNemar" in text
    # 2 collapses vs 0 in 6 pairs: McNemar p = 0.5, so no verdict on collapse
    assert next(c for c in out["comparisons"] if c["metric"] == "collapse")["verdict"] == "no difference resolved"
    assert {c["metric"] for c in out["comparisons"]} == {"avg_final", "collapse"}


def test_parse_seeds():
    assert mini.parse_seeds("1-4,9") == [1, 2, 3, 4, 9] and mini.parse_seeds("7") == [7]


def test_contrasts_difference_of_differences():
    seeds = list(range(1, 9))
    per_run = {}
    for s in seeds:
        for a in mini.EXPERIMENTS["distance"]:
            per_run[(a, s)] = {"forgetting": 0.05 + 0.001 * s + (0.1 if a == "sdpo_mid" else 0.0) + 0.003 * (s % 3)}
    lines, out = mini.contrasts("distance", seeds, per_run)
    by = {c["contrast"]: c for c in out}
    c = by["(sdpo_mid − grpo_mid) − (sdpo_near − grpo_near)"]
    assert math.isclose(c["mean"], 0.1) and c["verdict"] == "> 0"
    assert by["grpo_mid − grpo_near"]["verdict"] == "no difference resolved"  # identical values: all zero


@pytest.mark.parametrize("k, verdict", [(5, "no difference resolved"), (6, "sdpo > grpo")])
def test_collapse_verdict_needs_mcnemar_below_0_05(k, verdict):
    # k of 8 pairs discordant, all one way: both intervals exclude 0 for k = 5 and 6, McNemar p = 0.0625 / 0.03125
    seeds = list(range(1, 9))
    per_run = {("grpo", s): {"collapse": 0.0} for s in seeds} | {("sdpo", s): {"collapse": float(s <= k)} for s in seeds}
    row = mini.report(["grpo", "sdpo"], seeds, per_run)[1]["comparisons"][0]
    assert row["ci"][0] > 0 and row["t_ci"][0] > 0 and row["mcnemar_p"] == 2 / 2 ** k and row["verdict"] == verdict


def test_mcnemar_uses_the_pairs_the_intervals_use():
    seeds = list(range(1, 9))  # 6 collapses one way, but grpo seed 6 has no value: 5 discordant pairs of 7
    per_run = {("grpo", s): {"collapse": None if s == 6 else 0.0} for s in seeds}
    per_run |= {("sdpo", s): {"collapse": float(s <= 6)} for s in seeds}
    row = mini.report(["grpo", "sdpo"], seeds, per_run)[1]["comparisons"][0]
    assert row["n"] == 7 and row["mcnemar_p"] == 2 / 2 ** 5 and row["verdict"] == "no difference resolved"


def _matrix_run(folder, rows):
    sets = ["toy/add", "toy/sub", "toy/mul", "toy/sort", "toy/rev"]
    matrix = {"eval_sets": sets, "stages": ["toy/add", "toy/mul", "toy/sort"][:len(rows)], "rows": rows,
              "base": dict.fromkeys(sets, 0.2)}
    (folder / "accuracy_matrix.json").write_text(json.dumps(matrix))
    return str(folder)


def test_run_metrics_forgetting_and_collapse_are_over_the_domains_trained_before_the_last_stage(tmp_path):
    rows = [[0.40, 0.20, 0.20, 0.20, 0.20],  # after add
            [0.30, 0.20, 0.45, 0.20, 0.20],  # after mul
            [0.10, 0.01, 0.30, 0.01, 0.01]]  # after sort: sub, sort, rev < 0.05, none trained before the last stage
    m = mini.run_metrics(_matrix_run(tmp_path, rows))
    assert m["first_acc"] == 0.40 and math.isclose(m["first_gain"], 0.20) and m["sort"] == 0.01
    assert math.isclose(m["forgetting"], ((0.40 - 0.10) + (0.45 - 0.30)) / 2)  # add and mul only
    assert math.isclose(m["avg_final"], 0.086) and math.isclose(m["avg_acc"], (0.10 + 0.30 + 0.01) / 3)
    assert m["collapse"] == 0.0
    rows[2][2] = 0.05  # mul at the threshold: not below it
    assert mini.run_metrics(_matrix_run(tmp_path, rows))["collapse"] == 0.0
    rows[2][2] = 0.04
    assert mini.run_metrics(_matrix_run(tmp_path, rows))["collapse"] == 1.0
    view = mini.run_metrics(_matrix_run(tmp_path, rows), n_stages=2)  # the first two stages: add forgotten, mul last
    assert math.isclose(view["forgetting"], 0.40 - 0.30) and view["collapse"] == 0.0


def test_a_mixed_first_stage_is_refused_by_the_first_stage_metrics(tmp_path):
    folder = _matrix_run(tmp_path, [[0.4, 0.2, 0.2, 0.2, 0.2]])
    matrix = json.loads((tmp_path / "accuracy_matrix.json").read_text())
    (tmp_path / "accuracy_matrix.json").write_text(json.dumps(dict(matrix, stages=["toy/add+toy/sub"])))
    with pytest.raises(ValueError, match="first stage 'toy/add\\+toy/sub' is not one of the eval sets"):
        mini.run_metrics(folder)


def test_a_view_of_a_run_with_fewer_stages_is_not_read(tmp_path):
    with pytest.raises(ValueError, match="the view needs 2"):  # a crashed run's one stage is not its first two
        mini.run_metrics(_matrix_run(tmp_path, [[0.4, 0.2, 0.2, 0.2, 0.2]]), n_stages=2)
