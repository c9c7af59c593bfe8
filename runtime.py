"""
Where a run executes: the device, autocast and its dtype, fp32-output GEMMs where torch has them,
and torchrun's ranks (Dist: the process group, global sums, the gradient all-reduce, gathers), with
parallel=fsdp the models sharded over them (FSDP2: shard_model, gathered, the full state dicts).
"""
import atexit
import contextlib
import copy
import datetime
import functools
import os
import re
import sys
import types
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from configurator import UserError


def pick_device(name):
    """'auto' (CUDA when there is one), 'cpu', 'cuda' or 'cuda:N'; anything else is one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UserError(f"device={name!r} is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name!r} but this torch sees no CUDA GPU: use --device=cpu (or install a CUDA build)")
    return dev


def amp_dtype(dev, dtype_name):
    """The autocast dtype (params and optimizer stay fp32): bf16 for 'auto' on CUDA and for 'bfloat16'
    on any device, None for fp32 (train.py refuses float16)."""
    return {"auto": torch.bfloat16 if dev.type == "cuda" else None, "float32": None,
            "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]


def make_autocast(dev, dtype_name):
    """A context factory: torch.autocast at amp_dtype, or a no-op."""
    amp = amp_dtype(dev, dtype_name)
    return functools.partial(torch.autocast, dev.type, dtype=amp) if amp else contextlib.nullcontext


@functools.lru_cache(maxsize=None)
def has_fp32_out_gemm(device_type):
    """Whether torch.mm / addmm / bmm take bf16 inputs with out_dtype=float32 here (CUDA in recent
    torch; not the CPU): one GEMM that accumulates and writes fp32, no bf16 product to copy or add."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        out = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        batched = torch.bmm(a[None], a[None], out_dtype=torch.float32)
        return out.dtype == batched.dtype == torch.float32 and bool((out == 4).all()) and bool((batched == 2).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def fp32_out_mm(out, a, b, accumulate):
    """out (+)= a @ b in one fp32-output GEMM (bf16 a, b; fp32 out) where torch has it; False (nothing
    done) where it does not, and the caller takes the bf16 product instead."""
    if not has_fp32_out_gemm(out.device.type):
        return False
    if accumulate:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    return True


def fp32_out_bmm(a, b):
    """a @ b, batched, as one fp32-output GEMM (bf16 a, b) where torch has it; None where it does not."""
    return torch.bmm(a, b, out_dtype=torch.float32) if has_fp32_out_gemm(a.device.type) else None


def autocast_dtype(dev):
    """The dtype autocast computes in on dev's device type right now, or None outside autocast."""
    return torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None


RENDEZVOUS_TIMEOUT_S = 300  # for the ranks to meet at start-up (env NANOSDPO_RENDEZVOUS_TIMEOUT overrides it)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default, for evals and checkpoint writes on one rank


def env_int(name, default):
    """An integer environment variable set by torchrun (default when unset); anything else is one line."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer (torchrun sets it: launch with "
                        "torchrun, or unset it for one process)") from None


def launch_problem(rank, world):
    """Why RANK / WORLD_SIZE / MASTER_* do not describe a torchrun launch, or None."""
    if world < 1 or not 0 <= rank < world:
        return f"RANK={rank} with WORLD_SIZE={world} (unset: 1): a rank must be in [0, WORLD_SIZE)"
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK") if world > 1 and not os.environ.get(v, "").strip()]
    if missing:
        return f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not"
    if world > 1 and not 0 < env_int("MASTER_PORT", 0) < 65536:
        return f"MASTER_PORT={os.environ['MASTER_PORT']} is not a port number"
    return None


class Dist:
    """torchrun's process group, or a single process. Ranks hold whole prompt groups; they add
    token counts (global_sum) and gradients (all_reduce_grads, or FSDP's reduce-scatter with
    parallel=fsdp); rank 0 writes. The environment is checked first (one line for a launch that is
    not torchrun's), ranks that do not all turn up within RENDEZVOUS_TIMEOUT_S are one line, not a
    30-minute hang, and so is a rank that dies mid-run (lost_rank_is_one_line)."""

    def __init__(self, device_name, parallel="ddp"):
        self.rank, self.world, self.parallel = env_int("RANK", 0), env_int("WORLD_SIZE", 1), parallel
        problem = launch_problem(self.rank, self.world)
        if problem:
            raise UserError(f"{problem}: launch several processes with torchrun --nproc_per_node=N train.py ..., "
                            "or unset RANK / WORLD_SIZE for one")
        if parallel == "fsdp" and self.world < 2:
            raise UserError("parallel=fsdp shards the models over torchrun's ranks, and this is one process: launch "
                            "torchrun --nproc_per_node=N train.py ... (N >= 2), or use parallel=ddp")
        self.device = pick_device(device_name)
        if self.world > 1:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", env_int("LOCAL_RANK", 0))
                torch.cuda.set_device(self.device)
            wait = env_int("NANOSDPO_RENDEZVOUS_TIMEOUT", RENDEZVOUS_TIMEOUT_S)
            try:
                dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                        timeout=datetime.timedelta(seconds=wait))
            except Exception as e:  # DistStoreError (a timeout), a refused connection, a port in use, ...
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UserError(f"rank {self.rank} of {self.world} could not meet the others at "
                                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {wait} s "
                                f"({type(e).__name__}: {first[:200]}): start every rank, with torchrun") from None
            if hasattr(dist.distributed_c10d, "_set_pg_timeout"):  # the short timeout was for meeting only
                dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
        self.master = self.rank == 0

    def check_same(self, value, what):
        """Stop every rank with one line when `value` (a fingerprint) differs between ranks."""
        values = self.gather(value)
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise UserError(f"{what} differ between ranks (rank 0 and rank{'s' if len(differ) > 1 else ''} "
                            f"{', '.join(map(str, differ))}): every rank must read the same files")

    def global_sum(self, numbers):
        if self.world == 1:
            return list(numbers)
        t = torch.tensor(numbers, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [int(x) if float(x).is_integer() else float(x) for x in t.tolist()]

    def max_over_ranks(self, number):
        return max(self.gather(number))

    @property
    def load_device(self):
        return load_device(self.device, self.parallel)

    def shard(self, *models, param_dtype=None):
        """parallel=fsdp: shard each model (None or sharded already: skipped) over the ranks (shard_model)."""
        for model in models:
            if model is not None and self.parallel == "fsdp" and not is_sharded(model):
                shard_model(model, self.device, self.world, param_dtype)

    def all_reduce_grads(self, model, bucket_elems=1 << 24):
        """Sum gradients over ranks (each rank's loss is already / the global token count). Small
        gradients travel in flat buckets of at most bucket_elems elements (64 MB in fp32), big
        ones on their own, so no full-model flat copy is ever made. (A sharded model's gradients
        were reduce-scattered by FSDP in the backward: nothing to do.)

        Hand-written rather than torch's DistributedDataParallel on purpose: train.py runs the
        decoder body itself (the fused loss does the LM head), so DDP's forward never runs; a rank
        whose micro-batches all lack signal runs no backward at all, where DDP's reducer would wait
        for it; and the micro-batches are accumulated locally anyway. One all-reduce per step after
        the last backward is the whole of DDP that this loop needs."""
        if self.world == 1 or is_sharded(model):
            return
        params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        if not params:
            return
        # a parameter no rank has a gradient for (a step without signal, an expert no token reached) keeps
        # grad None, so that AdamW skips it -- no weight decay, no moment or step-count update -- as one
        # process does; zeros in its place moved the weights and aged the optimizer state
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        self._all_reduce([has])
        params = [p for p, n in zip(params, has.tolist()) if n > 0]
        for p in params:
            if p.grad is None:  # this rank had no signal for it: contribute zeros
                p.grad = torch.zeros_like(p)
        if not params:
            return
        bucket, size = [], 0
        for p in params:
            if bucket and size + p.numel() > bucket_elems:
                self._all_reduce(bucket)
                bucket, size = [], 0
            bucket.append(p.grad)
            size += p.numel()
        self._all_reduce(bucket)

    @staticmethod
    def _all_reduce(grads):
        if len(grads) == 1:
            dist.all_reduce(grads[0])
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def gather(self, obj):
        """A list of every rank's obj (in rank order)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    @contextlib.contextmanager
    def lost_rank_is_one_line(self):
        """A rank that died (killed, out of memory) fails the others' next collective: one line on each
        survivor instead of a traceback (gloo: 'Connection closed by peer'; NCCL: an aborted communicator)."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # without gloo's [source:line], one sentence
            if self.world == 1 or not (isinstance(e, dist.DistError) or any(s in first for s in PEER_LOST)):
                raise
            raise LostRank(f"rank {self.rank} of {self.world}: another rank stopped ({type(e).__name__}: "
                           f"{first[:160]}): its own output says why; continue with --init_from=resume") from None


def leave(code):
    """End a torchrun rank whose work is all written and closed: the exit hooks run as at a normal exit
    (atexit: wandb's, the code sandbox's teardown), then os._exit(code) skips the interpreter's shutdown.
    Why: a gloo worker thread can still be releasing the tensors of the last collective when the
    interpreter shuts down, and its taking the GIL then kills it inside a destructor: the process aborts
    with 'terminate called without an active exception' (pytorch/pytorch#190489; 2 of 40 runs of
    tests/parallel/fsdp_steps.py on a busy 2-core machine). The hooks run before that, with the
    interpreter whole, so the race is not theirs."""
    atexit._run_exitfuncs()  # the registered hooks, in the order a normal exit runs them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LostRank(UserError):
    """A peer rank died: train.py prints the line and leaves (leave: the exit hooks, then os._exit), since
    the process group's threads still wait on the dead peer and would print a C++ 'terminate called' line
    after it (or hang) while the interpreter shuts down. Nothing is lost: the with-blocks (the lock, the
    log) have closed."""


PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused", "NCCL communicator")


# ----------------------------------------------------------------------------- sharding (parallel=fsdp)
# FSDP2 (torch's fully_shard, as torchtitan / TRL / verl apply it): each decoder block is one group, the
# root (embeddings, final norm, LM head; a tied head is the embedding, one parameter) another. A group's
# weights are all-gathered before its forward and resharded after it (the root's stay until the
# backward), its gradients reduce-scattered in the backward, the AdamW state lives on the shards. Every
# rank must run the same collectives in the same order: train.py holds whole models through its no-grad
# phases, where ranks decode or read a teacher unevenly (gathered), and gives every rank as many
# micro-batches (loss_backward's lockstep).
def is_sharded(module):
    return isinstance(module, FSDPModule)


def decoder_blocks(model):
    """The repeated blocks FSDP shards one by one: the classes transformers itself never splits
    (_no_split_modules: Qwen3DecoderLayer, LlamaDecoderLayer, GPT2Block, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise UserError(f"{type(model).__name__} names no decoder block class (_no_split_modules) for parallel=fsdp "
                        "to shard: use parallel=ddp")
    return blocks


def load_device(dev, parallel):
    """Where a model is loaded: the CPU under parallel=fsdp, where shard_model then moves it onto dev one
    group at a time (fully_shard moves a group's weights to its mesh's device as it shards them), so the
    GPU never holds the whole model, only the shards and the group being sharded; dev otherwise. (The
    host holds the whole model either way: from_pretrained reads it into host memory first.)"""
    return torch.device("cpu") if parallel == "fsdp" else dev


class Sharding(NamedTuple):
    """How shard_model sharded a model (kept on it as model.nanosdpo_sharding): what a copy repeats."""
    cls: type  # the model's class before fully_shard made it a subclass
    dev: torch.device
    world: int
    param_dtype: torch.dtype = None


def shard_model(model, dev, world, param_dtype=None):
    """fully_shard each decoder block, then the root, over a 1-D mesh of `world` ranks (the weights move to
    dev one block at a time). param_dtype (bf16 for dtype=bfloat16): FSDP's MixedPrecisionPolicy gathers the
    weights in it and reduces the gradients in fp32; the sharded master weights and AdamW state stay fp32.
    Gradients are summed over ranks, not averaged: each rank's loss is already divided by the whole step's
    token count."""
    sharding = Sharding(type(model), dev, world, param_dtype)
    mesh = init_device_mesh(dev.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for group in (m for m in model.modules() if isinstance(m, FSDPModule)):  # a plain SUM (gloo has no PREMUL_SUM)
        group.set_gradient_divide_factor(1.0)
        group.set_force_sum_reduction_for_comms(True)
    _route_body_through_root(model)
    model.nanosdpo_sharding = sharding
    return model


def shard_like(model, like):
    """Shard model as the sharded model `like` was (same mesh size, device, param_dtype)."""
    s = like.nanosdpo_sharding
    return shard_model(model, s.dev, s.world, s.param_dtype)


def sharded_copy(model):
    """A copy of a sharded model, sharded alike, without the whole model on the device at any point (FSDP
    cannot deepcopy; a whole fp32 copy on every rank is what sharding avoids): the model's class built from
    its config on the meta device, sharded as the original was, given memory (to_empty), and filled from
    the original: each parameter's shard, the buffers (FSDP does not shard them: RoPE's tables), and the
    plain tensors modules keep as attributes (RoPE's original_inv_freq), which meta left empty."""
    with torch.device("meta"):
        twin = model.nanosdpo_sharding.cls(copy.deepcopy(model.config))
    layout = [(n, p.dtype, p.shape) for n, p in model.named_parameters()]  # (a DTensor's shape is the whole one)
    if [(n, p.dtype, p.shape) for n, p in twin.named_parameters()] != layout:
        raise UserError(f"{type(model).__name__} built again from its config differs from the loaded model (parameter "
                        "names, dtypes or shapes): parallel=fsdp cannot copy it; use parallel=ddp")
    shard_like(twin, model)
    twin.to_empty(device=model.nanosdpo_sharding.dev)
    with torch.no_grad():
        for t, p in zip(twin.parameters(), model.parameters()):
            local(t).copy_(local(p))
        for (_, t), (_, b) in zip(twin.named_buffers(), model.named_buffers()):
            t.copy_(b)
        for m_twin, m in zip(twin.modules(), model.modules()):
            for key, value in vars(m).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    setattr(m_twin, key, value)  # constants computed at construction: shared, not copied
    return twin


def _route_body_through_root(model):
    """train.py runs the decoder body itself (models.body_forward; the fused loss does the LM head). A
    call to the body from outside the model's own forward goes through the root's FSDP hooks, which
    gather the root's weights first and, with grad, keep them until the backward: lm_head(model) then
    reads the full head weight FSDP gathered, and its gradient is reduce-scattered with the root's."""
    from models import decoder_body  # (models imports this module)
    body = decoder_body(model)
    inside = []  # non-empty while the model's own forward runs (it calls the body itself)
    model.register_forward_pre_hook(lambda module, args: inside.append(True))  # (the hooks return None: no change)
    model.register_forward_hook(lambda module, args, out: inside.clear(), always_call=True)
    plain = body.forward
    model.nanosdpo_body_forward = types.MethodType(lambda self, *args, **kwargs: plain(*args, **kwargs), model)
    register_fsdp_forward_method(model, "nanosdpo_body_forward")

    @functools.wraps(plain)  # (keeps the signature: models.takes_position_ids reads it)
    def forward(*args, **kwargs):
        return plain(*args, **kwargs) if inside else model.nanosdpo_body_forward(*args, **kwargs)
    body.forward = forward


@contextlib.contextmanager
def gathered(*models):
    """Hold sharded models' full weights through a no-grad phase (a rollout, an eval, the teacher and the
    KL reference during the loss): one all-gather per group on entry, none per forward inside (a generate
    call decodes without any, and ranks may decode different numbers of steps), resharded on exit. A model
    that is not sharded (or None) passes through."""
    roots = list({id(m): m for m in models if is_sharded(m)}.values())  # once each (a frozen teacher is the KL reference)
    groups = [g for m in roots for g in m.modules() if isinstance(g, FSDPModule)]
    for group in groups:
        group.unshard()
        group.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for group in groups:
            group.reshard()
            group.set_reshard_after_forward(not any(group is m for m in roots), recurse=False)  # roots: FSDP's default


def local(t):
    """This rank's shard of a sharded tensor (a view: writing it writes the shard), or t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0's host memory


def full_state_dict(model):
    """A sharded model's whole state dict on rank 0 (CPU; {} on the others; every rank must call it), a
    tied weight one tensor under each of its names, as model.state_dict() has it (save_pretrained then
    writes it once, as it does for an unsharded model; unshared() before a safetensors file)."""
    state_dict = get_model_state_dict(model, options=FULL)
    return tied(model, state_dict) if state_dict else state_dict


def tied(model, state_dict):
    """state_dict with every name of a tied weight (the LM head = the embedding) mapped to one tensor, the
    first name's; names it lacks are added."""
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        state_dict[name] = state_dict[first.setdefault(id(p), name)]
    return state_dict


def unshared(state_dict):
    """state_dict with each tensor under its first name only (safetensors refuses a tensor under two)."""
    seen = set()
    return {k: v for k, v in state_dict.items() if not (id(v) in seen or seen.add(id(v)))}


def full_optimizer_state(model, optimizer):
    """A sharded model's AdamW state, whole, on rank 0 ({} elsewhere; every rank calls it), in the layout of
    optimizer.state_dict() (parameters by position), which checkpoint.py writes for either parallel."""
    if not optimizer.state:  # before the first step: torch's getter would take a zero-gradient step to fill it
        return optimizer.state_dict()
    osd = get_optimizer_state_dict(model, optimizer, options=FULL)
    if not osd:
        return {}
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {index[name]: s for name, s in osd["state"].items()},
            "param_groups": [dict(g, params=[index[name] for name in g["params"]]) for g in osd["param_groups"]]}


def load_full_state_dict(model, state_dict):
    """A whole state dict (every rank holds it; a tied weight under one name or all) into a sharded
    model: each rank keeps its shard."""
    set_model_state_dict(model, tied(model, dict(state_dict)), options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model, optimizer, osd):
    """full_optimizer_state's layout (every rank holds it) into the optimizer of a sharded model."""
    if not osd["state"]:  # no moments yet (saved before the first step): the hyperparameters only, no zero step
        optimizer.load_state_dict(osd)
        return
    names = [name for name, _ in model.named_parameters()]
    osd = {"state": {names[i]: s for i, s in osd["state"].items()},
           "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in osd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))
