"""
The SDPO teacher: whose weights read the teacher prompt (train.py step 4), what logits it gives the
token loss, how it follows the student, and what eval scores as it. train.py builds the teacher's
prompt (teacher context); this module owns its weights. Adding a kind: a row in Teacher's table
and in KINDS below (train.py's CHOICES and checks read KINDS), and its branches in Teacher's methods.
"""
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from configurator import UserError
from models import ModelError, adapter_copy, frozen_copy, lm_head, load_model, lora_layers, shared_prompt_hidden
from runtime import is_sharded, local, shard_like


class Kind(NamedTuple):
    """What a teacher kind holds and reads: the facts that setup, train.py's config checks and the memory
    estimate ask of it (how it behaves is in Teacher's methods)."""
    own_copy: bool  # its own weights: made at setup, saved in checkpoints, teacher_init mixed in, sharded under fsdp
    reads_initial: bool  # reads the initial model (setup keeps a frozen copy of it)
    reads_student: bool  # reads the student's weights in its forwards (refused under parallel=fsdp: ranks run them unevenly)
    uses_rate: bool  # teacher_rate is its rate (τ, μ): a run of another kind notes that the setting does nothing


KINDS = {  # Teacher's table below, as the code reads it; CHOICES["teacher"] in train.py is its keys
    "frozen": Kind(own_copy=True, reads_initial=True, reads_student=False, uses_rate=False),
    "ema": Kind(own_copy=True, reads_initial=False, reads_student=False, uses_rate=True),
    "trust_region": Kind(own_copy=False, reads_initial=True, reads_student=True, uses_rate=True),
    "live": Kind(own_copy=False, reads_initial=False, reads_student=True, uses_rate=False),
}


def shares_initial_model(cfg):
    """Whether the frozen teacher is the initial model itself rather than a copy of it: both are the
    weights the run started from, neither ever changes, so one copy serves both (the memory of a whole
    fp32 model) -- unless teacher_init mixes another model into the teacher, or teacher_stage_reset=student
    makes it a copy of the student at a stage boundary."""
    return cfg["teacher"] == "frozen" and not cfg["teacher_init"] and cfg["teacher_stage_reset"] != "student"


class TeacherLogits(NamedTuple):
    """One model's share of the teacher's logits at a micro-batch's response tokens (no grad): the
    token loss takes the teacher's logits as sum(coef · hidden @ weight.T) over the shares, / T."""
    hidden: torch.Tensor  # [N, H] final hidden states; zero rows for responses without a teacher prompt
    weight: torch.Tensor  # [V, H] that model's LM head (detached)
    coef: float  # the share's weight in the mixture × the model's logit scale


