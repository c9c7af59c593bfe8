"""
The toy suite: synthetic domains with verifiable answers, at graded distances from each other,
plus a character-level HF tokenizer with a chat template. Nothing is downloaded.

    python data/toy/prepare.py            # writes data/toy/<domain>/{train,test}.jsonl + data/toy/tokenizer/

Prompts are terse ("75+8", "sort dbca") to keep sequences short on a CPU; each domain's answer
format is learned from its SFT data. Domains (distance from `add`, the usual first stage):
    add   a+b, 2-digit + 1-digit         \\boxed{}             -- the reference domain
    sub   a-b, 2-digit - 1-digit         \\boxed{}             -- near: same format, sibling skill
    mul   a*b, 2-digit x 1-digit         \\boxed{}             -- intermediate: same format, other skill
    sort  sort 3-5 letters               <answer></answer>    -- far: strings, other format
    rev   reverse 3-5 letters            <answer></answer>    -- far, and near to `sort`
Two answer formats make format leakage measurable: a `\\boxed{}` in a string task (or an
`<answer>` tag in an arithmetic one) is another domain's format showing up.

A toy code domain, kept apart from the five (CODE_DOMAINS: the existing base's data is unchanged):
    func  find f from examples           <answer>2*x+1</answer>  -- code: run in data/sandbox.py
"f(0)=1 f(1)=3 f(2)=5 f(3)=7" asks for a Python expression in x; the code reward runs it on hidden points
(4, 5, 7, 10) and its feedback reads "f(4) gave 8, expected 9". Its teacher-context copies go to
data/toy/context_code/train.jsonl; a base that includes the domain trains on toy/func and them.

Training lines carry `solution` (the reference response, used by SFT). Copies of some of them
(CONTEXT_FRACTION per domain) in the SDPO teacher-context format (the prompt followed by a correct
solution, or by feedback on a wrong attempt) go to data/toy/context/train.jsonl, which the SFT
base trains on (mixed in, then alone) so that, like a real LLM, it learns to use a demonstration
in context; RL stages never sample them.
The teacher templates are train.py's defaults, read from its source (nothing under data/
imports train.py, or torch) so the two never disagree.
"""
import ast
import hashlib
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # the repo root, for data.checkers
from data.checkers import check_exact, check_math  # noqa: E402

DOMAINS = ["add", "sub", "mul", "sort", "rev"]
# Training lines per domain. SFT (config/toy_base.py) samples uniformly from the joined lines, so
# these counts are the base's data mix: the arithmetic skills emerge only after ~10k examples
# (mul, with its 3-digit products, after more), the string skills after ~5k.
N_TRAIN = {"add": 6000, "sub": 6000, "mul": 16000, "sort": 3500, "rev": 3000}
N_TEST = 100
# Training lines also copied in the teacher-context format (toy/context). The string domains get
# more: using a demonstration of a 3-5-letter answer in context is the hardest skill for the base.
CONTEXT_FRACTION = {"add": 0.15, "sub": 0.15, "mul": 0.15, "sort": 0.6, "rev": 0.6}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CODE_DOMAINS = ["func"]
# func is weighted like the big arithmetic sets (config/toy_base_code.py mixes it in from the first
# stage): at 4,000 lines it was the slowest toy skill and needed a func-only stage that erased the rest.
N_TRAIN["func"], CONTEXT_FRACTION["func"] = 10000, 0.3
# f(0) is shown, so each part of the answer is a skill the base has: b is f(0) copied (its sign says
# + or -), a is f(1)-f(0) (its last digit is that of f(1) minus that of f(0)), and f(1)-f(0) = 1 means
# x*x. No a*x*x+b form: `<answer>9*x*x+9</answer>` plus the end of turn is 25 tokens, over the budget.
# 2*8*50 + 2*50 = 900 distinct functions, so the 100 test ones are a small, unseen share.
FUNC_FORMS = ("{a}*x+{b}", "{a}*x-{b}", "x*x+{b}", "x*x-{b}")
FUNC_A, FUNC_B = range(2, 10), range(1, 51)
FUNC_SHOWN, FUNC_HIDDEN = (0, 1, 2, 3), (4, 5, 7, 10)
# every toy config's max_new_tokens: a func solution and its end-of-turn token always fit (one token a
# character), so no func prompt is unanswerable (tests/test_code.py checks the configs agree)
MAX_NEW_TOKENS = 24


