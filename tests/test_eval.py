"""Eval (eval.py and sample.py): accuracy (mean@n, pass@k), parameter, spectral and response drift,
format artifacts, the report and its user errors; sample.py at temperature 0."""
import json
import math
import os
import re
import shutil

import pytest
import torch

import eval as ev
import train
from configurator import configure
from data import checkers


def test_pass_at_k_sanity():
    scores = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]]
    s = train.accuracy_summary(scores, [1, 2, 4, 8])
    assert s["mean@4"] == pytest.approx(7 / 16)
    assert s["pass@1"] == pytest.approx(s["mean@4"])  # k = 1 is the mean accuracy
    assert s["pass@4"] == pytest.approx(3 / 4)  # k = n: any correct
    assert s["pass@2"] == pytest.approx(((1 - 1 / 6) + 0 + 1 + 0.5) / 4)  # 1 - C(n-c,2)/C(n,2)
    assert "pass@8" not in s  # k > n is dropped
    for n in range(1, 9):
        for c in range(n + 1):
            assert train.metrics.pass_at_k(n, c, 1) == pytest.approx(c / n)
            assert train.metrics.pass_at_k(n, c, n) == (1.0 if c else 0.0)
            assert all(train.metrics.pass_at_k(n, c, k) <= train.metrics.pass_at_k(n, c, k + 1) + 1e-12 for k in range(1, n))
    assert ev.parse_ks("16,1,4", 4) == [1, 4] and ev.parse_ks("16", 2) == [2]
    # success_threshold 0 (every response a peer, in training): a sample that earned nothing is still not solved
    s = train.accuracy_summary([[0, 0], [0, 1], [0, 0.5], [0, 0]], [1, 2], threshold=0.0)
    assert s["pass@1"] == pytest.approx(2 / 8) and s["pass@2"] == pytest.approx(2 / 4)
    assert train.accuracy_summary([[0, 0.5]], [2], threshold=0.6)["pass@2"] == 0.0
    with pytest.raises(train.UserError):
        ev.parse_ks("1,x", 4)


def test_parse_eval_sets_expands_presets():
    presets = {"math": ["math500", "aime"], "tool": ["tooluse"]}
    assert ev.parse_eval_sets("math,toy/add,aime", presets) == ["math500", "aime", "toy/add"]
    assert ev.parse_eval_sets("", presets) == []
    from data.common import EVAL_PRESETS
    assert ev.parse_eval_sets("paper", EVAL_PRESETS) == EVAL_PRESETS["paper"]


def brute_mmd2(x, y, sigma):
    k = lambda a, b: math.exp(-float(((a - b) ** 2).sum()) / (2 * sigma ** 2))  # noqa: E731
    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    if m == n:  # Gretton et al. 2012, eq. 3: paired rows, i != j in the cross term too
        xy = sum(k(x[i], y[j]) for i in range(m) for j in range(n) if i != j) / (m * (m - 1))
    else:
        xy = sum(k(x[i], y[j]) for i in range(m) for j in range(n)) / (m * n)
    return xx + yy - 2 * xy


def test_mmd_is_near_zero_for_same_samples_and_positive_for_shifted_ones():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.randn(64, 8, generator=g)
    assert ev.mmd_rbf(x, x) == pytest.approx(0.0, abs=1e-12)  # identical samples: exactly 0
    same = ev.mmd_rbf(x, y)  # another sample of the same distribution: ~0
    assert abs(same) < 0.03
    shifted = ev.mmd_rbf(x, y + 1.5)
    assert shifted > 0.2 and shifted > 10 * abs(same)
    sigma = ev.median_heuristic(torch.cat([x, y]))
    assert ev.mmd_rbf(x, y + 3.0, sigma) > ev.mmd_rbf(x, y + 1.5, sigma) > 0.2  # further apart, larger (one kernel)
    # paired, dependent samples (y_i = x_i + small noise): still ~0, not pulled below 0 by the pairs
    near = x + 0.05 * torch.randn(64, 8, generator=g)
    assert abs(ev.mmd_rbf(x, near)) < 0.01
    x, y = x.double(), y.double()
    for a, b in ((x[:6], y[:5] + 1), (x[:5], y[:5] + 1)):
        assert ev.mmd_rbf(a, b, sigma) == pytest.approx(brute_mmd2(a, b, sigma), rel=1e-9)
    with pytest.raises(ValueError):
        ev.mmd_rbf(x[:1], y)


def test_median_heuristic():
    assert ev.median_heuristic(torch.tensor([[0.0], [1.0], [3.0]])) == pytest.approx(2.0)  # distances 1, 3, 2
    assert ev.median_heuristic(torch.tensor([[0.0, 0.0], [3.0, 4.0]])) == pytest.approx(5.0)
    assert ev.median_heuristic(torch.zeros(4, 3)) is None  # all points coincide
    assert ev.median_heuristic(torch.zeros(1, 3)) is None
    assert ev.mmd_rbf(torch.zeros(3, 2), torch.zeros(3, 2)) == pytest.approx(0.0)  # sigma falls back to 1


