# -----------------------------------------------------------------------------
# Token loss: LM head + log-softmax + (GRPO / self-distillation) loss, naive
# and fused. Everything works on flattened rows: hidden [N, H] (final hidden
# states), weight [V, H] (LM head), tokens [N] (the sampled token of each row).
# The fused version never materialises an [N, V] tensor: it walks the rows in
# chunks and computes the gradients for hidden and weight during the forward.
# Maths in fp32 whatever the input dtype (fp64 stays fp64, for the tests).

import math
import torch

DISTILL_MODES = ("full", "topk", "token")
TAIL_LOG_CLAMP = -1e-7  # as in the SDPO reference: keeps log(1 - sum top-k p) finite


def _compute_dtype(dtype):
    # fp32 maths for fp32/bf16/fp16 inputs, fp64 for fp64 inputs (used by the tests)
    return torch.promote_types(dtype, torch.float32)


def _divergence(s, t, alpha):
    """Divergence between row distributions given as log-probs s (student) and t
    (teacher), reduced over the last dim. alpha=0: KL(q||p), alpha=1: KL(p||q),
    otherwise the generalized JSD with mixture m = (1-alpha) p + alpha q."""
    if alpha == 0:
        return (t.exp() * (t - s)).sum(-1)
    if alpha == 1:
        return (s.exp() * (s - t)).sum(-1)
    log_m = torch.logaddexp(s + math.log(1 - alpha), t + math.log(alpha))
    kl_pm = (s.exp() * (s - log_m)).sum(-1)
    kl_qm = (t.exp() * (t - log_m)).sum(-1)
    return (1 - alpha) * kl_pm + alpha * kl_qm


def _topk_buckets(s_k, t_k, tail):
    """Top-k log-probs [n, k] (gathered from full-vocab log-softmaxes) -> the
    bucket log-probs the divergence is taken over: k + 1 buckets with a tail
    bucket log(1 - sum_k p), or the k tokens renormalised."""
    if not tail:
        return torch.log_softmax(s_k, -1), torch.log_softmax(t_k, -1)

    def add_tail(lp):
        # log(1 - exp(lse)) via expm1; the clamp avoids log(0) = -inf (and NaN
        # grads) when the top-k hold (numerically) all the mass
        lse = torch.logsumexp(lp, -1, keepdim=True).clamp(max=TAIL_LOG_CLAMP)
        return torch.cat([lp, torch.log(-torch.expm1(lse))], -1)

    return add_tail(s_k), add_tail(t_k)


def distill_divergence(student_logits, teacher_logits, alpha, distill, topk, tail):
    """Per-row divergence [N] between student and teacher logits [N, V].
    distill="full": over the whole vocab; "topk": over the student's top-k tokens
    (+ a tail bucket, or renormalised). Computed in fp32 (fp64 for fp64 inputs)."""
    if distill not in ("full", "topk"):
        raise ValueError(f"distill_divergence: distill must be 'full' or 'topk', got {distill!r}"
                         " ('token' is a sampled-token estimator, handled in the loss)")
    dt = _compute_dtype(student_logits.dtype)
    z, zt = student_logits.to(dt), teacher_logits.to(dt)
    s, t = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    if distill == "full":
        return _divergence(s, t, alpha)
    idx = torch.topk(z, min(topk, z.shape[-1]), dim=-1).indices
    s_b, t_b = _topk_buckets(s.gather(-1, idx), t.gather(-1, idx), tail)
    return _divergence(s_b, t_b, alpha)


def _check_args(hidden, weight, tokens, teacher, div_rows, distill):
    if distill not in DISTILL_MODES:
        raise ValueError(f"distill must be one of {DISTILL_MODES}, got {distill!r}")
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    assert tokens.shape == (hidden.shape[0],)
    # rows that get a divergence: all rows by default when there is a teacher, none without
    N = hidden.shape[0]
    if teacher is None:
        return torch.zeros(N, dtype=torch.bool, device=hidden.device)
    if div_rows is None:
        return torch.ones(N, dtype=torch.bool, device=hidden.device)
    assert div_rows.shape == (N,) and div_rows.dtype == torch.bool
    return div_rows


