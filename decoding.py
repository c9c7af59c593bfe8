"""
Decoding with a KV cache: the one forward a rollout step runs (forward_with_cache), KV caches that
store keys and values in the autocast dtype, and on CUDA a static cache with a compiled, CUDA-graphed
decode step (static_decoding) that reads autocast-dtype copies of the matmul weights (decode_weights).
The static cache and the weight copies are the decode state: at most one of each alive, kept between
rollouts (same buffers, so CUDA graphs replay) and freed before a train step they do not fit beside
(StepMemory). train.py's generate() / decode() drive it; models.py's teacher forward uses new_cache.
"""
import contextlib
import inspect
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, Qwen2ForCausalLM, StaticCache
from transformers.cache_utils import DynamicLayer

from runtime import autocast_dtype, is_sharded

# the forward takes its KV cache as `cache` in newer transformers (5.2x) and as `past_key_values` in
# older ones (5.17 silently ignores cache=): the name is read off the installed version's signature
CACHE = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"


def forward_with_cache(model, ids, mask, position, cache, **kwargs):
    """The model's last-position logits [rows, V], reading and extending the KV cache (position None:
    an ALiBi model, whose positions follow the mask). Also the decode step that static_rollout compiles."""
    positions = {} if position is None else {"position_ids": position}
    return model(input_ids=ids, attention_mask=mask, **positions, **{CACHE: cache}, use_cache=True, **kwargs).logits[:, -1]