def test_text_similarity():
    assert ev.text_similarity(["abc", "xyz"], ["abc", "xyz"]) == 1.0
    assert ev.text_similarity(["abcd"], ["wxyz"]) == 0.0
    assert ev.text_similarity(["abcd"], ["abce"]) == pytest.approx(0.75)
    assert ev.text_similarity([], []) is None


def test_embed_responses_on_a_tiny_model(toy_data):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    msgs = [[{"role": "user", "content": q}] for q in ("12+30", "sort cab", "12+30")]
    e = ev.embed_responses(model, tok, msgs, ["\\boxed{42}", "<answer>abc</answer>", "\\boxed{42}"],
                           torch.device("cpu"), batch=2)
    assert e.shape == (3, 32) and e.dtype == torch.float32
    assert torch.allclose(e[0], e[2], atol=1e-5)  # same prompt and text, across batches: same embedding
    assert not torch.allclose(e[0], e[1])
    empty = ev.embed_responses(model, tok, msgs[:1], [""], torch.device("cpu"))  # EOS only: still defined
    assert torch.isfinite(empty).all()


def tiny_model(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))


def test_param_drift_unchanged_is_zero_and_perturbed_matches_hand_computation():
    model = tiny_model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    d = ev.param_drift(model.state_dict(), model.state_dict())
    assert d["overall"] == 0 and set(d["by_layer"]) == {"0", "1"}
    assert all(v == 0 for v in list(d["by_layer"].values()) + list(d["by_module"].values()))
    assert set(d["by_module"]) == {"attn_q", "attn_k", "attn_v", "attn_o", "mlp", "norm", "embed"}

    # perturb layer 1's q_proj weight and compare with a norm computed by hand
    params = dict(model.named_parameters())  # tied embedding / LM head listed once
    w = params["model.layers.1.self_attn.q_proj.weight"]
    delta = 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        w += delta

    def norm(names):
        return math.sqrt(sum(float(base[n].double().pow(2).sum()) for n in names))

    d = ev.param_drift(model.state_dict(), base)
    dn = float(delta.double().norm())
    assert d["overall"] == pytest.approx(dn / norm(params))  # tied LM head not double-counted
    assert d["by_module"]["attn_q"] == pytest.approx(dn / norm([n for n in params if "q_proj" in n]))
    assert d["by_layer"]["1"] == pytest.approx(dn / norm([n for n in params if ".layers.1." in n]))
    assert d["by_layer"]["0"] == 0 and d["by_module"]["mlp"] == 0 and d["by_module"]["embed"] == 0


