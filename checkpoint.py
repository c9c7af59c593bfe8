"""
The run folder: what train.py keeps in out_dir, and how it survives crashes, a second run and a
changed config. (The collapse guard, which decides which checkpoint is a good one, watches training:
it is in metrics.py.)

    out_dir/
      .lock                 flock'd while a run writes here: a second run into the same folder stops
      .ckpt.lock            flock'd while a checkpoint is written (eval.py waits on it to read one)
      log.jsonl             one record per iteration and per eval
      samples.jsonl         a few rollouts (prompt, response, reward, teacher prompt) per eval
      accuracy_matrix.json  every eval set after every stage (one row per stage)
      stage<i>_<name>/      the model after each stage (continual runs)
      ckpt/                 the latest checkpoint: a plain HF model folder (config, weights in
                            save_dtype, tokenizer, generation_config and nothing else at its top level,
                            so AutoModelForCausalLM, vLLM and lm-eval load it as it is) with
        trainer/            what resuming needs besides: state.json (iteration, stage, config, data
                            order), optimizer.safetensors (+ every rank's sampling RNG),
                            teacher.safetensors (an EMA teacher's or another own copy's; not a frozen
                            teacher that is the initial model, reread from base_init on resume),
                            model_fp32.safetensors (when the export is bf16);
                            with parallel=fsdp the same files, gathered to rank 0 first (gather_full)
        adapter/            LoRA runs (lora_rank > 0): peft's adapter folder (adapter_config.json,
                            adapter_model.safetensors in fp32; PeftModel.from_pretrained loads it on
                            the base). The model above is then the merged one (W + B·A, no peft needed
                            to serve it); a resume reloads the base from the first run's init_from and
                            this adapter, and teacher.safetensors holds only an EMA teacher's adapter copy
      ckpt_good/            the last checkpoint whose eval passed the collapse guard (hard links); until
                            one passes, the initial model (a fresh run saves it before its first step)

A checkpoint is written to ckpt.tmp (trainer/state.json last), then ckpt -> ckpt.old and
ckpt.tmp -> ckpt, then ckpt.old is removed: a crash at any moment leaves a complete checkpoint
under one of the three names, and recover() puts the newest complete one back at ckpt/ (ckpt_good/
is written the same way). A checkpoint is written holding out_dir/.ckpt.lock, which a reader
(eval.py) holds shared while it loads one: it never sees one between its renames.
"""
import contextlib
import copy
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
from dataclasses import asdict, dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

import metrics
import runtime
from configurator import UserError, parse_stages
from models import adapter_tensors, base_fingerprint, lora_layers, merged_state_dict

RUN_OUTPUTS = r"log\.jsonl|samples\.jsonl|accuracy_matrix\.json|ckpt(_good)?(\.tmp|\.old)?|stage\d+_.+|eval(_\w+)?\.(json|md|png)"
# config keys a resumed run may change: where and how it runs, and when it evaluates and saves. Those
# in NOT_BIT_FOR_BIT change its numbers too (a rollout's random draws are taken in gen_batch_size chunks;
# the others change the floating-point order): allowed (a lower gen_batch_size after an out-of-memory),
# and said in a note (train.resume_notes)
NOT_BIT_FOR_BIT = ("dtype", "gen_batch_size", "micro_batch_size", "static_rollout", "fused_loss", "loss_chunk")
RESUMABLE = {"out_dir", "init_from", "data_dir", "tokenizer_path", "device", "dtype", "overwrite", "log_jsonl",
             "wandb_log", "wandb_project", "wandb_run_name", "eval_interval", "save_interval", "save_dtype",
             "micro_batch_size", "gen_batch_size", "static_rollout", "grad_checkpointing", "fused_loss", "loss_chunk",
             "stop_on_collapse", "collapse_patience", "dataset", "max_iters", "stages"}  # the last 3: checked as stages


