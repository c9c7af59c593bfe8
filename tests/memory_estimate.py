"""Arithmetic, not a measurement: the GPU memory a full-scale run needs, from the model's
architecture (published Qwen3 config.json values, built on the meta device to count parameters
exactly) and the run's settings. No GPU and no download needed.

    python tests/memory_estimate.py                                  # config/sdpo_math.py's settings
    python tests/memory_estimate.py --model=qwen3-8b
    python tests/memory_estimate.py --gen_batch_size=0 --eval_n=16   # one eval batch decoded at once

Counted: fp32 weights, fp32 grads, AdamW's two fp32 moments, the fp32 teacher copy (SDPO with an
EMA or frozen teacher) and the initial-model copy (frozen / trust-region teacher, or a KL
reference); the bf16 KV cache of one generate call (rows x (prompt + max_new_tokens)) and of one
teacher forward (micro_batch_size rows x (teacher prompt + response)); with grad_checkpointing=True
(assumed: without it every block's intermediates are kept, several times more), the fp32 hidden
state saved at every block boundary for one micro-batch. Not counted: the activations of the one
block being recomputed, the fused loss's [loss_chunk, vocab] buffers, CUDA context and allocator
slack (budget ~10 %). The last line printed is one JSON object.
"""
import argparse
import json

import torch

ARCH = {  # from each model's config.json on the hub
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
GB = 1e9


def count_params(name):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, **ARCH[name]))
    return sum(p.numel() for p in model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(ARCH), default="qwen3-4b")
    ap.add_argument("--teacher", choices=["ema", "frozen", "trust_region", "live", "none"], default="ema",
                    help="'none' for GRPO")
    ap.add_argument("--kl_coef", type=float, default=0.0)
    ap.add_argument("--batch_prompts", type=int, default=32)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--eval_n", type=int, default=16)
    ap.add_argument("--gen_batch_size", type=int, default=32, help="rows per generate call (0 = a whole batch)")
    ap.add_argument("--prompt_tokens", type=int, default=512, help="longest prompt")
    ap.add_argument("--max_new_tokens", type=int, default=4096)
    ap.add_argument("--teacher_prompt_tokens", type=int, default=4096, help="longest teacher prompt (prompt + demonstration)")
    ap.add_argument("--micro_batch_size", type=int, default=8)
    args = ap.parse_args()

    a = ARCH[args.model]
    n = count_params(args.model)
    kv_per_token = a["num_hidden_layers"] * 2 * a["num_key_value_heads"] * a["head_dim"] * 2  # K and V, bf16
    train_rows = args.batch_prompts * args.group_size
    eval_rows = args.batch_prompts * args.group_size // args.eval_n * args.eval_n  # the loop's eval chunk
    gen_rows = min(args.gen_batch_size or max(train_rows, eval_rows), max(train_rows, eval_rows))
    seq = args.prompt_tokens + args.max_new_tokens
    copies = {"ema": 1, "frozen": 2, "trust_region": 1, "live": 0, "none": 0}[args.teacher]  # frozen: teacher = initial, kept once each
    copies = copies + (1 if args.kl_coef > 0 and args.teacher in ("ema", "live", "none") else 0)
    rows = [
        ("weights (fp32)", 4 * n),
        ("grads (fp32)", 4 * n),
        ("AdamW moments (fp32)", 8 * n),
        (f"teacher / reference copies (fp32) x{copies}", 4 * n * copies),
        (f"KV cache, one generate call: {gen_rows} rows x {seq} tokens", gen_rows * seq * kv_per_token),
        (f"KV cache, one teacher forward: {args.micro_batch_size} rows x "
         f"{args.teacher_prompt_tokens + args.max_new_tokens} tokens",
         0 if args.teacher == "none" else args.micro_batch_size * (args.teacher_prompt_tokens + args.max_new_tokens) * kv_per_token),
        (f"block-boundary activations (fp32): {args.micro_batch_size} rows x {seq} tokens",
         args.micro_batch_size * seq * a["hidden_size"] * 4 * a["num_hidden_layers"]),
    ]
    # generation and the student backward do not overlap: the peak is the state plus the larger of the two
    state = sum(b for label, b in rows[:4])
    phase = max(rows[4][1], sum(b for _, b in rows[5:]))
    print(f"{args.model}: {n / 1e9:.2f}B parameters; KV cache {kv_per_token / 1e6:.3f} MB per token (bf16)")
    for label, b in rows:
        print(f"  {label:<72}{b / GB:>8.1f} GB")
    print(f"  {'training state (weights, grads, AdamW, copies)':<72}{state / GB:>8.1f} GB")
    print(f"  {'peak estimate: state + max(generation, teacher + student)':<72}{(state + phase) / GB:>8.1f} GB")
    print(json.dumps({"model": args.model, "params": n, "state_gb": round(state / GB, 1),
                      "peak_gb": round((state + phase) / GB, 1), "gen_rows": gen_rows,
                      "kv_cache_gen_gb": round(rows[4][1] / GB, 1), "settings": vars(args)}))


if __name__ == "__main__":
    main()