def test_param_drift_on_plain_state_dicts_and_mismatch():
    d = ev.param_drift({"model.layers.3.mlp.up_proj.weight": torch.tensor([3.0, 5.0])},
                       {"model.layers.3.mlp.up_proj.weight": torch.tensor([3.0, 4.0])})
    assert d["overall"] == pytest.approx(0.2) and d["by_layer"] == {"3": pytest.approx(0.2)}
    assert d["by_module"] == {"mlp": pytest.approx(0.2)}
    with pytest.raises(train.UserError, match="same architecture"):
        ev.param_drift({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(train.UserError, match="same architecture"):
        ev.param_drift({"a": torch.zeros(3)}, {"a": torch.zeros(2)})


def test_module_type():
    assert ev.module_type("model.layers.0.self_attn.k_proj.bias") == "attn_k"
    assert ev.module_type("model.layers.0.self_attn.o_proj.weight") == "attn_o"
    assert ev.module_type("model.layers.0.self_attn.q_norm.weight") == "norm"  # Qwen3
    assert ev.module_type("model.layers.0.mlp.down_proj.weight") == "mlp"
    assert ev.module_type("model.norm.weight") == "norm"
    assert ev.module_type("lm_head.weight") == "embed"
    assert ev.module_type("model.embed_tokens.weight") == "embed"


def random_orthogonal(n, generator):
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed


def test_spectral_drift_identical_states_and_which_matrices_count():
    model = tiny_model()
    d = ev.spectral_drift(model.state_dict(), model.state_dict())
    # 2 layers x (q, k, v, o, gate, up, down); the tied embedding / LM head and the norms are skipped
    assert d["overall"]["n"] == 14 and d["k"] == 0
    assert set(d["by_module"]) == {"attn_q", "attn_k", "attn_v", "attn_o", "mlp"}
    assert d["by_module"]["mlp"]["n"] == 6 and d["overall"]["k"] == [4]  # auto: min(32, 64) // 8
    for g in [d["overall"], *d["by_module"].values()]:
        assert g["nss_left"] == pytest.approx(1.0, abs=1e-9) and g["nss_right"] == pytest.approx(1.0, abs=1e-9)
        assert g["max_angle_left"] < 1e-6 and g["max_angle_right"] < 1e-6
        assert g["sv_change"] == 0
    norm_only = {"model.norm.weight": torch.ones(4)}
    assert ev.spectral_drift(norm_only, norm_only)["overall"] is None  # 1-D tensors only: nothing measured


def test_spectral_drift_known_principal_angle():
    # W0 = diag(5, 4, 3, 2, 1, 0.5) (singular vectors: the unit vectors); W = R W0 with R a rotation
    # by φ in the (e1, e3) plane: the top-2 left subspace turns from span(e1, e2) to
    # span(cos φ e1 + sin φ e3, e2), principal angles {0, φ}; W's right singular vectors and its
    # singular values are those of W0 (WᵀW = W0ᵀW0)
    phi = math.radians(20)
    w0 = torch.diag(torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5], dtype=torch.float64))
    rot = torch.eye(6, dtype=torch.float64)
    rot[0, 0] = rot[2, 2] = math.cos(phi)
    rot[2, 0], rot[0, 2] = math.sin(phi), -math.sin(phi)
    name = "model.layers.0.mlp.up_proj.weight"
    d = ev.spectral_drift({name: rot @ w0}, {name: w0}, k=2)
    o = d["overall"]
    assert o["n"] == 1 and o["k"] == [2]
    assert o["max_angle_left"] == pytest.approx(20.0, abs=1e-9)
    assert o["nss_left"] == pytest.approx((1 + math.cos(phi) ** 2) / 2, abs=1e-12)
    assert o["nss_right"] == pytest.approx(1.0, abs=1e-12) and o["max_angle_right"] == pytest.approx(0.0, abs=1e-6)
    assert o["sv_change"] == pytest.approx(0.0, abs=1e-12)
    # the right side: W = W0 Rᵀ turns the right subspace instead
    d = ev.spectral_drift({name: w0 @ rot.T}, {name: w0}, k=2)["overall"]
    assert d["max_angle_right"] == pytest.approx(20.0, abs=1e-9) and d["nss_left"] == pytest.approx(1.0, abs=1e-12)
    # a wide matrix (m < n) goes through the other branch of top_singular: same answer
    wide = torch.cat([w0, torch.zeros(6, 3, dtype=torch.float64)], dim=1)
    d = ev.spectral_drift({name: rot @ wide}, {name: wide}, k=2)["overall"]
    assert d["max_angle_left"] == pytest.approx(20.0, abs=1e-9) and d["nss_right"] == pytest.approx(1.0, abs=1e-12)


def test_spectral_drift_rescaling_keeps_directions_but_doubles_the_spectrum():
    g = torch.Generator().manual_seed(0)
    state0 = {f"model.layers.{i}.self_attn.q_proj.weight": torch.randn(24, 16, generator=g) for i in range(3)}
    state = {n: 2 * w for n, w in state0.items()}
    assert ev.param_drift(state, state0)["overall"] == pytest.approx(1.0)  # ‖2W0 − W0‖ / ‖W0‖
    o = ev.spectral_drift(state, state0, k=4)["overall"]
    assert o["nss_left"] == pytest.approx(1.0, abs=1e-9) and o["nss_right"] == pytest.approx(1.0, abs=1e-9)
    assert o["max_angle_left"] < 1e-4 and o["max_angle_right"] < 1e-4
    assert o["sv_change"] == pytest.approx(1.0, abs=1e-9)  # every top-k singular value doubled: +100 %


def test_spectral_drift_reuses_the_bases_decompositions_without_changing_a_number():
    g = torch.Generator().manual_seed(1)
    state0 = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(24, 16, generator=g) for i in range(2)}
    models = [{n: w + 0.1 * torch.randn(w.shape, generator=g) for n, w in state0.items()} for _ in range(2)]
    cache = {}
    cached = [ev.spectral_drift(m, state0, k=4, base_cache=cache) for m in models]
    assert sorted(cache) == [(n, 4) for n in sorted(state0)]  # one decomposition per base matrix
    assert cached == [ev.spectral_drift(m, state0, k=4) for m in models]


def test_spectral_drift_random_replacement_is_near_k_over_n():
    # W = Q diag(σ0) Pᵀ with fresh Haar-random Q, P: same spectrum, top-k subspaces uniformly random,
    # so E ‖U0ᵀU‖_F² / k = k / n
    g = torch.Generator().manual_seed(0)
    n, k, count = 64, 8, 24
    state0, state = {}, {}
    for i in range(count):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        state0[name] = torch.randn(n, n, dtype=torch.float64, generator=g)
        s0 = torch.linalg.svdvals(state0[name])
        state[name] = random_orthogonal(n, g) @ torch.diag(s0) @ random_orthogonal(n, g).T
    o = ev.spectral_drift(state, state0, k=k)["overall"]
    assert o["n"] == count
    assert o["nss_left"] == pytest.approx(k / n, abs=0.03) and o["nss_right"] == pytest.approx(k / n, abs=0.03)
    assert o["max_angle_left"] > 70 and o["max_angle_right"] > 70  # nearly orthogonal somewhere
    assert o["sv_change"] == pytest.approx(0.0, abs=1e-9)