# ----------------------------------------------------------------------------- the folder
@contextlib.contextmanager
def locked(out_dir):
    """Hold an OS lock (flock) on out_dir/.lock for the duration. The kernel releases it when the
    holder's process ends, however it ends (kill -9 included), so a killed run leaves no stale lock
    and no pid is ever guessed at. The file stays (it names the last holder's pid, for the message):
    removing it would let a run that opened it just before lock a file no longer in the folder."""
    if not out_dir or os.path.isfile(out_dir):
        raise UserError(f"out_dir={out_dir!r} is {'empty' if not out_dir else 'a file'}: give a folder for the run")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"out_dir {out_dir} cannot be created ({e.strerror}): give a writable folder") from None
    fd = _lock(os.path.join(out_dir, ".lock"), f"out_dir {out_dir}")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock(path, what, shared=False, wait=False):
    """An open fd of `path` holding its flock (exclusive, or shared); one line when it cannot be had."""
    if os.path.isdir(path) or os.path.islink(path):
        raise UserError(f"{path} is a {'directory' if os.path.isdir(path) else 'symbolic link'}, not a lock file: "
                        "remove it (no run creates one)")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise UserError(f"{what} is not writable ({path}: {e.strerror}): give a writable folder") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        holder = " ".join(os.pread(fd, 32, 0).decode(errors="replace").split()) or "unknown"
        os.close(fd)
        raise UserError(f"{what} is in use by another run (pid {holder}): wait for it to end, or use "
                        "another out_dir") from None
    except OSError as e:  # e.g. a network filesystem without locks
        os.close(fd)
        raise UserError(f"{what}: {path} cannot be locked ({e.strerror}): use a local folder") from None
    return fd


@contextlib.contextmanager
def take_over(out_dir, resume, overwrite):
    """Own out_dir for a run (locked), with a checkpoint that a crash left between its renames put
    back; a fresh run into an earlier run's folder refuses, unless told to overwrite it. Yields the
    notes to print."""
    with locked(out_dir):
        notes = [recover(os.path.join(out_dir, name)) for name in ("ckpt", "ckpt_good")]
        earlier = [] if resume else earlier_outputs(out_dir)
        if earlier and not overwrite:
            raise UserError(f"out_dir {out_dir} holds an earlier run ({', '.join(earlier)}): continue it with "
                            "--init_from=resume, replace it with --overwrite=True, or give this run another --out_dir")
        for name in earlier:
            path = os.path.join(out_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        if earlier:
            notes.append(f"--overwrite=True: removed the earlier run's {', '.join(earlier)} from {out_dir}")
        yield [n for n in notes if n]


def earlier_outputs(out_dir):
    """The files and folders of an earlier run in out_dir (others are left alone)."""
    return sorted(f for f in os.listdir(out_dir) if re.fullmatch(RUN_OUTPUTS, f))


def truncate_log(path, iteration):
    """Drop the records after `iteration` (a resumed run redoes them) and any half-written line."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):  # a half-written or foreign line
                if json.loads(line)["iter"] <= iteration:
                    kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- checkpoints
def complete(path):
    return os.path.exists(os.path.join(path, "trainer", "state.json"))


def newest_complete(ckpt_dir):
    """ckpt_dir when complete, else the complete ckpt.tmp (newer) or ckpt.old a crash between the
    renames left, else None."""
    return next((c for c in (ckpt_dir, ckpt_dir + ".tmp", ckpt_dir + ".old") if complete(c)), None)


def recover(ckpt_dir):
    """After a crash between a checkpoint's renames (ckpt/ or ckpt_good/) there is no complete
    ckpt_dir, but a complete .tmp or .old: move the newest complete one back. Returns what it did, or None."""
    found = newest_complete(ckpt_dir)
    if found in (None, ckpt_dir):
        return None
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    os.replace(found, ckpt_dir)
    return f"recovered the checkpoint {ckpt_dir} from {os.path.basename(found)} (a crash between its renames)"


def _swap_in(tmp, final):
    """tmp (complete) becomes final: final -> final.old, tmp -> final, final.old removed. A crash at
    any moment leaves a complete one under one of the three names, which recover() puts back."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def writing(ckpt_dir):
    """Held (exclusive) while train.py writes a checkpoint, ckpt_good/ or a stage snapshot into the
    run folder: a reader (eval.py, `reading`) never sees one between its renames."""
    fd = _lock(os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), ".ckpt.lock"), "the run folder", wait=True)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(path):
    """Held (shared) while a reader loads a checkpoint of a run folder: it waits while train.py is
    writing one. A folder no run ever wrote a checkpoint into has no lock file: nothing to wait for."""
    try:
        fd = os.open(os.path.join(os.path.dirname(os.path.abspath(path)), ".ckpt.lock"), os.O_RDONLY)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def gather_full(model, optimizer, teacher_model):
    """parallel=fsdp: the whole model, AdamW state and teacher gathered to rank 0's host memory, for
    save(full=...) to write in the one layout both parallels share (every rank must call it; None when
    the model is not sharded). A resume on the same world size loads them back shard by shard."""
    if not runtime.is_sharded(model):
        return None
    return {"model": runtime.full_state_dict(model), "optimizer": runtime.full_optimizer_state(model, optimizer),
            "teacher": runtime.full_state_dict(teacher_model) if teacher_model is not None else None}