def func_value(expr, x):
    return eval(expr, {"__builtins__": {}}, {"x": x})  # our own generated expression, never a model's


def make_task(domain, rng):
    """Return (question, answer, kind, solution)."""
    if domain == "func":
        expr = rng.choice(FUNC_FORMS).format(a=rng.choice(FUNC_A), b=rng.choice(FUNC_B))
        assert len(f"<answer>{expr}</answer>") + 1 <= MAX_NEW_TOKENS, expr
        question = " ".join(f"f({x})={func_value(expr, x)}" for x in FUNC_SHOWN)
        tests = [{"input": str(x), "output": str(func_value(expr, x)), "public": True} for x in FUNC_HIDDEN]
        answer = json.dumps({"expression": "x", "fn_name": "f", "tests": tests, "timeout": 2})
        return question, answer, "code", f"<answer>{expr}</answer>"
    if domain in ("add", "sub", "mul"):
        a = rng.randint(10, 99)
        b = rng.randint(2, 9) if domain == "mul" else rng.randint(1, 9)
        if domain == "sub" and b > a:
            a, b = b, a
        op = {"add": "+", "sub": "-", "mul": "*"}[domain]
        value = {"add": a + b, "sub": a - b, "mul": a * b}[domain]
        question = f"{a}{op}{b}"
        return question, str(value), "math", f"\\boxed{{{value}}}"
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
    if domain == "sort":
        question, value = f"sort {word}", "".join(sorted(word))
    else:
        question, value = f"reverse {word}", word[::-1]
    return question, value, "exact", f"<answer>{value}</answer>"


def wrong_attempt(solution, answer, rng):
    """A plausible wrong response: one character of the answer changed, format intact."""
    if answer.startswith("{"):  # func: one digit of the expression changed (the answer is its tests)
        expr = solution[len("<answer>"):-len("</answer>")]
        i = rng.choice([k for k, c in enumerate(expr) if c.isdigit()])
        return solution.replace(expr, expr[:i] + rng.choice([c for c in "123456789" if c != expr[i]]) + expr[i + 1:])
    i = rng.randrange(len(answer))
    pool = "0123456789" if answer[i].isdigit() else LETTERS
    wrong = answer[:i] + rng.choice([c for c in pool if c != answer[i]]) + answer[i + 1:]
    return solution.replace(answer, wrong)