def test_spectral_drift_counts_tied_tensors_once_and_rejects_mismatches():
    g = torch.Generator().manual_seed(0)
    w0, w = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    # two names, one tensor (in both models): one matrix
    tied0 = {"model.layers.0.mlp.up_proj.weight": w0, "model.layers.0.mlp.gate_proj.weight": w0}
    tied = {"model.layers.0.mlp.up_proj.weight": w, "model.layers.0.mlp.gate_proj.weight": w}
    d = ev.spectral_drift(tied, tied0, k=2)
    assert d["overall"]["n"] == 1 and d["by_module"]["mlp"]["n"] == 1
    untied = ev.spectral_drift({"model.layers.0.mlp.up_proj.weight": w}, {"model.layers.0.mlp.up_proj.weight": w0}, k=2)
    assert d["overall"] == untied["overall"]
    # an all-zero base matrix has no principal directions: skipped
    assert ev.spectral_drift({"model.layers.0.mlp.up_proj.weight": w},
                             {"model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8)})["overall"] is None
    for a, b in (({"a": torch.zeros(2, 2)}, {"b": torch.zeros(2, 2)}),
                 ({"a": torch.zeros(3, 2)}, {"a": torch.zeros(2, 2)})):
        with pytest.raises(train.UserError, match="same architecture") as spectral:
            ev.spectral_drift(a, b)
        with pytest.raises(train.UserError, match="same architecture") as param:
            ev.param_drift(a, b)
        assert str(spectral.value) == str(param.value) and "\n" not in str(spectral.value)


def test_spectral_k_for():
    assert ev.spectral_k_for((128, 512), 0) == 16
    assert ev.spectral_k_for((9728, 2560), 0) == 64  # capped
    assert ev.spectral_k_for((4, 6), 0) == 1
    assert ev.spectral_k_for((128, 512), 200) == 128 and ev.spectral_k_for((128, 512), 5) == 5


def test_spectral_gaps_finds_a_matrix_whose_kth_and_next_singular_values_are_equal():
    """tests/experiments/spectral_gaps.py: σ_k / σ_k+1 at the k spectral_drift uses (16 for 128 columns)."""
    from tests.experiments import spectral_gaps
    q1, q2 = (torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(s), dtype=torch.float64))[0] for s in (0, 1))
    spectrum = torch.linspace(10, 1, 128, dtype=torch.float64)
    flat = spectrum.clone()
    flat[16] = flat[15]  # σ_17 = σ_16: no gap at the cut
    state = {"model.layers.0.mlp.up_proj.weight": q1 @ torch.diag(spectrum) @ q2.T,
             "model.layers.0.mlp.down_proj.weight": q1 @ torch.diag(flat) @ q2.T,
             "model.embed_tokens.weight": torch.randn(300, 128), "model.norm.weight": torch.ones(128)}
    g = spectral_gaps.gaps(state)
    assert set(g) == {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"}  # no embedding, no 1-D
    assert g["model.layers.0.mlp.down_proj.weight"] == pytest.approx(1.0, abs=1e-9)
    assert g["model.layers.0.mlp.up_proj.weight"] == pytest.approx(float(spectrum[15] / spectrum[16]), rel=1e-6)


def test_foreign_formats():
    assert ev.foreign_formats("so <answer>abc</answer>", "exact") == []
    assert ev.foreign_formats("\\boxed{abc}", "exact") == ["boxed"]
    assert ev.foreign_formats("\\boxed{B}", "mcq") == ["boxed"]
    assert ev.foreign_formats("\\boxed{12}", "math") == []
    assert ev.foreign_formats("<answer>12</answer>", "math") == ["answer_tag"]
    assert ev.foreign_formats("Action: search\nAction Input: {}\n\\boxed{1}", "math") == ["tool_call"]
    assert ev.foreign_formats("Action: search\nAction Input: {}", "tool") == []
    assert ev.foreign_formats("<answer>x</answer> \\boxed{1}", "tool") == ["boxed", "answer_tag"]
    assert ev.foreign_formats("\\boxed{1}", "unknown-kind") == []
    assert ev.foreign_formats("```python\nprint(1)\n```", "code") == []
    assert ev.foreign_formats("```python\nprint(1)\n```\n\\boxed{1}", "code") == ["boxed"]
    assert ev.foreign_formats("```py\nx = 1\n```\n\\boxed{1}", "math") == ["python_block"]
    assert ev.foreign_formats("```\n3 + 4 = 7\n```\n\\boxed{7}", "math") == []  # an untagged block is not a program


def test_an_expression_task_s_answer_is_its_answer_tag_in_the_artifact_rates(toy_data):
    """The toy code domain (func) answers one expression in <answer></answer>, as check_code reads it: a
    response with it has an answer and a native format; a program task expects a ```python block."""
    from data import tasks as T
    func = T.load("toy/func", "test", data_dir=toy_data, kinds=tuple(checkers.CHECKS))[:2]
    assert all(checkers.code_expression(t["answer"]) == "x" for t in func)
    solved = [t["solution"] for t in func]  # '<answer>x*x+39</answer>'
    assert checkers.final_answer("code", solved[0], func[0]["answer"]) == re.search("<answer>(.*)</answer>", solved[0])[1]
    assert checkers.final_answer("code", "```python\nx*x\n```", func[0]["answer"]) == "x*x\n"  # its fallback, as check_code's
    program = json.dumps({"tests": [{"input": "1 2", "output": "3"}]})
    assert checkers.code_expression(program) is None and checkers.code_expression(None) is None
    assert checkers.final_answer("code", "<answer>x</answer>", program) is None  # a program task reads the block
    texts = [[solved[0], "\\boxed{3*x-2}"], [solved[1], "no answer"]]
    a = ev.artifacts_of(_CharTokenizer(), func, texts)
    assert a["empty_answer"] == pytest.approx(2 / 4)  # the boxed one and the blank one
    assert a["foreign_format"] == pytest.approx(1 / 4)  # \boxed is math's format
    assert a["formats"]["answer_tag"] == pytest.approx(2 / 4)


class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return list(text)


def test_repetition_loop():
    assert ev.repetition_loop("\\boxed{1}" * 4)
    assert ev.repetition_loop("1" * 16)
    assert ev.repetition_loop("so the answer is " + "the the " * 4)
    assert not ev.repetition_loop("\\boxed{1111}")  # a short natural run
    assert not ev.repetition_loop("\\boxed{1}" * 2)
    assert not ev.repetition_loop("|---|---|---|---|---|---|")  # no letter or digit in the unit
    assert not ev.repetition_loop("")
    prose = " ".join(f"word{i}" for i in range(200))
    assert not ev.repetition_loop(prose)
    sentence = "We compute the sum of the two numbers and then carry the one over. "  # > 40 characters
    assert ev.repetition_loop("First, " + sentence * 5)  # caught by the 4-gram test
    assert ev.repetition_loop("x" * 100_000)  # bounded time on long strings


def test_final_answer_and_artifact_rates():
    assert checkers.final_answer("math", "\\boxed{12}") == "12"
    assert checkers.final_answer("math", "\\boxed{}") is None
    assert checkers.final_answer("math", "12") is None
    assert checkers.final_answer("exact", "<answer>abc</answer>") == "abc"
    assert checkers.final_answer("exact", "<answer> </answer>") is None
    assert checkers.final_answer("exact", "<answer>abc") is None
    assert checkers.final_answer("mcq", "so the answer is (B)") == "B"
    assert checkers.final_answer("mcq", "\\boxed{C}") == "C"
    assert checkers.final_answer("tool", "Action: search\nAction Input: {\"q\": 1}") == "search"
    assert checkers.final_answer("tool", "") is None
    texts = ["\\boxed{12}", "<answer>12</answer>", "1" * 20, "", "<answer>abc</answer>", "\\boxed{abc}"]
    kinds = ["math"] * 4 + ["exact"] * 2
    a = ev.format_artifacts(texts, kinds, [4, 6, 20, 0, 5, 5])
    assert a["n"] == 6
    assert a["foreign_format"] == pytest.approx(2 / 6)   # <answer> in math, \boxed in exact
    assert a["repetition"] == pytest.approx(1 / 6)
    assert a["empty_answer"] == pytest.approx(4 / 6)  # math without \boxed (3), exact without <answer> (1)
    assert a["mean_len"] == pytest.approx(40 / 6)
    assert a["formats"] == pytest.approx({"boxed": 2 / 6, "answer_tag": 2 / 6, "tool_call": 0.0, "python_block": 0.0})
    assert ev.format_artifacts([], [], [])["foreign_format"] is None


def test_user_errors(tmp_path):
    cfg = {key: getattr(ev, key) for key in ("run_dir", "model", "base_model", "eval_sets", "n", "k", "temperature",
                                            "top_p", "max_new_tokens", "max_prompts", "drift_prompts", "batch_prompts",
                                            "stage_drift", "out", "seed", "device", "dtype", "data_dir",
                                            "enable_thinking", "plots", "spectral_k", "success_threshold", "math_checker",
                                            "static_rollout")}
    with pytest.raises(train.UserError, match="nothing to evaluate"):
        ev.main(dict(cfg))
    with pytest.raises(train.UserError, match="not a folder"):
        ev.main(dict(cfg, run_dir=str(tmp_path / "missing")))
    with pytest.raises(train.UserError, match="train.py out_dir"):
        ev.main(dict(cfg, run_dir=str(tmp_path)))
    with pytest.raises(train.UserError, match="MMD needs"):
        ev.main(dict(cfg, model="x", drift_prompts=1))
    with pytest.raises(train.UserError, match="spectral_k=-2"):
        ev.main(dict(cfg, model="x", spectral_k=-2))
    with pytest.raises(train.UserError, match="max_prompts=-1: give the test prompts per set, or 0 for all"):
        ev.main(dict(cfg, model="x", max_prompts=-1))
    with pytest.raises(train.UserError, match="max_new_tokens=-1 must be >= 1"):  # (decoding 0 steps raised later)
        ev.main(dict(cfg, model="x", max_new_tokens=-1))
    with pytest.raises(train.UserError, match=r"success_threshold=1.5 is not in \[0, 1\]"):
        ev.main(dict(cfg, model="x", success_threshold=1.5))
    with pytest.raises(train.UserError, match="math_checker='sympy' is not one of builtin, math_verify"):
        ev.main(dict(cfg, model="x", math_checker="sympy"))
    with pytest.raises(train.UserError, match="static_rollout='yes' is not one of auto, on, off"):
        ev.main(dict(cfg, model="x", static_rollout="yes"))


def test_eval_py_scores_as_the_run_scored_its_own_evals(toy_data, tmp_path, monkeypatch):
    """The run's success_threshold (what pass@k counts as solved: a code run's partial rewards) and
    math_checker reach eval.py's sampling and its pass@k unless given; given, they win."""
    from conftest import tiny_cfg
    run = tmp_path / "run"
    train.main(tiny_cfg(toy_data, run, success_threshold=0.5))
    seen, real = [], train.sample_and_score

    def spy(*args, **kw):
        seen.append((kw["success_threshold"], kw["math_checker"]))
        return real(*args, **kw)
    monkeypatch.setattr(train, "sample_and_score", spy)
    cfg = dict(configure(dict(vars(ev)), [], ev.__file__), run_dir=str(run), n=2, k="1,2", max_prompts=2, drift_prompts=0,
               stage_drift=False, spectral_k=-1, device="cpu", base_model="none")
    ev.main(dict(cfg))
    with open(run / "eval.json") as f:
        config = json.load(f)["config"]
    assert (config["success_threshold"], config["math_checker"]) == (0.5, "builtin") and set(seen) == {(0.5, "builtin")}
    seen.clear()
    ev.main(dict(cfg, success_threshold=1.0))
    assert set(seen) == {(1.0, "builtin")}
    seen.clear()  # a run trained at success_threshold 0 (every response a peer) is scored at its own 0, not refused
    real_read = ev.read_run

    def trained_at_zero(run_dir):
        found = real_read(run_dir)
        found["state"]["config"]["success_threshold"] = 0.0
        return found
    monkeypatch.setattr(ev, "read_run", trained_at_zero)
    ev.main(dict(cfg))
    assert set(seen) == {(0.0, "builtin")}
    statics = []  # static_rollout: 'auto' is off on a CPU; 'on' reaches the sampler (decoded here without it)
    monkeypatch.setattr(train, "sample_and_score", lambda *a, **kw: statics.append(kw["static"]) or real(*a, **dict(kw, static=False)))
    ev.main(dict(cfg))
    ev.main(dict(cfg, static_rollout="on"))
    assert statics and statics == [False] * (len(statics) // 2) + [True] * (len(statics) // 2)


def test_a_tokenizer_without_an_eos_token_takes_the_configs_or_says_so(finished_run, tmp_path, monkeypatch):
    """pad_token fell back to eos_token, None too, and the first padded batch raised a TypeError (SmolLM2's
    folder without eos_token / pad_token in its tokenizer_config.json; Qwen2's class would default them)."""
    import models
    folder = tmp_path / "no_eos"
    shutil.copytree(finished_run / "ckpt", folder)
    real = models.AutoTokenizer.from_pretrained

    def without_eos(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.eos_token = tokenizer.pad_token = None
        return tokenizer
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", without_eos)
    model, tokenizer = models.load_model(str(folder), torch.device("cpu"))
    assert tokenizer.eos_token_id == model.config.eos_token_id and tokenizer.pad_token_id is not None
    out = train.generate(model, [[1, 4, 5], [8]], group_size=1, max_new_tokens=3, temperature=1.0, top_p=1.0,
                         eos_ids=models.stop_token_ids(model, tokenizer), pad_id=tokenizer.pad_token_id,
                         generator=torch.Generator().manual_seed(0))
    assert len(out.response_ids) == 2
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "eos_token_id"}))
    with pytest.raises(models.ModelError, match="names an end-of-sequence token"):
        models.load_model(str(folder), torch.device("cpu"))