def save(ckpt_dir, *, model, tokenizer, optimizer, teacher_model, state, rng_tensors, save_dtype="float32", full=None):
    """Write a checkpoint (layout in the module docstring) atomically. full: gather_full's (rank 0 of a
    sharded run), written in place of the sharded model's, optimizer's and teacher's own state dicts."""
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters()) if m is not None else 0  # noqa: E731
    needed = _folder_bytes(ckpt_dir) or 3 * size(model) + size(teacher_model)  # the last one's, or weights + 2 moments
    with writing(ckpt_dir):
        with disk_errors(ckpt_dir + ".tmp", needed, keeps=ckpt_dir):
            _write(ckpt_dir + ".tmp", model=model, tokenizer=tokenizer, optimizer=optimizer, teacher_model=teacher_model,
                   state=state, rng_tensors=rng_tensors, save_dtype=save_dtype, full=full or {})
        _swap_in(ckpt_dir + ".tmp", ckpt_dir)  # outside disk_errors: a failed rename must not remove the new one


@contextlib.contextmanager
def disk_errors(path, needed=0, keeps=None):
    """A full or read-only disk while writing `path` (a file, or a folder written as path.tmp and
    renamed) is one line naming it, the space there and needed, and what still holds the previous
    version; what was written of it is removed, to give the space back."""
    try:
        yield
    except OSError as e:
        partial = path if path.endswith(".tmp") else path + ".tmp"
        shutil.rmtree(partial, ignore_errors=True)  # a folder
        with contextlib.suppress(OSError):
            os.remove(partial)  # a file
        space = ""
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
            space = f"; {free / 1e6:.0f} MB free there" + (f", about {needed / 1e6:.0f} MB needed" if needed else "")
        kept = f"; {keeps} still holds the previous one" if keeps and os.path.exists(keeps) else ""
        raise UserError(f"cannot write {path} ({e.strerror or e}{space}){kept}: free space (or make it writable), then "
                        "continue with --init_from=resume") from None


def _folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def export_weights(model, save_dtype, state_dict=None):
    """The weights ckpt/ exports, in save_dtype (None: the model's own state dict as it is). A LoRA
    model's are merged (models.merged_state_dict), always cast: its frozen base may be bf16.
    state_dict: a sharded model's, gathered (runtime.full_state_dict; rank 0 writes)."""
    lora, dtype, cast = bool(lora_layers(model)), getattr(torch, save_dtype), {}
    if dtype == torch.float32 and not lora:
        return state_dict
    weights = {}
    for k, v in (merged_state_dict(model) if lora else state_dict or model.state_dict()).items():
        if v.data_ptr() not in cast:  # cast each tensor once: tied weights (embedding = LM head) stay one
            cast[v.data_ptr()] = v.to(dtype)
        weights[k] = cast[v.data_ptr()]
    return weights