def _teacher_logits(teacher, rows, dt, temperature):
    """sum_i coef_i * (hidden_i[rows] @ weight_i.T) / temperature, no grad."""
    z = None
    for h_t, w_t, coef in teacher:
        part = h_t.detach()[rows].to(dt) @ w_t.detach().to(dt).T
        z = coef * part if z is None else z + coef * part
    return z / temperature


def naive_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                     alpha, distill, topk, tail, temperature=1.0):
    """Reference implementation: full [N, V] logits and plain autograd.

    hidden [N, H] student final hidden states, weight [V, H] LM head, tokens [N]
    the sampled token of each row. Student logits = hidden @ weight.T / T (fp32).
    teacher: None or [(hidden_t [N, H], weight_t [V, H], coef)], no grad:
    teacher logits = sum coef * hidden_t @ weight_t.T, / T.
    div_rows: bool [N] (None: all rows if there is a teacher, else none); rows
    outside get div = 0 and teacher_logp = 0.
    Per row: logp (student log-prob at tokens), teacher_logp, and div =
    distill_divergence(...) for distill "full" / "topk", or the constant
    (logp - teacher_logp).detach() for "token" (the caller's loss_fn builds the
    sampled-token estimator sg(logp - teacher_logp) * logp from teacher_logp).
    loss = loss_fn(logp [N], div [N], teacher_logp [N], slice(0, N)), a scalar.
    Returns (loss, {"logp", "div", "teacher_logp"}: detached fp32 [N])."""
    div_mask = _check_args(hidden, weight, tokens, teacher, div_rows, distill)
    N = hidden.shape[0]
    dt = _compute_dtype(hidden.dtype)
    tokens = tokens.long()
    logits = hidden.to(dt) @ weight.to(dt).T
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    div = torch.zeros(N, dtype=dt, device=hidden.device)
    teacher_logp = torch.zeros(N, dtype=dt, device=hidden.device)
    rows = div_mask.nonzero().squeeze(1)
    if rows.numel() > 0:
        t_logits = _teacher_logits(teacher, rows, dt, temperature)
        t_lp = torch.log_softmax(t_logits, -1).gather(1, tokens[rows, None]).squeeze(1)
        teacher_logp = teacher_logp.index_put((rows,), t_lp)
        if distill == "token":
            d = (logp[rows] - t_lp).detach()
        else:
            d = distill_divergence(logits[rows], t_logits, alpha, distill, topk, tail)
        div = div.index_put((rows,), d)
    loss = loss_fn(logp, div, teacher_logp, slice(0, N))
    stats = {"logp": logp.detach().float(), "div": div.detach().float(),
             "teacher_logp": teacher_logp.detach().float()}
    return loss, stats


def _logits_into(buf, parts, transposed=False):
    """sum_i h_i @ w_i.T over parts [(h_i [c, H], w_i [V, H])], written into the
    flat buffer buf and returned as a [c, V] view. transposed=True computes the
    [V, c] product w @ h.T instead (MKL is ~1.4x faster at it for few rows) and
    returns its transpose, a [c, V] view with strides (1, c): fine for
    elementwise ops, reductions and gathers, slow for topk."""
    c, V = parts[0][0].shape[0], parts[0][1].shape[0]
    out = buf[: c * V].view(V, c) if transposed else buf[: c * V].view(c, V)
    for i, (h, w) in enumerate(parts):
        a, b = (w, h.T) if transposed else (h, w.T)
        if i == 0:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
    return out.T if transposed else out