def test_sample_py_system_turn_applies_to_a_data_files_prompts(toy_data, tmp_path):
    import sample as sample_py
    with open(os.path.join(toy_data, "toy", "add", "test.jsonl")) as f:
        record = json.loads(f.readline())
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    tasks = sample_py.read_prompts("", str(path), "Be brief.")
    assert tasks[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m for m in tasks[0]["messages"] if m["role"] != "system"] == [m for m in record["messages"] if m["role"] != "system"]


def test_sample_py_greedy_at_temperature_zero(finished_run, capsys):
    import sample as sample_py
    from configurator import configure

    def sample(seed):
        sample_py.main(configure(dict(vars(sample_py)), [f"--init_from={finished_run / 'ckpt'}", "--temperature=0",
                                                         "--num_samples=2", "--max_new_tokens=6", f"--seed={seed}",
                                                         "--device=cpu"], sample_py.__file__))
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("-->")]
    first = sample(1)
    assert len(first) == 2 and first[0] == first[1] and sample(2) == first  # greedy: no randomness


def test_sample_py_on_a_data_file_prints_each_reward_and_their_mean(finished_run, toy_data, tmp_path, capsys):
    """A data .jsonl file's responses are scored with train.reward: each line shows its reward, and the
    last line is their mean, over every response of every prompt."""
    import sample as sample_py
    from configurator import configure
    with open(os.path.join(toy_data, "toy", "add", "test.jsonl")) as f:
        records = [f.readline() for _ in range(3)]
    prompts = tmp_path / "three.jsonl"
    prompts.write_text("".join(records))
    sample_py.main(configure(dict(vars(sample_py)), [f"--init_from={finished_run / 'ckpt'}", f"--prompt_file={prompts}",
                                                     "--num_samples=4", "--max_new_tokens=8", "--temperature=1.0",
                                                     "--device=cpu"], sample_py.__file__))
    out = capsys.readouterr().out
    lines = out.splitlines()
    shown = [float(r) for r in re.findall(r"  \[reward ([0-9.e+-]+)\]\n", out)]  # a response may span lines
    assert sum(line.startswith("--> ") for line in lines) == len(shown) == 12
    mean = re.fullmatch(r"mean reward ([0-9.]+) over 12 responses to 3 prompts", lines[-1])
    assert mean and float(mean.group(1)) == pytest.approx(sum(shown) / 12, abs=5e-4), lines[-1]