@dataclass
class Teacher:
    """The SDPO teacher: which weights read the teacher prompt, kept apart from the student.

        kind          teacher weights                  after each step              at eval
        frozen        the initial model (teacher_init)  nothing                      its weights
        ema           its own copy                      θ_T ← (1−τ)θ_T + τθ          its own copy
        trust_region  logits (1−μ)·initial + μ·student  nothing (the student moves)  not scored (below)
        live          the student itself                nothing                      the student

    τ = μ = teacher_rate. teacher_stage_reset ('student' / 'initial') reloads the own copy at a stage
    boundary; live and trust_region have none to reload. The frozen teacher is the initial model itself,
    one copy for both (shares_initial_model), unless teacher_init or a 'student' reset makes it differ.
    trust_region is not scored at eval: sampling from a logit mixture needs two KV caches in one decode
    loop, which generate() does not have.

    Under LoRA (lora_rank > 0) the teacher shares the student's frozen base, no second model in
    memory: frozen is the base with the adapter off (models.base_view, which is also trust_region's
    initial model and the KL reference), ema the base with its own adapter copy (models.adapter_copy),
    and its update moves only that copy. That EMA averages the factors A and B each on its own, so
    the teacher's B_T·A_T is not quite the average of the student's B·A.
    Adding a kind: a row here and in KINDS, and its lines in the methods below."""
    kind: str
    rate: float
    own: torch.nn.Module = None  # a kind with own_copy (frozen, ema): the teacher's weights
    initial: torch.nn.Module = None  # trust_region: the initial model, the mixture's (1 − μ) share
    own_is_initial: bool = False  # the frozen teacher is the initial model itself (shares_initial_model)

    @property
    def checkpointed(self):
        """The weights a checkpoint keeps for the teacher: its own copy, unless that is the initial model,
        which a resume rereads from base_init (checked against its fingerprint): a second copy of the
        base in every checkpoint (16 GB at 4B in fp32) would hold nothing new."""
        return None if self.own_is_initial else self.own

    @staticmethod
    def needs_initial(kind):
        """Whether the kind reads the initial model (setup keeps a frozen copy of it)."""
        return KINDS[kind].reads_initial

    @classmethod
    def create(cls, cfg, model, initial_model, teacher_init=None):
        """The run's teacher (None unless algo='sdpo'); a resumed run loads its own copy afterwards.
        teacher_init: a fresh run's load_teacher_init model, mixed into the teacher's own copy."""
        if cfg["algo"] != "sdpo":
            return None
        own = None
        if initial_model is not None and shares_initial_model(cfg):  # (under LoRA, the base view)
            own = initial_model  # (a resumed run loads the checkpoint's teacher into it: the same weights)
        elif KINDS[cfg["teacher"]].own_copy and lora_layers(model):
            own = adapter_copy(model)
        elif KINDS[cfg["teacher"]].own_copy:
            own = frozen_copy(initial_model if initial_model is not None else model)
            if teacher_init is not None:
                # θ_T ← (1 − a)·θ_T + a·θ_init: the EMA update's formula, applied once (shard by shard when sharded)
                ema_update(own, shard_like(teacher_init, own) if is_sharded(own) else teacher_init, cfg["teacher_init_alpha"])
        return cls(cfg["teacher"], cfg["teacher_rate"], own=own, own_is_initial=own is not None and own is initial_model,
                   initial=initial_model if cfg["teacher"] == "trust_region" else None)

    def logits(self, student, teacher_prompts, responses, dev):
        """The teacher's logits at every response token as [TeacherLogits] (the model's logit scale
        folded into coef); rows of responses without a teacher prompt stay zero (they are outside
        div_rows). No grad."""
        has = [i for i, t in enumerate(teacher_prompts) if t is not None]
        lengths = [len(r) for r in responses]
        starts = [0, *itertools.accumulate(lengths)]
        index = torch.tensor([starts[i] + t for i in has for t in range(lengths[i])], device=dev)

        def share(m, coef):
            h = shared_prompt_hidden(m, [teacher_prompts[i] for i in has], [responses[i] for i in has], dev)
            weight, scale = lm_head(m)
            return TeacherLogits(h.new_zeros(sum(lengths), h.shape[-1]).index_copy_(0, index, h), weight.detach(),
                                 coef * scale)

        with torch.no_grad():
            if KINDS[self.kind].own_copy:
                return [share(self.own, 1.0)]
            if self.kind == "live":
                return [share(student, 1.0)]
            return [share(self.initial, 1.0 - self.rate), share(student, self.rate)]  # trust_region

    def after_step(self, student):
        """The per-step update, after each optimizer step (identical on every rank)."""
        if self.kind == "ema":
            ema_update(self.own, student, self.rate)

    def start_stage(self, reset, student, initial_model):
        """A stage boundary: teacher_stage_reset 'student' or 'initial' reloads the own copy ('initial': the
        run's initial model, the student's start, so a teacher_init mixed in at setup is left out). Under
        LoRA a frozen teacher is the initial model already, and an EMA one goes back to it with B = 0 (its
        adapter then adds nothing: the base view has no adapter to copy)."""
        if self.own is None or reset == "keep" or self.own is initial_model:
            return
        if reset == "initial" and lora_layers(self.own):
            with torch.no_grad():
                for name, p in self.own.named_parameters():
                    if ".lora_B." in name:
                        p.zero_()
            return
        self.own.load_state_dict((student if reset == "student" else initial_model).state_dict())

    def eval_model(self, student):
        """The model scored at eval reading the reference solution (None: this kind is not scored)."""
        return self.own if KINDS[self.kind].own_copy else {"live": student}.get(self.kind)


def load_teacher_init(cfg, student, load_dev):
    """A fresh run's teacher_init model (None without one), loaded on load_dev (the CPU under
    parallel=fsdp) before the run touches out_dir, and refused in one line unless its parameters
    have the student's names and shapes (the EMA formula mixes them one by one)."""
    if not cfg["teacher_init"]:
        return None
    try:
        init = load_model(cfg["teacher_init"], load_dev, scratch=cfg, with_tokenizer=False)[0]
    except ModelError as e:  # its line names the model; this one names the setting too (init_from's is the student's)
        raise ModelError(f"teacher_init: {e}") from None
    want = {n: tuple(p.shape) for n, p in student.named_parameters()}
    got = {n: tuple(p.shape) for n, p in init.named_parameters()}
    if got != want:
        differ = next((n for n in want if got.get(n) != want[n]), None) or next(n for n in got if n not in want)
        raise UserError(f"teacher_init={cfg['teacher_init']} is not the student's architecture ({differ}: "
                        f"{got.get(differ)} vs the student's {want.get(differ)}): give a checkpoint of the same model")
    return init


@torch.no_grad()
def ema_update(teacher_model, student_model, rate):
    """θ_T ← (1 − rate)·θ_T + rate·θ, once per optimizer step; tensors the two share (a LoRA teacher's
    base) are left alone. Sharded alike (parallel=fsdp), each rank updates its own shards: the same
    elementwise update, no communication."""
    pairs = [(t, s) for t, s in zip(teacher_model.parameters(), student_model.parameters()) if t is not s]
    if pairs:
        torch._foreach_lerp_([local(t) for t, _ in pairs], [local(s.detach()) for _, s in pairs], rate)