def _save_model_folder(folder, model, tokenizer, save_dtype="float32", state_dict=None):
    """A plain HF model folder: weights in save_dtype (merged for LoRA, gathered for FSDP), config, tokenizer."""
    model.save_pretrained(folder, state_dict=export_weights(model, save_dtype, state_dict))
    if save_dtype != "float32" or lora_layers(model):  # the exported config says so: from_pretrained loads that dtype
        _set_config_dtype(os.path.join(folder, "config.json"), save_dtype)
    tokenizer.save_pretrained(folder)


def save_adapter(folder, model, base_name):
    """peft's adapter folder for a LoRA model: adapter_config.json (base_model_name_or_path: the
    base it was trained on) and adapter_model.safetensors (fp32, under peft's names)."""
    config = copy.copy(model.peft_config["default"])
    config.base_model_name_or_path = base_name
    config.save_pretrained(folder)
    save_file({k: p.detach().contiguous() for k, p in adapter_tensors(model).items()},
              os.path.join(folder, "adapter_model.safetensors"), metadata={"nanosdpo_base": json.dumps(base_fingerprint(model))})


def _own_tensors(teacher_model, model):
    """The teacher's weights a checkpoint keeps: under LoRA only those it does not share with the
    student (an EMA teacher's adapter copy; none for the frozen base view)."""
    shared = {id(p) for p in model.parameters()}
    return {n: p for n, p in teacher_model.named_parameters() if id(p) not in shared}


def _write(tmp, *, model, tokenizer, optimizer, teacher_model, state, rng_tensors, save_dtype, full):
    shutil.rmtree(tmp, ignore_errors=True)
    _save_model_folder(tmp, model, tokenizer, save_dtype, full.get("model"))
    lora = bool(lora_layers(model))
    if lora:
        save_adapter(os.path.join(tmp, "adapter"), model, None if state["base_init"] == "scratch" else state["base_init"])
    trainer = os.path.join(tmp, "trainer")
    os.makedirs(trainer)
    opt = full.get("optimizer") or optimizer.state_dict()
    tensors = {f"{i}.{k}": v.contiguous() for i, s in opt["state"].items() for k, v in s.items()}
    save_file({**tensors, **{f"rng.{k}": v for k, v in rng_tensors.items()}}, os.path.join(trainer, "optimizer.safetensors"))
    if teacher_model is not None and lora:
        save_file({n: p.detach().contiguous() for n, p in _own_tensors(teacher_model, model).items()},
                  os.path.join(trainer, "teacher.safetensors"))
    for name, module, whole in (("teacher", teacher_model, full.get("teacher")), ("model_fp32", model, full.get("model"))):
        if module is None or lora or (name == "model_fp32" and save_dtype == "float32"):  # exact resume needs the fp32
            continue  # master weights (LoRA: the adapter is fp32; the teacher's own tensors are written above)
        path = os.path.join(trainer, f"{name}.safetensors")
        save_file(runtime.unshared(whole), path) if whole is not None else save_model(module, path)
    with open(os.path.join(trainer, "state.json.tmp"), "w") as f:
        json.dump({**state, "param_groups": opt["param_groups"]}, f, indent=1)
    umask_modes(tmp)
    os.replace(os.path.join(trainer, "state.json.tmp"), os.path.join(trainer, "state.json"))  # complete now


def write_json(path, obj):
    """A JSON file written whole or not at all (a reader never sees half of it)."""
    with disk_errors(path):
        with open(path + ".tmp", "w") as f:
            json.dump(obj, f, indent=1)
        os.chmod(path + ".tmp", _file_mode())
        os.replace(path + ".tmp", path)


def save_snapshot(folder, ckpt_dir, model, tokenizer, state_dict=None):
    """A plain HF model folder (a stage's model), written as a checkpoint is: whole, or not there.
    state_dict: a sharded model's, gathered (runtime.full_state_dict; rank 0 writes)."""
    with writing(ckpt_dir):
        with disk_errors(folder + ".tmp", _folder_bytes(ckpt_dir)):
            shutil.rmtree(folder + ".tmp", ignore_errors=True)
            _save_model_folder(folder + ".tmp", model, tokenizer, state_dict=state_dict)
            umask_modes(folder + ".tmp")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(folder + ".tmp", folder)