def _gathered_logits(parts, idx, max_elems):
    """sum_i <h_i[r], w_i[idx[r, j]]> for parts [(h_i [n, H], w_i [V, H])] and
    idx [n, k]: logits at a few vocab entries per row without the [n, V]
    product; row blocks keep the gathered [rows, k, H] weights under max_elems."""
    n, k = idx.shape
    H = parts[0][0].shape[1]
    out = torch.empty(n, k, dtype=parts[0][0].dtype, device=idx.device)
    step = max(1, max_elems // (k * H))
    for r in range(0, n, step):
        acc = 0
        for h, w in parts:
            acc = acc + torch.bmm(w[idx[r:r + step]], h[r:r + step, :, None]).squeeze(2)
        out[r:r + step] = acc
    return out


def _full_divergence_and_grad(s, t, p, alpha):
    """Full-vocab divergence [n] of student log-probs s from teacher log-probs t
    (p = exp(s)) and its gradient w.r.t. the student logits [n, V], in closed
    form. s is used as scratch."""
    if alpha == 0:  # KL(q||p); grad p - q
        q = t.exp()
        d = (q * (t - s)).sum(1)
        return d, q.neg_().add_(p)
    if alpha == 1:  # KL(p||q); grad p (log p - log q - KL)
        r = s.sub_(t)
        d = (p * r).sum(1)
        return d, r.sub_(d[:, None]).mul_(p)
    # JSD; grad (1 - alpha) p (log p - log m - KL(p||m))
    log_m = torch.logaddexp(s + math.log(1 - alpha), t + math.log(alpha))
    kl_qm = (t.exp() * (t - log_m)).sum(1)
    s_m = s.sub_(log_m)
    del log_m
    kl_pm = (p * s_m).sum(1)
    d = (1 - alpha) * kl_pm + alpha * kl_qm
    return d, s_m.sub_(kl_pm[:, None]).mul_(p).mul_(1 - alpha)


class _FusedTokenLoss(torch.autograd.Function):
    """Chunked forward that also computes d loss / d hidden and d loss / d weight
    (the output is a scalar, so the backward only has to scale them)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, loss_fn, teacher, div_mask,
                alpha, distill, topk, tail, temperature, chunk_size):
        N, H = hidden.shape
        V = weight.shape[0]
        dev, dt = hidden.device, _compute_dtype(hidden.dtype)
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = tokens.long()
        full = distill == "full"
        k = min(topk, V) if distill == "topk" else 0
        w = weight.detach().to(dt)  # no copy when weight is already in dt
        # teacher parts (hidden, weight, coef / T): the scale goes on the
        # [rows, H] hidden states, not on [rows, V] logits
        teacher = [(h_t.detach(), w_t.detach().to(dt), float(coef) / temperature)
                   for h_t, w_t, coef in teacher or []]

        grad_h = torch.empty(N, H, dtype=dt, device=dev) if need_gh else None
        grad_w = torch.zeros(V, H, dtype=dt, device=dev) if need_gw else None
        logp_all, div_all, tlogp_all = (torch.zeros(N, dtype=dt, device=dev) for _ in range(3))
        total = torch.zeros((), dtype=dt, device=dev)
        div_mask_cpu = div_mask.cpu()  # one host sync; per-chunk row lists are then free
        # One [chunk, V] logits buffer reused by every chunk (no allocation and,
        # on CPU, no page faults of freshly mmapped memory per chunk): the
        # teacher's full-vocab pass runs first, then the student's logits
        # overwrite it ("full" keeps the teacher's log-probs in a second buffer).
        c_max = min(chunk_size, N)
        z_buf = torch.empty(c_max * V, dtype=dt, device=dev)
        t_buf = torch.empty(c_max * V, dtype=dt, device=dev) if full and div_mask_cpu.any() else z_buf
        # on CPU the teacher's logits are computed transposed (faster); the
        # strided view is fine for all the teacher needs (gathers, max, exp, sum)
        t_transposed = dev.type == "cpu" and not full

        for a in range(0, N, chunk_size):
            b = min(a + chunk_size, N)
            c = b - a
            h = hidden[a:b].detach().to(dt) / temperature
            y = tokens[a:b, None]
            d_local = div_mask_cpu[a:b].nonzero().squeeze(1)
            nd = d_local.numel()
            all_div = nd == c
            d_idx = d_local.to(dev)  # rows of this chunk that get a divergence
            tlogp = torch.zeros(c, dtype=dt, device=dev)
            div = torch.zeros(c, dtype=dt, device=dev)

            # ---- teacher, div rows only: log-normaliser and log-prob at y.
            # Log-probs are computed as (z - max) - log_norm, in that order, so
            # they are precise near the max (the top-k / tail buckets need it).
            if nd:
                t_parts = [(h_t[d_idx + a].to(dt) * s, w_t) for h_t, w_t, s in teacher]
                zt = _logits_into(t_buf, t_parts, t_transposed)
                zt_y = zt.gather(1, y[d_idx]).squeeze(1)
                t_max = zt.amax(1)
                zt.sub_(t_max[:, None])
                if full:
                    t_log_norm = torch.logsumexp(zt, 1)
                    t = zt.sub_(t_log_norm[:, None])  # teacher log-probs [nd, V], kept
                else:
                    t_log_norm = zt.exp_().sum(1).log()
                del zt
                tlogp[d_idx] = zt_y - t_max - t_log_norm

            # ---- student: logits / T [c, V] -> p, in place in the buffer
            z = _logits_into(z_buf, [(h, w)])
            z_y = z.gather(1, y).squeeze(1)
            if k and nd:
                # topk of every row (cheaper than copying out the div rows of a
                # mixed chunk); its top-1 is the row max, which saves a pass
                z_k, top_idx = torch.topk(z, k, dim=1)
                z_max = z_k[:, 0]
                if not all_div:
                    z_k, top_idx = z_k[d_idx], top_idx[d_idx]
                # the teacher's logits at the student's top-k, by dot products
                zt_k = _gathered_logits(t_parts, top_idx, max_elems=c_max * V // 8)
            else:
                z_max = z.amax(1)
            z.sub_(z_max[:, None])
            if full:
                log_norm = torch.logsumexp(z, 1)
                s_all = z.sub_(log_norm[:, None])  # log-probs, needed over the whole vocab
                p = s_all.exp()
            else:
                p = z.exp_()  # unnormalised probs exp(z - max): p / exp(log_norm)
                log_norm = p.sum(1).log()
            del z
            logp = z_y - z_max - log_norm

            # ---- divergence (and what its gradient needs)
            if nd and distill == "topk":
                # small [nd, k] local graph: the divergence as a function of the
                # student's top-k log-probs s_k
                with torch.enable_grad():
                    s_k = (z_k - z_max[d_idx, None] - log_norm[d_idx, None]).requires_grad_()
                    t_k = zt_k - t_max[:, None] - t_log_norm[:, None]
                    d = _divergence(*_topk_buckets(s_k, t_k, tail), alpha)
                div[d_idx] = d.detach()
            elif nd and full:
                d, ddiv_dz = _full_divergence_and_grad(
                    s_all if all_div else s_all[d_idx], t, p if all_div else p[d_idx], alpha)
                div[d_idx] = d
                del t
            elif nd and distill == "token":
                div[d_idx] = logp[d_idx] - tlogp[d_idx]
            if full:
                del s_all

            # ---- the caller's loss on the [c] vectors; tiny local autograd for
            # d loss / d logp and d loss / d div ("token": div is a constant)
            with torch.enable_grad():
                logp_leaf = logp.clone().requires_grad_()
                div_leaf = div.clone().requires_grad_(distill != "token")
                out = loss_fn(logp_leaf, div_leaf, tlogp, slice(a, b))
                leaves = [logp_leaf, div_leaf] if distill != "token" else [logp_leaf]
                grads = (torch.autograd.grad(out, leaves, allow_unused=True)
                         if out.requires_grad else [None] * len(leaves))
                g_logp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
                g_div = grads[1][d_idx] if distill != "token" and grads[1] is not None else None
                # back through the top-k buckets: d loss / d s_k, [nd, k]
                g_sk = None
                if nd and distill == "topk" and g_div is not None:
                    (g_sk,) = torch.autograd.grad(d, s_k, grad_outputs=g_div)
            total += out.detach().to(dt)
            logp_all[a:b] = logp
            div_all[a:b] = div
            tlogp_all[a:b] = tlogp
            if not (need_gh or need_gw):
                continue

            # ---- d loss / d z, in place in the p buffer. With s = log_softmax(z):
            # dL/dz = G - p * sum(G), G = dL/ds, which is sparse except for
            # "full": nonzero at y (from logp) and at the top-k (from div).
            g_sum = g_logp.clone()
            if g_sk is not None:
                g_sum[d_idx] += g_sk.sum(1)
            scale = -g_sum if full else -g_sum * torch.exp(-log_norm)  # p unnormalised
            dz = p.mul_(scale[:, None])
            dz.scatter_add_(1, y, g_logp[:, None])
            if g_sk is not None:
                if all_div:
                    dz.scatter_add_(1, top_idx, g_sk)
                else:
                    dz.index_put_((d_idx[:, None].expand_as(top_idx), top_idx), g_sk, accumulate=True)
            if full and nd and g_div is not None:
                ddiv_dz.mul_(g_div[:, None])
                if all_div:
                    dz.add_(ddiv_dz)
                else:
                    dz.index_add_(0, d_idx, ddiv_dz)
            ddiv_dz = None

            # ---- chain through z = (h / T) @ W.T; the weight grad accumulates in dt
            if need_gh:
                torch.mm(dz, w, out=grad_h[a:b])
            if need_gw:
                grad_w.addmm_(dz.T, h)
            del p, dz

        if need_gh:
            grad_h = grad_h.div_(temperature).to(hidden.dtype)
        if need_gw:
            grad_w = grad_w.to(weight.dtype)
        ctx.grads = (grad_h, grad_w)
        stats = (logp_all.float(), div_all.float(), tlogp_all.float())
        ctx.mark_non_differentiable(*stats)
        return (total,) + stats

    @staticmethod
    def backward(ctx, grad_out, *_):
        if ctx.grads is None:
            raise RuntimeError("fused_token_loss: backward can only run once (the gradients are handed over)")
        grad_h, grad_w = ctx.grads
        # drop our references so autograd can take the tensors over without a copy
        ctx.grads = None
        if grad_out.ne(1).item():
            grad_h = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
            grad_w = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return (grad_h, grad_w) + (None,) * 10


def fused_token_loss(hidden, weight, tokens, loss_fn, teacher=None, div_rows=None, *,
                     alpha, distill, topk, tail, temperature=1.0, chunk_size=128):
    """Same arguments, semantics and result as naive_token_loss, without any
    [N, V] tensor: rows are processed in chunks of chunk_size, and the
    gradients for hidden and weight are computed during the forward (the
    backward only scales them, and can run once). loss_fn is called once per
    chunk with rows = slice(a, b); the loss is the sum of those calls.
    chunk_size=128 keeps the extra memory to ~one [128, V] fp32 buffer (~78 MB
    at V=152k) besides the weight gradient; on a GPU a larger chunk (e.g.
    1024) makes the matmuls more efficient."""
    div_mask = _check_args(hidden, weight, tokens, teacher, div_rows, distill)
    loss, logp, div, tlogp = _FusedTokenLoss.apply(
        hidden, weight, tokens, loss_fn, teacher, div_mask,
        alpha, distill, topk, tail, temperature, chunk_size)
    return loss, {"logp": logp, "div": div, "teacher_logp": tlogp}


@torch.no_grad()
def sampled_logprobs(hidden, weight, tokens, temperature=1.0, chunk_size=128):
    """log-softmax(hidden @ weight.T / T) at tokens, [N] fp32, chunked, no grad
    (e.g. reference-model log-probs)."""
    dt = _compute_dtype(hidden.dtype)
    w = weight.to(dt)
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for a in range(0, hidden.shape[0], chunk_size):
        z = hidden[a:a + chunk_size].to(dt) @ w.T
        if temperature != 1.0:
            z.div_(temperature)
        lse = torch.logsumexp(z, 1)
        out[a:a + chunk_size] = (z.gather(1, tokens[a:a + chunk_size, None].long()).squeeze(1) - lse).float()
    return out
