"""Arithmetic, not a measurement: the GPU memory (per rank) a full-scale run needs, from the
model's architecture (published Qwen3 config.json values, built on the meta device to count
parameters exactly) and the run's settings. No GPU and no download needed.

    python tests/bench/memory_estimate.py                                   # config/sdpo_math.py (the default --config)
    python tests/bench/memory_estimate.py --config=config/sdpo_gsm8k.py     # a shipped config, as train.py reads it
    python tests/bench/memory_estimate.py --config=config/sdpo_gsm8k.py --init_from=Qwen/Qwen3-0.6B --gen_batch_size=32
    python tests/bench/memory_estimate.py --config=config/grpo_math.py --world_size=8    # one rank under torchrun
    python tests/bench/memory_estimate.py --parallel=fsdp --world_size=8   # one rank of 8, FSDP-sharded (fsdp_rows)
    python tests/bench/memory_estimate.py --model=qwen3-8b                  # another architecture, the config's settings

Settings: train.py's defaults, then the --config file, then any train.py --key=value, all through
configurator.py exactly as `python train.py config/x.py --key=value` applies them. The model is
the ARCH entry the config's init_from names ("Qwen/Qwen3-1.7B" -> qwen3-1.7b) unless --model is
given. Estimate-only flags: --model, --world_size (torchrun ranks; default 1; with train.py's
--parallel=fsdp one rank's share of the sharded state: fsdp_rows), --prompt_tokens (the
longest prompt), --teacher_prompt_tokens (the longest teacher prompt; default: the prompt + a
max_new_tokens demonstration + 64 template tokens, at most max_reprompt_len; with use_feedback,
max_reprompt_len).

Counted: fp32 weights, fp32 grads, AdamW's two fp32 moments, the fp32 teacher copy (SDPO with a
teacher of its own weights: EMA, or a frozen one that teacher_init or teacher_stage_reset=student
makes differ from the initial model) and the initial-model copy (frozen / trust-region teacher, a KL
reference, teacher_stage_reset='initial') -- the training state, held throughout. On top of it, the largest
of three phases that never overlap:
  generation  the bf16 KV cache of one generate call (rollout or eval: whole groups, at most
              gen_batch_size rows);
  train step  one micro-batch: the teacher forward's bf16 KV cache (teacher prompt + response;
              freed before the student forward, counted anyway: it covers allocator slack), the
              teacher hidden states the loss reads, the student's saved activations (with
              grad_checkpointing the fp32 block inputs + one block's recomputed activations,
              without it every block's), the fused loss's buffers (3 [chunk, vocab] fp32 buffers,
              chunk = loss_chunk but at least 1024, the chunk on CUDA; a bf16 LM-head weight copy;
              an fp32 LM-head gradient accumulator) and, with several ranks, one gradient
              all-reduce bucket (at most 2**24 fp32 elements);
  optimizer   foreach AdamW's sqrt(v) temporary: one more fp32 value per parameter.
LoRA (lora_rank > 0, lora_rows): the frozen base in bf16 (dtype auto / bfloat16; fp32 with
dtype=float32) and the fp32 adapters, whose parameters alone have grads, AdamW moments, the EMA
teacher's copy and the optimizer temporary; no frozen-teacher or reference copy (the base view
shares the base); no autocast weight copies and no LM-head bf16 copy for a bf16 base; no LM-head
gradient accumulator (the head is never adapted).
A block's activations are an approximation (autocast bf16 matmul inputs/outputs, the fp32
residual stream and norms). Not counted: CUDA context, allocator fragmentation (budget ~10 %:
"needs" = peak / 0.9), the sampling logits, prefill transients. The last line printed is one
JSON object.
"""
import argparse
import functools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # as a script: the repo root on sys.path, for train.py and tests.*
import decoding  # noqa: E402
import models  # noqa: E402
import teacher as teacher_module  # noqa: E402
import train  # noqa: E402
from configurator import configure  # noqa: E402

