"""
Where a run executes: the device, autocast and its dtype, fp32-output GEMMs where torch has them,
and torchrun's ranks (Dist: the process group, global sums, the gradient all-reduce, gathers).
"""
import contextlib
import datetime
import functools
import os

import torch
import torch.distributed as dist

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
    """The autocast dtype: bf16 / fp16 on CUDA (params and optimizer stay fp32), None for fp32."""
    return {"auto": torch.bfloat16 if dev.type == "cuda" else None, "float32": None,
            "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]


def make_autocast(dev, dtype_name):
    """A context factory: torch.autocast at amp_dtype, or a no-op."""
    amp = amp_dtype(dev, dtype_name)
    return functools.partial(torch.autocast, dev.type, dtype=amp) if amp else contextlib.nullcontext


@functools.lru_cache(maxsize=None)
def has_fp32_out_gemm(device_type):
    """Whether torch.mm / addmm take bf16 inputs with out_dtype=float32 here (CUDA in recent torch;
    not the CPU): one GEMM that accumulates and writes fp32, no bf16 product to copy or add."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        out = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        return out.dtype == torch.float32 and bool((out == 4).all())
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
    token counts (global_sum) and gradients (all_reduce_grads); rank 0 writes. The environment
    is checked first (one line for a launch that is not torchrun's), and ranks that do not all
    turn up within RENDEZVOUS_TIMEOUT_S are one line, not a 30-minute hang."""

    def __init__(self, device_name):
        self.rank, self.world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
        problem = launch_problem(self.rank, self.world)
        if problem:
            raise UserError(f"{problem}: launch several processes with torchrun --nproc_per_node=N train.py ..., "
                            "or unset RANK / WORLD_SIZE for one")
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

    def all_reduce_grads(self, model, bucket_elems=1 << 24):
        """Sum gradients over ranks (each rank's loss is already / the global token count). Small
        gradients travel in flat buckets of at most bucket_elems elements (64 MB in fp32), big
        ones on their own, so no full-model flat copy is ever made."""
        if self.world == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        for p in params:
            if p.grad is None:  # this rank had no signal for it: contribute zeros
                p.grad = torch.zeros_like(p)
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