def test_eval_py_refuses_before_sampling_a_base_of_another_architecture_or_an_out_it_cannot_write(
        finished_run, toy_data, tmp_path, monkeypatch):
    """Both were refused only at the end, after every set had been sampled (hours at scale): a base whose
    parameters differ from the model's (parameter drift pairs them), an --out under a file."""
    from conftest import tiny_cfg
    other = tmp_path / "other"
    train.main(tiny_cfg(toy_data, other, n_layer=2))
    sampled = []
    monkeypatch.setattr(train, "sample_and_score", lambda *a, **k: sampled.append(1))
    cfg = dict(configure(dict(vars(ev)), [], ev.__file__), run_dir=str(finished_run), n=2, k="1,2", max_prompts=2,
               drift_prompts=0, stage_drift=False, spectral_k=-1, device="cpu")
    with pytest.raises(train.UserError, match=r"base model .*different parameters.*--base_model=none"):
        ev.main(dict(cfg, base_model=str(other / "ckpt"), out=str(tmp_path / "a.json")))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(train.UserError, match="afile is not a folder"):
        ev.main(dict(cfg, base_model="none", out=str(tmp_path / "afile" / "eval.json")))
    (tmp_path / "b.json.tmp").mkdir()
    with pytest.raises(train.UserError, match="b.json.tmp .* is not a file"):
        ev.main(dict(cfg, base_model="none", out=str(tmp_path / "b.json")))
    (tmp_path / "c_drift.png.tmp").mkdir()  # where a plot is written first
    with pytest.raises(train.UserError, match="c_drift.png.tmp .* is not a file"):
        ev.main(dict(cfg, base_model="none", out=str(tmp_path / "c.json")))
    assert not sampled and not (tmp_path / "a.json").exists()