def _file_mode():
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def umask_modes(folder):
    """Give every file under folder the mode the umask gives a new file (0644 under umask 022):
    safetensors writes its files 0600, which another user (or a serving process) cannot read."""
    mode = _file_mode()
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), mode)


def _set_config_dtype(path, dtype):
    with open(path) as f:
        config = json.load(f)
    config["dtype"] = dtype
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def keep_as_good(ckpt_dir, good_dir):
    """ckpt_good/ <- ckpt/ as hard links (checkpoint files are never modified in place), or copies
    where the filesystem has no hard links; written as a checkpoint is (trainer/state.json last into
    ckpt_good.tmp, then swapped in), so recover() handles a crash here as it does in save()."""
    tmp, state = good_dir + ".tmp", os.path.join("trainer", "state.json")
    with writing(ckpt_dir):
        with disk_errors(tmp, _folder_bytes(ckpt_dir), keeps=good_dir):
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(ckpt_dir, tmp, copy_function=_link_or_copy,
                            ignore=lambda d, names: ["state.json"] if os.path.basename(d) == "trainer" else [])
            _link_or_copy(os.path.join(ckpt_dir, state), os.path.join(tmp, state))  # complete now
        _swap_in(tmp, good_dir)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def source_note(init):
    """For a fresh run from another run's checkpoint: which of that run's iterations it holds, and whether
    that run had more to go (it may still be training: a checkpoint is written at every eval, iteration 0
    included). None for anything that is not a nanoSDPO checkpoint (a hub model, a plain HF folder)."""
    try:
        with open(os.path.join(init, "trainer", "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        config, done = state["config"], state["iter"]
        planned = sum(iters for _, iters in parse_stages(config["stages"], config["dataset"], config["max_iters"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError):
        return None
    return f"init_from {init}: iteration {done} of the {planned} its run planned" + (
        "" if done >= planned else " (that run stopped early, or is still training)")


def read_state(ckpt_dir):
    """trainer/state.json of a checkpoint, every file it needs checked first (one line naming a damaged one)."""
    trainer = os.path.join(ckpt_dir, "trainer")
    path = os.path.join(trainer, "state.json")
    if not os.path.exists(path):
        raise UserError(f"{ckpt_dir} is not a nanoSDPO checkpoint (no trainer/state.json): set out_dir to the run to "
                        "continue, or start a new run")
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except ValueError as e:
        raise UserError(f"{path} is damaged ({e}): the checkpoint cannot be resumed") from None
    check_state(state, path)
    names = sorted(os.listdir(ckpt_dir)) + [os.path.join("trainer", n) for n in sorted(os.listdir(trainer))]
    if os.path.isdir(os.path.join(ckpt_dir, "adapter")):
        names += [os.path.join("adapter", n) for n in sorted(os.listdir(os.path.join(ckpt_dir, "adapter")))]
    for name in names:
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(ckpt_dir, name))
    return state


# ----------------------------------------------------------------------------- the state
@dataclass
class TrainState:
    """What a checkpoint saves and init_from='resume' restores: trainer/state.json (to_json, read
    back by read_state, whose STATE_TYPES it matches) and each rank's sampling RNG (save's rng_tensors)."""
    generator: torch.Generator  # this rank's sampling and density masks
    data_rng: random.Random  # the global prompt order, the same on every rank
    base_init: str  # the first run's init_from: a resume reloads it as the initial model
    world: int  # ranks; a resume needs as many (each rank's sampling RNG is saved)
    data: dict  # the task files' fingerprints; a resume checks it reads the same files
    iter: int = 0  # optimizer steps, over all stages
    stage: int = 0  # the current stage (len(stages) once all are done)
    stage_iter: int = 0  # steps into the current stage
    accuracy_matrix: dict = None  # eval_sets, stages, rows (one per finished stage), base (the initial model's row)
    guard: metrics.Guard = None  # the collapse guard's memory, from the first eval on
    base_fingerprint: list = None  # models.base_fingerprint of base_init (check_base; eval.py's base); LoRA: None

    def to_json(self, cfg):
        return {"iter": self.iter, "stage": self.stage, "stage_iter": self.stage_iter,
                "accuracy_matrix": self.accuracy_matrix, "base_init": self.base_init, "world": self.world,
                "data": self.data, "data_rng": self.data_rng.getstate(), "guard": asdict(self.guard), "config": cfg,
                "base_fingerprint": self.base_fingerprint}

    def restore(self, saved, generator_state):
        """A checkpoint's state.json (checked by read_state) and this rank's sampling RNG; False when that
        RNG state is another device type's (a CPU generator's cannot drive a CUDA one, nor the reverse)."""
        self.iter, self.stage, self.stage_iter = saved["iter"], saved["stage"], saved["stage_iter"]
        self.accuracy_matrix, self.guard = saved["accuracy_matrix"], metrics.Guard(**saved["guard"])
        self.data_rng.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in saved["data_rng"]))
        try:
            self.generator.set_state(generator_state)
        except RuntimeError:  # "Expected a CPUGeneratorImplState of size 5056" (a CUDA state is 16 bytes)
            return False
        return True


# what resuming reads from state.json, by type (a dotted key is inside the one before its dot)
STATE_TYPES = {"iter": int, "stage": int, "stage_iter": int, "world": int, "base_init": str, "config": dict,
               "data_rng": list, "param_groups": list, "data": dict, "accuracy_matrix": dict,
               "accuracy_matrix.eval_sets": list, "accuracy_matrix.stages": list, "accuracy_matrix.rows": list,
               "accuracy_matrix.base": dict, "guard": dict, "guard.best": dict, "guard.good": dict,
               "guard.bad_evals": int, "guard.losses": list}


def check_state(state, path):
    """A state.json that parses but is not one train.py wrote (a key missing, a wrong type, a
    negative count) is one line, before anything is read from it or truncated by it."""
    if not isinstance(state, dict):
        raise UserError(f"{path} holds a {type(state).__name__}, not a checkpoint's state: the checkpoint cannot be resumed")
    for key, kind in STATE_TYPES.items():
        value = state
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        low = 1 if key == "world" else 0
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < low)):
            need = f"an int >= {low}" if kind is int else f"a {kind.__name__}"
            what = "is missing" if value is None else f"is {repr(value)[:40]}, not {need}"
            raise UserError(f"{path}: {key} {what} (damaged, or not written by this train.py): the checkpoint cannot "
                            "be resumed; the previous one may be in ckpt_good/")