def train_defaults(*names):
    """The values of train.py's default config keys `names`, read from its source."""
    with open(os.path.join(ROOT, "train.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    values = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in names}
    return [values[n] for n in names]


REPROMPT, SOLUTION, FEEDBACK = train_defaults("reprompt_template", "solution_template", "feedback_template")


def teacher_context_example(question, solution, kind, answer, rng):
    """The SDPO teacher prompt for this question (as train.teacher_prompt_text builds it): a
    correct peer, or the checker's feedback on a wrong try."""
    if rng.random() < 0.7:
        return REPROMPT.format(prompt=question, solution=SOLUTION.format(solution=solution), feedback="")
    if kind == "code":  # the code reward's feedback, computed here (a sandbox run per line would be slow)
        feedback = func_feedback(wrong_attempt(solution, answer, rng), answer)
    else:
        check = {"math": check_math, "exact": check_exact}[kind]
        feedback = check(wrong_attempt(solution, answer, rng), answer)[1]
    return REPROMPT.format(prompt=question, solution="", feedback=FEEDBACK.format(feedback=feedback))


def func_feedback(response, answer):
    """check_code's feedback on a wrong func answer: its first wrong hidden point (tests/test_toy_data
    checks that the sandboxed checker says the same)."""
    expr = response[len("<answer>"):-len("</answer>")]
    for t in json.loads(answer)["tests"]:
        got = func_value(expr, int(t["input"]))
        if str(got) != t["output"]:
            return f"f({t['input']}) gave {got}, expected {t['output']}."
    return None


def build_char_tokenizer():
    """One token per printable ASCII character (+ newline), specials as single ids, ChatML template.

    Built as a byte-level BPE with no merges and Qwen2's pre-tokenizer, so it is the tokenizer
    transformers rebuilds when it loads a checkpoint folder whose config says qwen2: a folder
    saved by train.py tokenizes exactly like data/toy/tokenizer, whichever class loads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    to_char = bytes_to_unicode()
    chars = [to_char[b] for b in [10] + list(range(32, 127))]  # newline + printable ASCII, byte-level spelled
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="",
                                fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        additional_special_tokens=specials)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def bytes_to_unicode():
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


STAMP = "prepared.sha256"  # the sha256 of this script that wrote the files (tests re-prepare on a change)


def source_hash():
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def is_current(out_root=HERE):
    """Whether out_root holds complete files written by this very script (its stamp is this script's hash)."""
    path = os.path.join(out_root, STAMP)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return f.read().strip() == source_hash()


def write_domain(domain, seed, out_root):
    """N_TEST distinct test questions, then N_TRAIN training draws (repeats allowed: some domains
    have only a few thousand distinct questions) that never hit a test question. Returns the
    teacher-context copies of CONTEXT_FRACTION[domain] of the training tasks (SFT-only data, written
    separately)."""
    context_lines = []
    rng = random.Random(f"{seed}-{domain}")
    test, seen = [], set()
    while len(test) < N_TEST:
        task = make_task(domain, rng)
        if task[0] not in seen:
            seen.add(task[0])
            test.append(task)
    train_rows = []
    while len(train_rows) < N_TRAIN[domain]:
        task = make_task(domain, rng)
        if task[0] not in seen:
            train_rows.append(task)
    rows = test + train_rows
    os.makedirs(os.path.join(out_root, domain), exist_ok=True)
    for split, part in (("test", rows[:N_TEST]), ("train", rows[N_TEST:])):
        path = os.path.join(out_root, domain, f"{split}.jsonl")
        with open(path + ".tmp", "w") as f:  # renamed into place when complete: never half-written
            for i, (question, answer, kind, solution) in enumerate(part):
                line = {"id": f"{domain}-{split}-{i}", "domain": domain, "kind": kind,
                        "messages": [{"role": "user", "content": question}],
                        "answer": answer, "solution": solution}
                f.write(json.dumps(line) + "\n")
                if split == "train" and rng.random() < CONTEXT_FRACTION[domain]:  # teacher-context copy of the same task
                    content = teacher_context_example(question, solution, kind, answer, rng)
                    context_lines.append(dict(line, id=line["id"] + "-ctx", messages=[{"role": "user", "content": content}]))
        os.replace(path + ".tmp", path)
    return context_lines


def write_context_set(name, domains):
    """Write each domain's files, and their teacher-context copies as toy/<name> (train only), so
    that SFT can mix them in (config/toy_base.py) while RL never samples a prompt that holds its
    own answer."""
    lines = [line for domain in domains for line in write_domain(domain, seed=1337, out_root=HERE)]
    os.makedirs(os.path.join(HERE, name), exist_ok=True)
    path = os.path.join(HERE, name, "train.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(path + ".tmp", path)
    return lines


if __name__ == "__main__":
    if sys.argv[1:]:  # its sets are fixed (seeded in this file): a flag here would be ignored, silently
        sys.exit(f"error: data/toy/prepare.py takes no arguments (got {' '.join(sys.argv[1:])}): run it alone")
    context = write_context_set("context", DOMAINS)
    code_context = write_context_set("context_code", CODE_DOMAINS)
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(os.path.join(HERE, "tokenizer"))
    with open(os.path.join(HERE, STAMP), "w") as f:  # last: the files above are complete and from this script
        f.write(source_hash() + "\n")
    counts = ", ".join(f"{d} {N_TRAIN[d]}" for d in DOMAINS + CODE_DOMAINS)
    print(f"wrote train ({counts}) and test ({N_TEST} each) sets, {len(context)} teacher-context "
          f"training lines in context/train.jsonl ({len(code_context)} for the code domain in context_code/) "
          f"and a {len(tokenizer)}-token character tokenizer to {HERE}")
