"""The loss (step 5): the distillation divergences against independent formulas, and the fused (chunked,
gradients-in-forward) token loss against the naive full-logits + autograd reference."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from teacher import TeacherLogits
from train import distill_divergence, fused_token_loss, naive_token_loss, sampled_logprobs


f64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def ref_buckets(student_logits, teacher_logits, distill, k, tail):
    """Student / teacher bucket probabilities P, Q [n, buckets]."""
    p = torch.exp(student_logits - student_logits.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    q = torch.exp(teacher_logits - teacher_logits.max(-1, keepdim=True).values)
    q = q / q.sum(-1, keepdim=True)
    if distill == "full":
        return p, q
    idx = torch.argsort(student_logits, dim=-1, descending=True)[:, :k]
    pk, qk = p.gather(1, idx), q.gather(1, idx)
    if tail:
        return (torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1),
                torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1))
    return pk / pk.sum(-1, keepdim=True), qk / qk.sum(-1, keepdim=True)


def ref_kl(a, b):
    """KL(a || b) = sum a log(a / b), via torch.nn.functional.kl_div."""
    return F.kl_div(b.log(), a, reduction="none").sum(-1)


def ref_divergence(P, Q, alpha):
    if alpha == 0:
        return ref_kl(Q, P)
    if alpha == 1:
        return ref_kl(P, Q)
    M = (1 - alpha) * P + alpha * Q
    return (1 - alpha) * (P * torch.log(P / M)).sum(-1) + alpha * (Q * torch.log(Q / M)).sum(-1)


def ref_chi2(a, b):
    """chi^2(a || b) = sum (a - b)^2 / b."""
    return ((a - b) ** 2 / b).sum(-1)


MODES = [("full", False), ("topk", True), ("topk", False)]


def logits_pair(n=6, V=40, scale=1.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g, dtype=f64) * scale,
            torch.randn(n, V, generator=g, dtype=f64) * scale)


@pytest.mark.parametrize("alpha", [0, 0.3, 0.5, 1])
@pytest.mark.parametrize("distill,tail", MODES)
def test_divergence_matches_reference(alpha, distill, tail):
    zs, zt = logits_pair()
    got = distill_divergence(zs, zt, alpha, distill, 7, tail)
    want = ref_divergence(*ref_buckets(zs, zt, distill, 7, tail), alpha)
    assert got.shape == (zs.shape[0],)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # fp32 / bf16 inputs are computed in fp32
    got32 = distill_divergence(zs.float(), zt.float(), alpha, distill, 7, tail)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=1e-4, atol=1e-6)
    assert distill_divergence(zs.bfloat16(), zt.bfloat16(), alpha, distill, 7, tail).dtype == torch.float32


@pytest.mark.parametrize("distill,tail", MODES)
def test_divergence_alpha_limits(distill, tail):
    # JSD_a / a -> KL(q||p) as a -> 0 and JSD_{1-a} / a -> KL(p||q). A Taylor
    # expansion in a gives the leading error terms -(a/2) chi2(q||p) and
    # -(a/2) chi2(p||q) (valid while a * max ratio << 1, asserted below), so
    # a * chi2 bounds the error with a factor 2 to spare.
    zs, zt = logits_pair(scale=1.0)
    P, Q = ref_buckets(zs, zt, distill, 7, tail)
    a = 1e-4
    assert a * max((P / Q).max(), (Q / P).max()) < 1e-2
    fwd, rev = ref_kl(Q, P), ref_kl(P, Q)
    jsd_lo = distill_divergence(zs, zt, a, distill, 7, tail) / a
    jsd_hi = distill_divergence(zs, zt, 1 - a, distill, 7, tail) / a
    assert ((jsd_lo - fwd).abs() <= a * ref_chi2(Q, P) + 1e-10).all()
    assert ((jsd_hi - rev).abs() <= a * ref_chi2(P, Q) + 1e-10).all()
    # and the endpoints are the KLs themselves
    torch.testing.assert_close(distill_divergence(zs, zt, 0, distill, 7, tail), fwd, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(distill_divergence(zs, zt, 1, distill, 7, tail), rev, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("alpha", [0, 0.3, 0.5, 1])
@pytest.mark.parametrize("distill,tail", MODES)
def test_divergence_zero_for_identical_and_nonnegative(alpha, distill, tail):
    zs, zt = logits_pair(n=32, scale=3.0)
    same = distill_divergence(zs, zs.clone(), alpha, distill, 7, tail)
    torch.testing.assert_close(same, torch.zeros_like(same), rtol=0, atol=1e-12)
    assert (distill_divergence(zs, zt, alpha, distill, 7, tail) >= 0).all()
    # a shifted copy of the logits is the same distribution
    shifted = distill_divergence(zs, zs + 5.0, alpha, distill, 7, tail)
    torch.testing.assert_close(shifted, torch.zeros_like(shifted), rtol=0, atol=1e-12)


def test_divergence_token_mode_raises():
    zs, zt = logits_pair()
    with pytest.raises(ValueError):
        distill_divergence(zs, zt, 0.5, "token", 7, True)


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_tail_bucket_stays_finite_when_topk_holds_all_mass(dtype):
    # k >= V, or a single huge logit: the tail mass is 0 (or rounds to it)
    zs, zt = logits_pair(n=4, V=8)
    zs, zt = zs.to(dtype), zt.to(dtype)
    peaked = zs.clone()
    peaked[:, 0] = 500.0
    for s, k in [(zs, 8), (zs, 100), (peaked, 3)]:
        s = s.clone().requires_grad_()
        d = distill_divergence(s, zt, 0.5, "topk", k, True)
        assert torch.isfinite(d).all()
        d.sum().backward()
        assert torch.isfinite(s.grad).all()


def make_case(N=37, H=16, V=50, dtype=f64, seed=0, temperature=0.7):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=f64) * scale).to(dtype)

    C = dict(
        # logits of std ~2: peaked enough for clipping and a small tail, not so
        # peaked that the fp32 tail bucket (1 - sum of top-k) is ill-conditioned
        h=rnd(N, H), W=rnd(V, H, scale=0.35),
        h_t=rnd(N, H), W_t=rnd(V, H, scale=0.35), h_t0=rnd(N, H), W_t0=rnd(V, H, scale=0.35),
        tokens=torch.randint(0, V, (N,), generator=g),
        adv=torch.randn(N, generator=g, dtype=f64).to(dtype),
        wts=torch.rand(N, generator=g, dtype=f64).to(dtype),
        mask=torch.rand(N, generator=g) > 0.3,
    )
    C["mask"][:3] = False  # a first chunk that is partly excluded
    C["mask"][-5:] = True
    # old log-probs near the current ones, so the PPO clip is active on some rows
    cur = sampled_logprobs(C["h"], C["W"], C["tokens"], temperature).to(dtype)
    C["old"] = cur + 0.3 * torch.randn(N, generator=g, dtype=f64).to(dtype)
    # a two-part "trust region" teacher: 0.75 * current + 0.25 * initial logits
    C["teacher"] = [TeacherLogits(C["h_t"], C["W_t"], 0.75), TeacherLogits(C["h_t0"], C["W_t0"], 0.25)]
    return C


def grpo_distill_loss_fn(C, distill, div_coef=0.3):
    """Looks like the real one: PPO-clip on logp with per-row advantages and old
    log-probs indexed by rows, + div_coef * div, + the sampled-token estimator
    sg(logp - logq) * logp on the distilled rows for distill="token"."""
    def loss_fn(logp, div, teacher_logp, rows):
        ratio = torch.exp(logp - C["old"][rows])
        a = C["adv"][rows]
        pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        per_row = pg + div_coef * div
        if distill == "token":
            m = C["mask"][rows].to(logp.dtype)
            per_row = per_row + m * (logp - teacher_logp).detach() * logp
        return (per_row * C["wts"][rows]).sum()
    return loss_fn


def run(fn, C, loss_fn, *, teacher=True, div_rows=True, grad_scale=1.0, **kw):
    h_leaf = C["h"].clone().requires_grad_()
    W = torch.nn.Parameter(C["W"].clone())
    hidden = h_leaf * 1.0  # non-leaf, like a model output
    loss, stats = fn(hidden, W, C["tokens"], loss_fn, C["teacher"] if teacher else None,
                     C["mask"] if div_rows else None, **kw)
    (loss * grad_scale).backward()
    return loss.detach(), h_leaf.grad, W.grad, stats


def assert_rel(got, want, rtol, what):
    scale = want.abs().max().item()
    err = (got.to(want.dtype) - want).abs().max().item()
    assert err <= rtol * max(scale, 1e-30), f"{what}: max abs err {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("dtype,rtol", [(f64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("alpha,distill,tail",
                         list(itertools.product([0, 0.5, 1], ["full", "topk", "token"], [True, False])))
def test_fused_matches_naive(dtype, rtol, alpha, distill, tail):
    V = 50 if dtype == f64 else 300
    C = make_case(V=V, dtype=dtype)
    loss_fn = grpo_distill_loss_fn(C, distill)
    kw = dict(alpha=alpha, distill=distill, topk=7, tail=tail, temperature=0.7)
    ln, ghn, gwn, sn = run(naive_token_loss, C, loss_fn, **kw)
    lf, ghf, gwf, sf = run(fused_token_loss, C, loss_fn, chunk_size=8, **kw)  # 8 does not divide 37
    assert lf.dtype == ln.dtype and ghf.dtype == dtype and gwf.dtype == dtype
    # the loss is a sum with cancellations: relative to the sum of |per-row terms|
    row_terms = torch.stack([loss_fn(sn["logp"][i:i + 1].to(dtype), sn["div"][i:i + 1].to(dtype),
                                     sn["teacher_logp"][i:i + 1].to(dtype), slice(i, i + 1))
                             for i in range(len(C["tokens"]))])
    assert abs(lf.item() - ln.item()) <= rtol * row_terms.abs().sum().item(), (lf, ln)
    assert_rel(ghf, ghn, rtol, "grad hidden")
    assert_rel(gwf, gwn, rtol, "grad weight")
    for key in ("logp", "div", "teacher_logp", "entropy", "topk_mass"):  # the last two: diagnostics
        assert sf[key].dtype == torch.float32 and not sf[key].requires_grad
        assert_rel(sf[key], sn[key], max(rtol, 1e-6), key)
    # rows outside div_rows: no divergence, no teacher log-prob
    assert (sf["div"][~C["mask"]] == 0).all() and (sf["teacher_logp"][~C["mask"]] == 0).all()
    assert (sf["entropy"] > 0).all() and ((sf["topk_mass"] > 0) == (C["mask"] & (distill == "topk"))).all()
    if distill == "token":
        m = C["mask"]
        torch.testing.assert_close(sf["div"][m], sf["logp"][m] - sf["teacher_logp"][m])


@pytest.mark.parametrize("topk", [7, 13, 30, 50])
def test_fused_topk_both_ways_of_reading_teacher_logits_at_the_student_topk(topk):
    """k < V/4 gathers LM-head rows per token; k >= V/4 takes one full product (V=50 here)."""
    C = make_case(V=50)
    loss_fn = grpo_distill_loss_fn(C, "topk")
    kw = dict(alpha=0.5, distill="topk", topk=topk, tail=True, temperature=0.7)
    ln, ghn, gwn, _ = run(naive_token_loss, C, loss_fn, **kw)
    lf, ghf, gwf, _ = run(fused_token_loss, C, loss_fn, chunk_size=8, **kw)
    for got, want, what in [(lf, ln, "loss"), (ghf, ghn, "grad h"), (gwf, gwn, "grad W")]:
        assert_rel(got, want, 1e-9, what)


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 1000])
def test_fused_chunk_sizes_default_div_rows_and_grad_scale(chunk_size):
    C = make_case()
    loss_fn = grpo_distill_loss_fn(C, "topk")
    kw = dict(alpha=0.5, distill="topk", topk=7, tail=True, temperature=1.3)
    ln, ghn, gwn, _ = run(naive_token_loss, C, loss_fn, div_rows=False, grad_scale=2.5, **kw)
    lf, ghf, gwf, sf = run(fused_token_loss, C, loss_fn, div_rows=False, grad_scale=2.5,
                           chunk_size=chunk_size, **kw)
    assert (sf["teacher_logp"] != 0).all()  # div_rows=None: every row
    for got, want, what in [(lf, ln, "loss"), (ghf, ghn, "grad h"), (gwf, gwn, "grad W")]:
        assert_rel(got, want, 1e-9, what)


def test_fused_without_teacher_is_plain_grpo():
    C = make_case()
    loss_fn = grpo_distill_loss_fn(C, "full")
    kw = dict(alpha=0.5, distill="full", topk=7, tail=True)
    ln, ghn, gwn, sn = run(naive_token_loss, C, loss_fn, teacher=False, **kw)
    lf, ghf, gwf, sf = run(fused_token_loss, C, loss_fn, teacher=False, chunk_size=10, **kw)
    assert (sf["div"] == 0).all() and (sf["teacher_logp"] == 0).all()
    for got, want, what in [(lf, ln, "loss"), (ghf, ghn, "grad h"), (gwf, gwn, "grad W")]:
        assert_rel(got, want, 1e-9, what)


@pytest.mark.parametrize("distill", ["full", "topk", "token"])
def test_fused_bf16(distill):
    """The GPU path: bf16 products (tensor cores), fp32 softmax / divergence maths. Against the fp32
    reference on the same (bf16-representable) numbers, within bf16's precision; and the products
    really are bf16 (fp32 products would match the reference to ~1e-6)."""
    C = make_case(V=300, dtype=torch.bfloat16)
    C32 = {k: [TeacherLogits(a.float(), b.float(), c) for a, b, c in v] if k == "teacher" else
           v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in C.items()}
    kw = dict(alpha=0.5, distill=distill, topk=7, tail=True, temperature=0.7)
    ln, ghn, gwn, _ = run(naive_token_loss, C32, grpo_distill_loss_fn(C32, distill), **kw)
    lf, ghf, gwf, _ = run(fused_token_loss, C, grpo_distill_loss_fn(C, distill), chunk_size=8, **kw)
    assert ghf.dtype == torch.bfloat16 and gwf.dtype == torch.bfloat16 and lf.dtype == torch.float32
    # fp32 weights under autocast: bf16 products asked for with matmul_dtype, fp32 gradients back
    la, gha, gwa, _ = run(fused_token_loss, C32, grpo_distill_loss_fn(C32, distill), chunk_size=8,
                          matmul_dtype=torch.bfloat16, **kw)
    assert gha.dtype == torch.float32 and gwa.dtype == torch.float32
    l32, _, _, _ = run(fused_token_loss, C32, grpo_distill_loss_fn(C32, distill), chunk_size=8, **kw)
    for loss, gh, gw in ((lf, ghf, gwf), (la, gha, gwa)):
        assert abs(loss.item() - ln.item()) <= 1e-2 * abs(ln.item())
        assert (gh.float() - ghn).norm() <= 2e-2 * ghn.norm() and (gw.float() - gwn).norm() <= 2e-2 * gwn.norm()
    assert abs(la.item() - ln.item()) > 10 * abs(l32.item() - ln.item())  # bf16 products, not fp32 ones


@pytest.mark.parametrize("fn", [naive_token_loss, fused_token_loss])
def test_token_estimator_sign(fn):
    # One SGD step on sg(logp - logq) * logp (the teacher's log-prob q at the
    # sampled token) raises logp where the teacher prefers the token
    # (logq > logp) and lowers it where the teacher dislikes it.
    torch.manual_seed(0)
    N, H, V = 2, 8, 20
    h, W, h_t = torch.randn(N, H, dtype=f64), torch.randn(V, H, dtype=f64), torch.randn(N, H, dtype=f64)
    gap = torch.log_softmax(h_t @ W.T, -1) - torch.log_softmax(h @ W.T, -1)  # logq - logp
    tokens = torch.stack([gap[0].argmax(), gap[1].argmin()])
    assert gap[0, tokens[0]] > 0 > gap[1, tokens[1]]

    def loss_fn(logp, div, teacher_logp, rows):
        return ((logp - teacher_logp).detach() * logp).sum()

    kw = dict(alpha=0.5, distill="token", topk=5, tail=True)
    hidden = h.clone().requires_grad_()  # the rows are independent when only h moves
    loss, stats = fn(hidden, W, tokens, loss_fn, [TeacherLogits(h_t, W, 1.0)], **kw)
    loss.backward()
    before = stats["logp"].double()
    after = fn(hidden.detach() - 0.05 * hidden.grad, W, tokens, loss_fn, [TeacherLogits(h_t, W, 1.0)], **kw)[1]["logp"]
    assert after[0] > before[0] and after[1] < before[1]


@pytest.mark.parametrize("distill", ["full", "topk", "token"])
def test_all_zero_loss_gives_zero_grads(distill):
    C = make_case(dtype=torch.float32)
    # peaked rows too: the top-k hold all the mass, the tail bucket is clamped
    C["h"][:4] *= 200

    def zero_loss(logp, div, teacher_logp, rows):
        return 0 * logp.sum() + 0 * div.sum()

    lf, ghf, gwf, _ = run(fused_token_loss, C, zero_loss, alpha=0.5, distill=distill, topk=7,
                          tail=True, chunk_size=8)
    assert lf.item() == 0
    assert torch.isfinite(ghf).all() and torch.isfinite(gwf).all()
    assert (ghf == 0).all() and (gwf == 0).all()

    hidden = C["h"].clone().requires_grad_()
    loss, _ = fused_token_loss(hidden, C["W"], C["tokens"], zero_loss, C["teacher"], C["mask"],
                               alpha=0.5, distill=distill, topk=7, tail=True)
    assert loss.requires_grad and loss.grad_fn is not None


def test_sampled_logprobs():
    C = make_case(N=37, V=60, dtype=torch.float32)
    for T in (1.0, 0.7):
        want = torch.log_softmax(C["h"].double() @ C["W"].double().T / T, -1)
        want = want.gather(1, C["tokens"][:, None]).squeeze(1)
        got = sampled_logprobs(C["h"], C["W"], C["tokens"], temperature=T, chunk_size=8)
        assert got.dtype == torch.float32 and got.shape == (37,) and not got.requires_grad
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_fused_with_one_input_frozen(frozen):
    # e.g. a frozen LM head: only the hidden states get a gradient (and vice versa)
    C = make_case()
    loss_fn = grpo_distill_loss_fn(C, "topk")
    kw = dict(alpha=0.5, distill="topk", topk=7, tail=True, temperature=0.7)
    grads = []
    for fn, extra in [(naive_token_loss, {}), (fused_token_loss, {"chunk_size": 8})]:
        h = C["h"].clone().requires_grad_(frozen != "hidden")
        W = C["W"].clone().requires_grad_(frozen != "weight")
        loss, _ = fn(h, W, C["tokens"], loss_fn, C["teacher"], C["mask"], **kw, **extra)
        loss.backward()
        assert (h.grad is None) == (frozen == "hidden") and (W.grad is None) == (frozen == "weight")
        grads.append(W.grad if frozen == "hidden" else h.grad)
    assert_rel(grads[1], grads[0], 1e-9, "grad")


@pytest.fixture
def fp32_out_gemms(monkeypatch):
    """Emulates CUDA's fp32-output GEMMs (torch.mm / addmm / bmm with out_dtype) on the CPU, which has
    none: an fp32 product of the bf16 values, which is what the GPU kernel computes. Returns the list
    of the emulated calls made."""
    import runtime
    assert not runtime.has_fp32_out_gemm("cpu")  # today's CPU torch: the fallback is what CPU runs use
    real, calls = {name: getattr(torch, name) for name in ("mm", "addmm", "bmm")}, []

    def emulated(name):
        def gemm(*args, out_dtype=None, **kw):
            if out_dtype is None:
                return real[name](*args, **kw)
            calls.append(name)
            *inputs, a, b = args  # addmm's first argument is the fp32 tensor it adds to
            return real[name](*inputs, a.to(out_dtype), b.to(out_dtype), **kw)
        return gemm
    monkeypatch.setattr(runtime, "has_fp32_out_gemm", lambda device_type: True)
    for name in real:
        monkeypatch.setattr(torch, name, emulated(name))
    return calls


def test_fp32_output_gemms_take_the_exact_products_of_the_bf16_inputs(fp32_out_gemms):
    """Where torch multiplies bf16 inputs into an fp32 output (torch.mm / addmm out_dtype, CUDA), the
    fused loss uses it: no bf16 rounding of the logits or of the weight gradient's running sum (the
    CPU has no such kernel: fp32_out_gemms emulates it). The student log-probs and the divergence then
    equal the fp32 reference on bf16-rounded inputs, which the bf16-product fallback does not."""
    C = make_case(V=300, dtype=torch.float32)
    kw = dict(alpha=0.5, distill="topk", topk=7, tail=True, temperature=1.0)
    rounded = dict(C, h=C["h"].bfloat16().float(), W=C["W"].bfloat16().float(),  # the teacher's share scaled, then cast
                   teacher=[TeacherLogits((t.hidden * t.coef).bfloat16().float(), t.weight.bfloat16().float(), 1.0)
                            for t in C["teacher"]])
    _, ghn, gwn, sn = run(naive_token_loss, rounded, grpo_distill_loss_fn(rounded, "topk"), **kw)
    with pytest.MonkeyPatch.context() as undo:  # the fallback, as the CPU runs it
        import runtime
        undo.setattr(runtime, "has_fp32_out_gemm", lambda device_type: False)
        _, _, _, s_fallback = run(fused_token_loss, C, grpo_distill_loss_fn(C, "topk"), chunk_size=8,
                                  matmul_dtype=torch.bfloat16, **kw)
    _, gh, gw, s = run(fused_token_loss, C, grpo_distill_loss_fn(C, "topk"), chunk_size=8,
                       matmul_dtype=torch.bfloat16, **kw)
    assert {"mm", "addmm", "bmm"} <= set(fp32_out_gemms)
    assert_rel(s["logp"], sn["logp"], 1e-5, "logp, fp32-output GEMMs")
    assert_rel(s["div"], sn["div"], 1e-4, "divergence, fp32-output GEMMs")
    assert (s_fallback["logp"] - sn["logp"]).abs().max() > 10 * (s["logp"] - sn["logp"]).abs().max()
    assert (gh - ghn).norm() <= 2e-2 * ghn.norm() and (gw - gwn).norm() <= 2e-2 * gwn.norm()


@pytest.mark.parametrize("alpha,topk", [(0, 100), (1, 100), (0.5, 100), (0.5, 1500)])
def test_a_teacher_equal_to_the_student_gives_no_divergence_under_fp32_output_gemms(fp32_out_gemms, alpha, topk):
    """The teacher's logits at the student's top-k are set against its max and log-normaliser, which
    come from an fp32-output GEMM on CUDA; gathered as bf16 products beside them (logits near 20 off
    by up to ~0.06), a teacher identical to the student got a divergence of ~1e-2 and a gradient
    larger than a real teacher signal's, through the tail bucket. topk 1500 of 4000 takes the
    [n, V]-product branch of _gathered_logits, 100 the gathered-rows (bmm) one."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 64, 64, 4000
    W = (torch.randn(V, H, generator=g) * 0.5).bfloat16().float()
    h = torch.randn(N, H, generator=g).bfloat16().float().requires_grad_()
    tokens = torch.randint(0, V, (N,), generator=g)
    loss, stats = fused_token_loss(h, W, tokens, lambda logp, div, tlogp, rows: div.sum(), [TeacherLogits(h.detach(), W, 1.0)],
                                   None, alpha=alpha, distill="topk", topk=topk, tail=True, chunk_size=16,
                                   matmul_dtype=torch.bfloat16)
    loss.backward()
    assert "bmm" in fp32_out_gemms or topk == 1500
    assert stats["div"].abs().max() < 1e-6 and h.grad.norm() < 1e-5, (stats["div"].abs().max(), h.grad.norm())


def test_the_temperature_divides_the_hidden_states_before_their_bf16_cast():
    """Dividing after the cast rounds twice (bf16(h) / T is rounded again): at T = 0.6 the fused
    loss's logits are those of bf16(h / T)."""
    C = make_case(V=300, dtype=torch.float32)
    kw = dict(alpha=0.5, distill="topk", topk=7, tail=True)
    T = 0.6
    pre = dict(C, h=(C["h"] / T).bfloat16().float(), W=C["W"].bfloat16().float())
    _, _, _, want = run(fused_token_loss, pre, grpo_distill_loss_fn(pre, "topk"), chunk_size=8, temperature=1.0,
                        matmul_dtype=torch.bfloat16, **kw)
    _, _, _, got = run(fused_token_loss, C, grpo_distill_loss_fn(C, "topk"), chunk_size=8, temperature=T,
                       matmul_dtype=torch.bfloat16, **kw)
    # the same bf16 operands in the same bf16 products: the same numbers
    torch.testing.assert_close(got["logp"], want["logp"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got["entropy"], want["entropy"], atol=1e-6, rtol=1e-6)