def check_same_run(state, world, data):
    """Besides its config (check_resume), a resumed run is the same run with as many ranks (each has
    its own sampling RNG in the checkpoint) and the same data files (size and sha256, at every save)."""
    if state["world"] != world:
        raise UserError(f"init_from=resume: the checkpoint was written by {state['world']} rank(s), this run has {world}: "
                        f"resume with {state['world']} (each rank's sampling state is in the checkpoint)")
    for key in sorted(state["data"].keys() & data.keys()):
        if state["data"][key] != data[key]:
            raise UserError(f"init_from=resume: {key} in data_dir is not the file this run trained on (size "
                            f"{state['data'][key].get('size')} -> {data[key]['size']} bytes, another sha256): point "
                            "--data_dir at the run's data, or start a new out_dir")


def check_base(state, initial_model):
    """A resumed run rereads its initial model (the KL reference, a frozen / trust-region teacher, an
    'initial' stage reset) from base_init: refuse it when those weights changed since the run began
    (the folder was trained further or replaced, a hub revision moved); older checkpoints, without a
    fingerprint, are not checked."""
    saved = state.base_fingerprint
    if saved is None:
        return
    if not is_fingerprint(saved):
        raise UserError(f"{state.base_init}: the checkpoint's base_fingerprint is {str(saved)[:40]}, not two numbers "
                        "(damaged, or not written by this train.py): the checkpoint cannot be resumed")
    if not same_fingerprint(saved, initial_model):
        raise UserError(f"init_from=resume: {state.base_init}, this run's initial model, holds other weights than when "
                        "the run began (it changed since): restore that model, or start a new out_dir")