def test_eval_py_skips_a_half_written_snapshot_and_finds_a_relative_base_from_another_folder(
        finished_run, tmp_path, monkeypatch):
    """save_snapshot writes stageN_x.tmp and renames it: a run stopped between leaves one, which is no
    stage. A run's base_init is as train.py was given it (relative to the repository, usually):
    eval.py run from elsewhere still finds it."""
    from conftest import ROOT, copy_of
    run = copy_of(finished_run, tmp_path)
    shutil.copytree(run / "ckpt", run / "stage1_toy_add.tmp")
    assert all(not path.endswith(".tmp") for _, _, path in ev.read_run(str(run))["snapshots"])
    real_read, real_load, loaded = ev.read_run, ev.load, []

    def relative_base(path):
        found = real_read(path)
        found["state"]["base_init"] = os.path.relpath(str(finished_run / "ckpt"), ROOT)
        return found
    monkeypatch.setattr(ev, "read_run", relative_base)

    def load(path, run_cfg, dev):  # the model, then the base: stop there
        loaded.append(path)
        if len(loaded) == 2:
            raise train.UserError("enough")
        return real_load(path, run_cfg, dev)
    monkeypatch.setattr(ev, "load", load)
    monkeypatch.chdir(tmp_path)
    cfg = dict(configure(dict(vars(ev)), [], ev.__file__), run_dir=str(run), n=2, k="1,2", max_prompts=2,
               drift_prompts=0, stage_drift=False, spectral_k=-1, device="cpu", data_dir=os.path.join(ROOT, "data"))
    with pytest.raises(train.UserError, match="enough"):
        ev.main(cfg)
    assert len(loaded) == 2 and os.path.samefile(loaded[1], finished_run / "ckpt")