def bucket(n, per_octave=4, smallest=64):
    """n rounded up to one of `per_octave` sizes per power of two (at least `smallest`): a run
    sees a handful of distinct sizes, and wastes at most 1/per_octave of each."""
    if n <= smallest:
        return smallest
    step = max(1, (1 << (n.bit_length() - 1)) // per_octave)
    return -(-n // step) * step


class _StoresInOneDtype:
    """A KV cache that stores keys and values in kv_dtype (the autocast dtype; None: as they come).
    Under autocast RoPE returns fp32 keys (bf16 q/k times fp32 cos/sin) beside bf16 values;
    attention casts both to bf16 anyway, so storing bf16 changes no number and halves the keys'
    memory. Without it transformers 5.17 keeps both in fp32 and its StaticCache then cannot take a
    bf16 value (index_copy_ dtype mismatch: eager, deterministic mode, or dynamo's eager fallback)."""
    kv_dtype = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.kv_dtype is not None:
            key_states, value_states = key_states.to(self.kv_dtype), value_states.to(self.kv_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class KVCache(_StoresInOneDtype, DynamicCache):
    pass


class StaticKVCache(_StoresInOneDtype, StaticCache):
    pass


def new_cache(model, dev):
    """An empty dynamic KV cache for model, storing in the current autocast dtype (_StoresInOneDtype).
    Built from the model's config, as its own generate does: the config names the layer kinds
    (sliding-window, sparse-attention indexers, ...) that a plain DynamicCache gets wrong."""
    cache = KVCache(config=model.config)
    cache.kv_dtype = autocast_dtype(dev)
    return cache


# the decode state: the one static cache alive ({shape key: cache}, at most one entry: a new shape frees
# the previous buffers first), the one model's decode weights ({"model": weakref, "slots": [...]}, see
# decode_weights), and the compiled decode step per device kind
_static_caches, _decode_weights, _compiled_steps = {}, {}, {}


def free_decode_state():
    """Drop the static cache and the decode weights (their memory returns to the allocator): before a
    train step they do not fit beside. The next static rollout allocates both anew (on CUDA its graphs
    re-record, no recompile)."""
    _static_caches.clear()
    _decode_weights.clear()


def decode_state_bytes():
    """Bytes held by the static cache and the decode weights between rollouts."""
    cache = sum(t.numel() * t.element_size() for c in _static_caches.values() for layer in c.layers
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
    copies = {id(c): c.numel() * c.element_size() for *_, c in _decode_weights.get("slots", [])}
    return cache + sum(copies.values())


def matmul_params(model):
    """(module, name, parameter) for the fp32 weight and bias of each nn.Linear in the model (LoRA's
    adapters included): the tensors autocast casts to its dtype at every matmul. Embeddings and norms
    are not cast by autocast (they stay fp32 under it), so they are left alone."""
    return [(m, name, p) for m in model.modules() if isinstance(m, torch.nn.Linear)
            for name, p in m.named_parameters(recurse=False) if p.dtype == torch.float32]


@contextlib.contextmanager
def decode_weights(model, enabled=True):
    """Within: each nn.Linear of `model` holds an autocast-dtype copy of its fp32 weight and bias as its
    parameter; the fp32 parameters are put back on exit. No number changes (autocast casts those very
    tensors to that dtype at every matmul, and the cast is deterministic), but a torch.compile'd decode
    step traces autocast's casts into its graph and so re-reads every fp32 weight at every token (~4x a
    bf16 model's weight traffic, where decoding is bound by it). The copies are refreshed in place on
    entry (one cast per generate call, the same pointers: CUDA graphs replay) and kept between rollouts
    like the static cache: the decode state, freed by StepMemory before a train step it does not fit
    beside. A no-op outside autocast, when not enabled (the eager path: autocast caches its casts of
    parameters itself through the rollout) and for an FSDP-sharded model (its gathered weights are in
    the autocast dtype already)."""
    dev = next(model.parameters()).device
    dtype = autocast_dtype(dev)
    if not enabled or dtype is None or is_sharded(model):
        yield
        return
    params, live = matmul_params(model), _decode_weights.get("model")
    slots = _decode_weights.get("slots", [])
    current = live is not None and live() is model and len(slots) == len(params) and all(
        m is m2 and name == name2 and p is p2 and c.dtype == dtype for (m, name, p, c), (m2, name2, p2) in zip(slots, params))
    if not current:  # another model, another dtype, or its parameters were replaced: new copies
        slots = None  # the old copies go before the new ones are made: never two sets alive
        _decode_weights.clear()
        copies = {}  # one copy per tensor: tied weights stay tied
        for _, _, p in params:
            if id(p) not in copies:
                copies[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
        slots = [(m, name, p, copies[id(p)]) for m, name, p in params]
        _decode_weights.update(model=weakref.ref(model), slots=slots)
    else:
        with torch.no_grad():
            for copy, p in {id(c): (c, p) for _, _, p, c in slots}.values():
                copy.copy_(p)  # the weights the last optimizer step wrote
    for m, name, _, copy in slots:
        m._parameters[name] = copy
    try:
        yield
    finally:
        for m, name, p, _ in slots:
            m._parameters[name] = p


@contextlib.contextmanager
def frozen_flags(model, enabled=True):
    """Within: no parameter of `model` requires grad (each flag restored on exit). Decoding runs under
    no_grad, so nothing changes but the flag, which dynamo guards on: without this the trained student
    (its embeddings and norms require grad) and a frozen teacher would each compile the decode step, a
    minute apiece at 4B. Not for an FSDP-sharded model (FSDP owns its parameters' flags)."""
    if not enabled or is_sharded(model):
        yield
        return
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trained:
            p.requires_grad_(True)


def decode_state_fits(*, allocated, step_extra, total, fill=0.9):
    """Whether the decode state (part of `allocated`, the bytes in use now) may stay alive through a
    train step that last time allocated step_extra bytes above its start: the sum must fit in `fill`
    of the GPU (allocator slack). Unknown step_extra (the first step): it does not."""
    return step_extra is not None and allocated + step_extra <= fill * total


@dataclass
class StepMemory:
    """On CUDA, around each train step: free the decode state first unless it fits beside the step
    (decode_state_fits, from the previous step's measured peak), then measure this step's peak."""
    step_extra: int = None  # bytes the last train step allocated above what was in use at its start
    start: int = 0

    def before_step(self, dev):
        if dev.type != "cuda":
            return
        if (_static_caches or _decode_weights) and not decode_state_fits(
                allocated=torch.cuda.memory_allocated(dev), step_extra=self.step_extra,
                total=torch.cuda.get_device_properties(dev).total_memory):
            free_decode_state()
        torch.cuda.reset_peak_memory_stats(dev)
        self.start = torch.cuda.memory_allocated(dev)

    def after_step(self, dev):
        if dev.type == "cuda":
            self.step_extra = torch.cuda.max_memory_allocated(dev) - self.start


def static_decoding(model, prefill_cache, mask, max_new_tokens):
    """Move a prefilled KV cache into a StaticCache; return (cache, attention mask, step), or None
    for a model with sliding-window layers (their prefill cache holds only the window).

    The cache length is bucketed, and the live cache is reused while the rows match and it is long
    enough (lengths only grow), so a run allocates and compiles a handful of shapes, and at most one
    cache is alive at a time. The mask covers the whole cache (the causal mask hides the unwritten
    positions, and the ones past a short batch's end are never reached): one shape for every step."""
    rows, width = mask.shape
    if any(type(layer) is not DynamicLayer for layer in prefill_cache.layers):
        # a sliding-window prefill keeps only the window, a sparse-attention indexer (DeepSeek-V3.2) keeps keys
        # of its own that the loop below does not move: decode on the dynamic cache
        return None
    k = prefill_cache.layers[0].keys
    key = (rows, len(prefill_cache.layers), k.shape[1], k.shape[3], k.dtype, k.device)
    old = next(iter(_static_caches.items()), None)
    if old is not None and old[0][0] == key and old[0][1] >= width + max_new_tokens:
        (_, length), cache = old
    else:
        old = None  # this reference too: never two alive
        _static_caches.clear()  # before allocating the new one: never two alive
        length = bucket(width + max_new_tokens)
        cache = StaticKVCache(config=model.config, max_cache_len=length)
        cache.kv_dtype = prefill_cache.kv_dtype
        _static_caches[(key, length)] = cache
    cache.reset()
    for static_layer, layer in zip(cache.layers, prefill_cache.layers):
        static_layer.update(layer.keys, layer.values)  # writes positions 0..width-1
    mask = torch.cat([mask, mask.new_ones(rows, length - width)], dim=1)
    cuda = mask.device.type == "cuda"
    if cuda not in _compiled_steps:  # CUDA: capture each step shape once as a CUDA graph
        # dynamic=False: a shape's graph (and its kernels' rounding) depends on that shape alone, not on the
        # shapes this process saw before it, so a resumed run decodes as the uninterrupted one did (with
        # automatic dynamic shapes the second shape recompiles the step with symbolic sizes, and a resumed
        # process, which skipped that history, keeps a static graph). A run sees a handful of shapes (bucket,
        # rows); the recompile limit is raised so that none of them falls back to eager decoding.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled_steps[cuda] = torch.compile(forward_with_cache, mode="reduce-overhead" if cuda else "default",
                                              dynamic=False)

    def step(*args):
        if cuda:  # the previous step's graph outputs are consumed; let the next replay reuse them
            torch.compiler.cudagraph_mark_step_begin()
        return _compiled_steps[cuda](*args)
    return cache, mask, step


def use_static_rollout(setting, dev):
    """static_rollout 'auto' means on for CUDA (CUDA graphs pay off there) and off on a CPU."""
    return setting == "on" or (setting == "auto" and dev.type == "cuda")