ARCH = {  # from each model's config.json on the hub
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
VOCAB = 151936
GB = 1e9
BUCKET = 2 ** 24  # fp32 elements in one gradient all-reduce bucket (64 MiB)
TEMPLATE_TOKENS = 64  # chat template + reprompt / solution templates around the demonstration
SLACK = 0.9  # the fraction of a GPU the estimate may fill (CUDA context, fragmentation)


@functools.lru_cache(maxsize=None)
def count_params(name):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, **ARCH[name]))
    return sum(p.numel() for p in model.parameters())


def arch_of(init_from):
    """'Qwen/Qwen3-1.7B' -> 'qwen3-1.7b' (None when init_from names no ARCH entry)."""
    name = init_from.rstrip("/").rsplit("/", 1)[-1].lower()
    return name if name in ARCH else None


@functools.lru_cache(maxsize=None)
def lora_param_count(name, rank, targets):
    """The adapter parameters LoRA adds: rank · (in + out) per adapted linear layer, on the meta model
    (targets as train.py's lora_targets: 'all-linear' is every linear layer but the LM head)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, **ARCH[name]))
    names = models.lora_target_names(targets)
    head = model.get_output_embeddings()
    return sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m is not head
               and (names == models.LORA_ALL or any(n == t or n.endswith("." + t) for t in names)))


def lora_rows(rows, cfg, model, n, world_size, own_copy):
    """The rows of a LoRA run (module docstring): the training state is the adapters', the base frozen.
    own_copy: the teacher holds weights of its own (under LoRA an adapter copy; the frozen teacher that is
    the initial model is the base view)."""
    n_ad = lora_param_count(model, cfg["lora_rank"], cfg["lora_targets"])
    base = 2 if cfg["dtype"] in ("auto", "bfloat16") else 4  # the autocast dtype on CUDA
    kind = "bf16" if base == 2 else "fp32"
    H = ARCH[model]["hidden_size"]
    none = ": none (already bf16)" if base == 2 else ""
    new = {
        "weights": (f"weights: frozen base ({kind}) + LoRA adapters (fp32, rank {cfg['lora_rank']}, {n_ad / 1e6:.1f}M "
                    f"params on {cfg['lora_targets']})", base * n + 4 * n_ad),
        "grads": ("grads (fp32): the adapters only", 4 * n_ad),
        "adamw": ("AdamW moments (fp32): the adapters only", 8 * n_ad),
        "copies": ("teacher copy: the teacher's own adapter (fp32); the base is shared" if own_copy else
                   "teacher / reference copies: none (the frozen teacher and the reference are the base view)",
                   4 * n_ad if own_copy else 0),
        "autocast_gen": (f"bf16 copies of the {kind} base for decoding{none}", 0 if base == 2 else 2 * n),
        "autocast_step": (f"autocast's bf16 copies of the {kind} base, saved for the backward{none}",
                          0 if base == 2 else 2 * n),
        "adamw_step": ("optimizer step: foreach AdamW's sqrt(v) temporary (fp32), the adapters", 4 * n_ad),
    }
    out = []
    for key, label, b, phase in rows:
        if key in new:
            label, b = new[key]
        elif key == "fused_loss":  # the head is frozen (no fp32 grad accumulator); a bf16 base needs no bf16 copy
            label = label.split(" + LM head")[0] + ("" if base == 2 else " + LM head bf16 copy") + " (LoRA: head frozen)"
            b -= VOCAB * H * (4 + (2 if base == 2 else 0))
        elif key == "ddp_bucket" and world_size > 1:
            label, b = f"gradient all-reduce bucket (fp32): the adapters, {min(BUCKET, n_ad)} elements", 4 * min(BUCKET, n_ad)
        out.append((key, label, b, phase))
    return out, n_ad


def block_activation_bytes(a):
    """Approximate bytes one decoder block keeps for its backward, per token (autocast bf16)."""
    H, I = a["hidden_size"], a["intermediate_size"]
    q, kv = a["num_attention_heads"] * a["head_dim"], a["num_key_value_heads"] * a["head_dim"]
    fp32 = 4 * H + q + kv  # the two RMSNorms' input and normalised output; q/k norm inputs
    bf16 = 5 * H + 3 * q + 3 * kv + 4 * I  # linear inputs (one autocast cast per call), q/k norm outputs,
    return 4 * fp32 + 2 * bf16  # attention inputs (v as is) and output, gate / act / up / product


def estimate(cfg, model, world_size=1, prompt_tokens=512, teacher_prompt_tokens=None, gpu_bytes=141 * GB):
    """(rows, summary): rows are (key, label, bytes, phase) with phase 'state', 'generation',
    'train step' or 'optimizer'; summary has the state, the phases' totals and the peak (bytes)."""
    a, n = ARCH[model], count_params(model)
    H, L = a["hidden_size"], a["num_hidden_layers"]
    kv_per_token = L * 2 * a["num_key_value_heads"] * a["head_dim"] * 2  # K and V, bf16
    algo, teacher, G, n_eval = cfg["algo"], cfg["teacher"], cfg["group_size"], cfg["eval_n"]
    sdpo = algo == "sdpo"
    if cfg["batch_prompts"] % world_size:
        raise SystemExit(f"error: batch_prompts={cfg['batch_prompts']} is not divisible by world_size={world_size}")
    rank_prompts = cfg["batch_prompts"] // world_size

    # the training state: what train.main builds
    needs_initial = train.needs_initial_model(cfg)
    own_teacher = sdpo and train.TEACHER_KINDS[teacher].own_copy  # its own weights, held apart from the initial model's
    own_copy = own_teacher and not (needs_initial and teacher_module.shares_initial_model(cfg))
    copies = int(needs_initial) + int(own_copy)

    # generation: generate() decodes whole groups, at most gen_batch_size rows (at least one group)
    def rows_per_call(prompts, group):
        per_call = max(1, cfg["gen_batch_size"] // group) if cfg["gen_batch_size"] > 0 else prompts
        return min(prompts, per_call) * group
    train_rows = rows_per_call(rank_prompts, G) if algo != "sft" else 0
    eval_rows = rows_per_call(max(1, cfg["batch_prompts"] * G // n_eval), n_eval)  # train.main's eval chunk
    gen_rows = max(train_rows, eval_rows)
    seq = prompt_tokens + cfg["max_new_tokens"]
    cache_len = decoding.bucket(seq)  # the static cache's length: bucketed (decoding.static_decoding)
    gen_kind = "rollout" if train_rows >= eval_rows else f"eval, eval_n={n_eval}"

    # one micro-batch of the train step
    micro = min(cfg["micro_batch_size"], rank_prompts * G)
    resp_tokens = micro * cfg["max_new_tokens"]  # rows of the fused loss
    if teacher_prompt_tokens is None:
        demo = prompt_tokens + cfg["max_new_tokens"] + TEMPLATE_TOKENS
        teacher_prompt_tokens = cfg["max_reprompt_len"] if cfg["use_feedback"] else min(cfg["max_reprompt_len"], demo)
    t_seq = teacher_prompt_tokens + cfg["max_new_tokens"]
    block = block_activation_bytes(a)
    if cfg["grad_checkpointing"]:
        acts = [("activations", f"student: fp32 block inputs x {L} + one block recomputed (approx.), {micro} rows x {seq}",
                 micro * seq * (4 * H * L + block))]
    else:
        acts = [("activations", f"student: every block's activations (approx., no grad_checkpointing), {micro} rows x {seq}",
                 micro * seq * block * L)]
    if cfg["fused_loss"]:
        chunk = min(train.loss_chunk_size(cfg, torch.device("cuda")), resp_tokens)
        loss = [("fused_loss", f"fused loss: 3 x [{chunk}, {VOCAB}] fp32 + LM head bf16 copy + fp32 grad accumulator",
                 3 * chunk * VOCAB * 4 + VOCAB * H * (2 + 4))]
    else:
        loss = [("full_logits", f"full logits (fused_loss=False): {3 + sdpo} x [{resp_tokens}, {VOCAB}] fp32",
                 (3 + sdpo) * resp_tokens * VOCAB * 4)]
    rows = [
        ("weights", "weights (fp32)", 4 * n, "state"),
        ("grads", "grads (fp32)", 4 * n, "state"),
        ("adamw", "AdamW moments (fp32)", 8 * n, "state"),
        ("copies", f"teacher / reference copies (fp32) x{copies}", 4 * n * copies, "state"),
        ("kv_generate", f"static KV cache (bf16, the autocast dtype), one generate call ({gen_kind}): {gen_rows} rows x "
         f"{cache_len} tokens (bucketed from {seq})", gen_rows * cache_len * kv_per_token, "generation"),
        ("kv_prefill", f"prefill KV cache, repeated for the group, while copied into the static one: {gen_rows} rows x "
         f"{prompt_tokens} tokens", gen_rows * prompt_tokens * kv_per_token, "generation"),
        ("autocast_gen", "bf16 copies of the fp32 weights, held through a generate call (the decode weights; at most: "
         "embeddings are not copied)", 2 * n, "generation"),
        ("kv_teacher", f"KV cache, one teacher forward: {micro} rows x {t_seq} tokens" if sdpo
         else f"KV cache, one teacher forward: none (algo={algo})", micro * t_seq * kv_per_token if sdpo else 0,
         "train step"),
        ("teacher_hidden", f"teacher hidden states for the loss (fp32): {resp_tokens} tokens" if sdpo
         else f"teacher hidden states: none (algo={algo})",
         resp_tokens * H * 4 * (2 if teacher == "trust_region" else 1) if sdpo else 0, "train step"),
        *[(k, label, b, "train step") for k, label, b in acts + loss],
        ("autocast_step", "autocast's bf16 copies of the fp32 weights, saved for the backward", 2 * n, "train step"),
        ("ddp_bucket", f"gradient all-reduce bucket (fp32): {min(BUCKET, n)} elements, world_size={world_size}"
         if world_size > 1 else "gradient all-reduce bucket: none (world_size=1)",
         4 * min(BUCKET, n) if world_size > 1 else 0, "train step"),
        ("adamw_step", "optimizer step: foreach AdamW's sqrt(v) temporary (fp32)", 4 * n, "optimizer"),
    ]
    if cfg["parallel"] == "fsdp":
        kl_reference = algo != "sft" and cfg["kl_coef"] > 0  # (the initial model; gathered once when it is the teacher too)
        rows = fsdp_rows(rows, a, n, world_size, sharded_copies=copies, gathered_copies=(
            int(own_teacher) + int(kl_reference and (own_copy or not own_teacher))))
    n_adapter = 0
    if cfg["lora_rank"]:
        rows, n_adapter = lora_rows(rows, cfg, model, n, world_size, own_copy=own_copy)
    # the decode state (the rollout's static cache and the decode weights, decoding.decode_weights) stays
    # through the train step and the optimizer step after it only where it fits beside the larger of the
    # two (decoding.StepMemory measures both as one); fsdp keeps no decode weights
    phases = {p: sum(b for _, _, b, q in rows if q == p) for p in ("state", "generation", "train step", "optimizer")}
    decode_copies = 0 if cfg["parallel"] == "fsdp" or not train_rows else next(b for k, _, b, _ in rows if k == "autocast_gen")
    decode_state = train_rows * cache_len * kv_per_token + decode_copies
    kept = phases["state"] + max(phases["train step"], phases["optimizer"]) + decode_state <= SLACK * gpu_bytes
    where = (f"kept (fits in {SLACK:.0%} of {gpu_bytes / GB:.0f} GB)" if kept else
             f"freed before the step (does not fit in {SLACK:.0%} of {gpu_bytes / GB:.0f} GB beside it)")
    rows.insert(-1, ("decode_state_kept", "the decode state (the rollout's static KV cache + the decode weights) beside "
                     "the train step: " + where, decode_state if kept else 0, "train step"))
    rows.append(("decode_state_kept_opt", "the decode state beside the optimizer step: " + where.split(" (")[0],
                 decode_state if kept else 0, "optimizer"))
    phases["train step"] += decode_state if kept else 0
    phases["optimizer"] += decode_state if kept else 0
    peak = phases["state"] + max(phases["generation"], phases["train step"], phases["optimizer"])
    peak = max(peak, sum(b for _, _, b, q in rows if q == "load"))  # fsdp: a model whole, before it is sharded
    summary = dict(params=n, lora_params=n_adapter, kv_per_token=kv_per_token, gen_rows=gen_rows, micro_rows=micro, decode_state_kept=kept,
                   teacher_prompt_tokens=teacher_prompt_tokens, phases=phases, peak=peak,
                   peak_phase=max(("generation", "train step", "optimizer"), key=phases.get))
    return rows, summary


def fsdp_rows(rows, a, n, world, *, sharded_copies, gathered_copies):
    """The rows of one rank of `world` under parallel=fsdp (runtime.shard_model): the fp32 state (weights,
    grads, AdamW, teacher / reference copies) and the optimizer's temporary are 1/world each; a generate
    call holds the student gathered in bf16 (MixedPrecisionPolicy: what autocast's copies were), the train
    step the EMA / frozen teacher and the KL reference gathered in bf16 (runtime.gathered, for the whole
    loss), two decoder blocks of the student (FSDP prefetches the next) and its root (embeddings, norm, LM
    head) through the step, and one block's gradients while they are reduce-scattered (bf16, fp32 for the
    reduction). At load each model is read on the CPU and moved onto the device one group at a time as it
    is sharded (runtime.load_device): at most one group (a block, or the root) whole, in fp32, beside the
    shards; copies of a sharded model are made sharded (runtime.sharded_copy). The 'load' row: a peak of
    its own, not on top of the state."""
    H, V, L = a["hidden_size"], VOCAB, a["num_hidden_layers"]
    root = V * H * (1 if a["tie_word_embeddings"] else 2) + H
    block = (n - root) // L
    out = []
    for key, label, b, phase in rows:
        if phase == "state" or key == "adamw_step":
            out.append((key, f"{label}, 1/{world} (sharded)", b // world, phase))
        elif key == "autocast_gen":
            out.append((key, "the student gathered (bf16, FSDP's param_dtype), held through a generate call", 2 * n, phase))
        elif key == "autocast_step":
            out += [("fsdp_gathered_copies", f"teacher / KL reference gathered (bf16) through the loss x{gathered_copies}",
                     2 * n * gathered_copies, phase),
                    ("fsdp_blocks", "student: 2 decoder blocks gathered (bf16) + the root (embeddings, LM head) and "
                     "its bf16 gradient", 2 * (2 * block + 2 * root), phase)]
        elif key == "ddp_bucket":
            out.append(("fsdp_reduce", "reduce-scatter of one block's gradients (bf16 + fp32 for the reduction)",
                        6 * block, phase))
        else:
            out.append((key, label, b, phase))
    out.append(("fsdp_load", f"at load: one group whole (fp32: the {'root' if root >= block else 'largest block'}, moved "
                f"from the CPU as it is sharded) beside the shards of {1 + sharded_copies} models (copies born sharded)",
                4 * max(block, root) + 4 * n * (1 + sharded_copies) // world, "load"))
    return out


def load_config(config, overrides):
    """train.py's defaults, then the config file, then --key=value: configurator.py, as train.py does."""
    argv = []
    if config:
        argv.append(config if os.path.exists(config) else os.path.join(ROOT, config))
    return configure(dict(vars(train)), argv + list(overrides), train.__file__)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,  # --teacher is a train.py key
                                 epilog="Any of train.py's --key=value settings is accepted too (python train.py --help).")
    ap.add_argument("--config", default="config/sdpo_math.py", help="a config file ('' = train.py's defaults)")
    ap.add_argument("--model", choices=sorted(ARCH), default=None, help="default: the ARCH entry init_from names")
    ap.add_argument("--world_size", type=int, default=1, help="torchrun ranks (ddp: >1 adds one gradient all-reduce "
                    "bucket; --parallel=fsdp: the state sharded over them)")
    ap.add_argument("--prompt_tokens", type=int, default=512, help="longest prompt")
    ap.add_argument("--gpu_gb", type=float, default=141, help="GPU memory (GB) the static cache must fit in beside the "
                    "train step to be kept through it (default: an H200)")
    ap.add_argument("--teacher_prompt_tokens", type=int, default=None,
                    help="longest teacher prompt (default: prompt + max_new_tokens + 64, at most max_reprompt_len)")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    try:
        train.check_config(cfg)
    except train.UserError as e:
        raise SystemExit(f"error: {e}") from None
    model = args.model or arch_of(cfg["init_from"])
    if model is None:
        raise SystemExit(f"error: init_from={cfg['init_from']!r} names no Qwen3 model in ARCH "
                         f"({', '.join(sorted(ARCH))}): pass --model=")
    rows, s = estimate(cfg, model, args.world_size, args.prompt_tokens, args.teacher_prompt_tokens, args.gpu_gb * GB)
    state, peak = s["phases"]["state"], s["peak"]

    print(f"memory estimate -- arithmetic, not a measurement -- per rank, {args.config or 'train.py defaults'}"
          + (f" {' '.join(overrides)}" if overrides else ""))
    print(f"{model}: {s['params'] / 1e9:.3f}B parameters; KV cache {s['kv_per_token'] / 1e6:.3f} MB per token (bf16); "
          f"algo={cfg['algo']}" + (f", teacher={cfg['teacher']}" if cfg["algo"] == "sdpo" else "")
          + f", gen_batch_size={cfg['gen_batch_size']}, micro_batch_size={cfg['micro_batch_size']}, "
            f"grad_checkpointing={cfg['grad_checkpointing']}, world_size={args.world_size}")
    width = 100
    for phase in ("state", "generation", "train step", "optimizer", "load"):
        print(f"  [{phase}]")
        for _, label, b, p in rows:
            if p == phase:
                print(f"    {label:<{width - 4}}{b / GB:>7.1f} GB")
    print(f"  {'training state (weights, grads, AdamW, copies)':<{width - 2}}{state / GB:>7.1f} GB")
    print(f"  {'peak estimate: state + max(generation, train step, optimizer) -- ' + s['peak_phase'] + (' (or load)' if cfg['parallel'] == 'fsdp' else ''):<{width - 2}}"
          f"{peak / GB:>7.1f} GB")
    print(f"  {'needs a GPU of at least (peak / 0.9: CUDA context, fragmentation)':<{width - 2}}{peak / SLACK / GB:>7.1f} GB")
    print(json.dumps({
        "estimate": "arithmetic, not a measurement", "config": args.config, "overrides": overrides, "model": model,
        "init_from": cfg["init_from"], "params": s["params"], "lora_params": s["lora_params"], "world_size": args.world_size,
        "rows_gb": {k: round(b / GB, 2) for k, _, b, _ in rows},
        "state_gb": round(state / GB, 1), "phases_gb": {k: round(v / GB, 1) for k, v in s["phases"].items() if k != "state"},
        "peak_gb": round(peak / GB, 1), "peak_phase": s["peak_phase"], "needs_gb": round(peak / SLACK / GB, 1),
        "gen_rows": s["gen_rows"], "micro_rows": s["micro_rows"],
        "kv_cache_gen_gb": round(next(b for k, _, b, _ in rows if k == "kv_generate") / GB, 1),
        "decode_state_kept": s["decode_state_kept"],
        "settings": {"prompt_tokens": args.prompt_tokens, "teacher_prompt_tokens": s["teacher_prompt_tokens"],
                     **{k: cfg[k] for k in ("parallel", "algo", "teacher", "kl_coef", "batch_prompts", "group_size", "eval_n",
                                            "gen_batch_size", "micro_batch_size", "grad_checkpointing", "max_new_tokens",
                                            "max_reprompt_len", "fused_loss", "loss_chunk", "lora_rank", "lora_targets")}},
    }))


if __name__ == "__main__":
    main()