def is_fingerprint(saved):
    """Whether a saved base_fingerprint is well-formed: two floats (models.base_fingerprint)."""
    return isinstance(saved, list) and len(saved) == 2 and all(isinstance(x, float) for x in saved)


def adapter_fingerprint(path):
    """The base fingerprint a LoRA adapter file was saved with (its metadata), or None."""
    with safe_open(path, "pt") as f:
        return json.loads((f.metadata() or {}).get("nanosdpo_base", "null"))


def same_fingerprint(saved, model):
    """Whether model's models.base_fingerprint is the saved one (sums in another order: not bit-exact)."""
    return all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(saved, base_fingerprint(model)))


def check_init_outside(init, out_dir, overwrite):
    """A fresh run from a checkpoint inside out_dir with --overwrite=True would remove the model it starts
    from (and its own checkpoints would take that path, which a resume rereads as the initial model);
    an out_dir that is the model folder, or inside it, would write the run into that folder."""
    model, out = os.path.realpath(init), os.path.realpath(out_dir)
    if init != "scratch" and os.path.isdir(init) and (out == model or out.startswith(model + os.sep)):
        raise UserError(f"out_dir={out_dir} is {'init_from' if out == model else 'inside init_from'}={init}: a run "
                        "would write into the model folder it starts from (another run's checkpoint, which that "
                        "run's next save replaces whole): give this run another out_dir")
    inside = model.startswith(out + os.sep)
    if overwrite and init != "scratch" and os.path.exists(init) and inside:
        raise UserError(f"init_from={init} is inside out_dir={out_dir}, which --overwrite=True empties: copy the "
                        "checkpoint out of it first, or give this run another out_dir")


def redo_keep_as_good(ckpt_dir, good_dir, saved):
    """ckpt/ passed the collapse guard (its guard.good is its own iteration) but the run stopped before
    ckpt_good/ became it: link it now, so that ckpt_good/ is the checkpoint the guard names."""
    if saved["guard"]["good"].get("iter") != saved["iter"]:
        return
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(os.path.join(good_dir, "trainer", "state.json"), encoding="utf-8") as f:
            if json.load(f)["iter"] == saved["iter"]:
                return
    keep_as_good(ckpt_dir, good_dir)


def kept_eval_sets(matrix, eval_names, say):
    """A resumed run scores the eval sets its accuracy matrix has: a stage added on resume (whose
    set joins the default eval sets) adds no column, which would make the matrix's rows ragged."""
    if eval_names != matrix["eval_sets"]:
        say(f"note: {', '.join(n for n in eval_names if n not in matrix['eval_sets'])} is not scored: a resumed run "
            f"keeps its accuracy matrix's eval sets ({', '.join(matrix['eval_sets'])})")
    return matrix["eval_sets"]


def fingerprints(data_dir, names_and_splits):
    """{'<set>/<split>.jsonl': {'size', 'sha256'}} of the data files a run reads ('a+b' is two sets)."""
    out = {}
    for name, split in names_and_splits:
        for part in name.split("+"):
            key = f"{part}/{split}.jsonl"
            path = os.path.join(data_dir, key)
            if key not in out and os.path.isfile(path):
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                        digest.update(block)
                out[key] = {"size": os.path.getsize(path), "sha256": digest.hexdigest()}
    return out