def test_eval_py_refuses_a_run_s_base_whose_weights_changed_since_the_run_began(finished_run, toy_data, tmp_path,
                                                                                monkeypatch):
    """The base row and every drift are measured against base_init as it is now: a folder trained further or
    replaced since (a hub revision moved) would be compared silently. The run saved its fingerprint."""
    from safetensors.torch import load_file, save_file
    from conftest import tiny_cfg
    base = tmp_path / "base"
    shutil.copytree(finished_run / "ckpt", base)
    run = tmp_path / "run"
    train.main(tiny_cfg(toy_data, run, init_from=str(base), max_iters=1))
    class Sampled(Exception):
        pass

    def sample(*args, **kwargs):
        raise Sampled
    monkeypatch.setattr(train, "sample_and_score", sample)
    cfg = dict(configure(dict(vars(ev)), [], ev.__file__), run_dir=str(run), n=2, k="1,2", max_prompts=2,
               drift_prompts=0, stage_drift=False, spectral_k=-1, device="cpu", out=str(tmp_path / "e.json"))
    with pytest.raises(Sampled):  # unchanged: accepted (a scratch-built base too: the two-stage test's)
        ev.main(cfg)
    weights = load_file(base / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 0.5
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(train.UserError, match="the run's base_init, holds other weights than when the run began"):
        ev.main(cfg)
    assert not (tmp_path / "e.json").exists()
    with pytest.raises(Sampled):  # named explicitly, it is the user's choice
        ev.main(dict(cfg, base_model=str(base)))


def test_eval_py_on_a_model_alone_scores_it_without_a_base(finished_run, toy_data, tmp_path, monkeypatch):
    """--model without --run_dir: no run, so no base_init; the default base is none (it once resolved ''
    to the repository folder and refused it as a model)."""
    loaded = []
    real_load = ev.load
    monkeypatch.setattr(ev, "load", lambda path, *a: loaded.append(path) or real_load(path, *a))
    cfg = dict(configure(dict(vars(ev)), [], ev.__file__), model=str(finished_run / "ckpt"), eval_sets="toy/add", n=2,
               k="1,2", max_prompts=2, max_new_tokens=8, drift_prompts=0, stage_drift=False, spectral_k=-1, device="cpu",
               out=str(tmp_path / "e.json"))
    ev.main(cfg)
    with open(tmp_path / "e.json") as f:
        report = json.load(f)
    assert loaded == [str(finished_run / "ckpt")] and report["base_model"] is None
    assert report["accuracy"]["toy/add"]["base"] is None and report["accuracy"]["toy/add"]["n_prompts"] == 2


def test_an_accuracy_matrix_without_eval_sets_is_refused_in_one_line():
    with pytest.raises(train.UserError, match="well-formed accuracy matrix"):
        ev.check_matrix({"eval_sets": [], "stages": ["toy/add"], "rows": [[]], "base": {}}, "m.json")


def test_sample_py_reads_the_complete_copy_a_crash_left(finished_run, tmp_path, capsys):
    """A crash during a checkpoint swap can leave only ckpt.old: sample.py reads it, as eval.py does."""
    import sample as sample_py
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    os.rename(run / "ckpt", run / "ckpt.old")
    sample_py.main(configure(dict(vars(sample_py)), [f"--init_from={run / 'ckpt'}", "--temperature=0", "--num_samples=1",
                                                     "--max_new_tokens=4", "--device=cpu"], sample_py.__file__))
    assert any(line.startswith("-->") for line in capsys.readouterr().out.splitlines())