def check_safetensors(path):
    """A truncated or garbled safetensors file, caught from its header without reading the tensors."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        ok = os.path.getsize(path) >= 8 + n + end
    except (OSError, ValueError, struct.error, KeyError, TypeError, MemoryError):
        ok = False
    if not ok:
        raise UserError(f"{path} is damaged (truncated or not a safetensors file): the checkpoint cannot be resumed; "
                        "the previous one may be in ckpt_good/")


def load_trainer(ckpt_dir, state, model, optimizer, teacher_model):
    """The rest of a checkpoint into the freshly loaded model / optimizer / teacher; returns the RNG tensors.
    Sharded ones (parallel=fsdp) take the whole tensors and keep their shards."""
    trainer = os.path.join(ckpt_dir, "trainer")
    tensors = load_file(os.path.join(trainer, "optimizer.safetensors"))
    opt_state = {}
    for key, value in tensors.items():
        if not key.startswith("rng."):
            i, name = key.split(".", 1)
            opt_state.setdefault(int(i), {})[name] = value
    osd = {"state": opt_state, "param_groups": state["param_groups"]}
    sharded = runtime.is_sharded(model)
    runtime.load_full_optimizer_state(model, optimizer, osd) if sharded else optimizer.load_state_dict(osd)

    def into(module, path):
        runtime.load_full_state_dict(module, load_file(path)) if sharded else load_model(module, path)
    lora = bool(lora_layers(model))
    if lora:  # the base is init_from's, reloaded; the adapter is the state
        adapter = os.path.join(ckpt_dir, "adapter", "adapter_model.safetensors")
        if not os.path.exists(adapter):
            raise UserError(f"{adapter} is missing: the checkpoint has no LoRA adapter to resume (was it written "
                            "with lora_rank=0?)")
        _load_tensors(adapter_tensors(model), adapter, "the LoRA adapter")
        saved_base = adapter_fingerprint(adapter)
        if saved_base is not None and not same_fingerprint(saved_base, model):
            raise UserError(f"init_from=resume: the base {state['base_init']} holds other weights than the run's LoRA "
                            "adapter was trained on (it changed since): restore that base, or start a new out_dir")
    elif os.path.exists(os.path.join(trainer, "model_fp32.safetensors")):
        into(model, os.path.join(trainer, "model_fp32.safetensors"))
    if teacher_model is not None:
        path = os.path.join(trainer, "teacher.safetensors")
        if not os.path.exists(path):
            raise UserError(f"{path} is missing: the checkpoint has no teacher to resume")
        if lora:
            _load_tensors(_own_tensors(teacher_model, model), path, "the teacher's adapter")
        else:
            into(teacher_model, path)
    return {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}


@torch.no_grad()
def _load_tensors(params, path, what):
    """A safetensors file into {name: parameter}, exactly: the same names and shapes, or one line."""
    tensors = load_file(path)
    if set(tensors) != set(params) or any(tensors[k].shape != p.shape for k, p in params.items()):
        raise UserError(f"{path} does not hold {what} of this model ({len(tensors)} tensors, {len(params)} expected): "
                        "the checkpoint cannot be resumed with these settings")
    for k, p in params.items():
        p.copy_(tensors[k])


# ----------------------------------------------------------------------------- resuming
def check_resume(saved, cfg, saved_stages, stages, state):
    """A resumed run is the same run: refuse a changed setting (one line naming the key) unless it
    is in RESUMABLE. Its stages may grow on purpose -- more iterations in the last stage, or more
    stages -- and a finished last stage that grows is reopened (its accuracy row is redone)."""
    changed = [k for k in saved if k in cfg and k not in RESUMABLE and saved[k] != cfg[k]]
    if changed:
        k = changed[0]
        raise UserError(f"init_from=resume: {k} was {saved[k]!r} in this run, now {cfg[k]!r}: a resumed run continues "
                        "the same run; start a new out_dir (or --overwrite=True) to change it")
    grown = len(stages) >= len(saved_stages) and all(
        new == old or (i == len(saved_stages) - 1 and new[0] == old[0] and new[1] > old[1])
        for i, (old, new) in enumerate(zip(saved_stages, stages)))
    if not grown:
        raise UserError(f"init_from=resume: stages were {saved_stages}, now {stages}: a resumed run may only add "
                        "iterations to its last stage or add stages")
    last = len(saved_stages) - 1
    if stages[last][1] > saved_stages[last][1] and state["stage"] == len(saved_stages):
        state["stage"], state["stage_iter"] = last, saved_stages[last][1]
        state["accuracy_matrix"]["stages"].pop()
        state["accuracy_matrix"]["rows"].pop()
