"""
Answer checkers: does a response's final answer match the reference? Standard library only, so
that the prepare scripts, eval tools and train.py can all import it without torch.

Each checker takes (response, answer) and returns (score in [0, 1], feedback str or None):
  check_math   the last \\boxed{...} (or \\fbox{}), normalised and compared for equivalence
  check_mcq    the letter in the last <answer>...</answer> (else \\boxed{X}, else "the answer is (X)")
  check_tool   ReAct "Action: name / Action Input: {json}": the calls, each an (action name, Action
               Input object) pair, must equal the reference's as a multiset (in any order); JSON
               values compare by type (true is not 1). Stricter than the SDPO paper's ToolAlpaca
               check (the names as a multiset, the Action Inputs merged), under which a repeated
               action's calls in another order fail and its last call written twice passes
  check_exact  the stripped content of the last <answer>...</answer> equals the answer (toy suite)
  check_code   the last fenced block, run against the answer's unit tests in data/sandbox.py
CHECKS (at the end) maps each task's `kind` to one of them: train.py's reward() dispatch, and the
kinds task files may use.

Feedback is None on success, else a short text for the SDPO teacher prompt (code: the failing public
test's input, expected and got output, up to 1500 characters); it never reveals the reference answer
or a hidden test. The checkers take bounded time on any string: they read a bounded slice of a
response (its end, TAIL_CHARS; tool calls its first TOOL_CHARS; code its last CODE_CHARS), compare
answers structurally only when they are short (MAX_ANSWER_CHARS), and decide symbolic equivalence
by evaluating both sides at fixed sample points with a tiny AST evaluator over complex floats (no
eval, no sympy, no big-int power towers). The common case (an exact or a plain-number answer) takes
microseconds. train.py still wraps every call in a try/except: a checker bug must not stop training.
"""
import ast
import cmath
import functools
import json
import re
from collections import Counter
from fractions import Fraction

TAIL_CHARS = 20_000       # final answers sit at the end of a response: look no further back
MAX_ANSWER_CHARS = 400    # longer "answers" are compared verbatim (minus spaces), not parsed
TOOL_CHARS = 100_000      # tool calls: parse at most this many leading characters
MAX_TOOL_CALLS = 64
TRUNCATED_FEEDBACK = "The response was cut off before a final answer."


def final_answer(kind, response, answer=None):
    """The final answer the checker of `kind` reads, or None when there is none (or it is blank).

    math: the last \\boxed{}; exact: the last <answer>…</answer>; mcq: that tag, else a
    \\boxed{}, else "the answer is (X)"; tool: the Action names; code: the last fenced block, or
    for an expression task (its `answer` names an "expression") the last <answer>…</answer>, else
    that block, as check_code reads it. Used to measure empty answers."""
    try:
        text = "" if response is None else str(response)
        if kind == "math":
            got = _last_boxed(text)[0]
        elif kind == "exact":
            got = _last_tag(text)[0]
        elif kind == "mcq":
            got = _last_tag(text)[0]
            if got is None:
                got = _last_boxed(text)[0]
            if got is None:
                got = _answer_is_letter(text)
        elif kind == "tool":
            got = " ".join(name for name, _ in _parse_tool_calls(text)[0])
        elif kind == "code" and code_expression(answer):
            got = expression_text(text)[0]
        elif kind == "code":
            got = code_block(text, code_entry(answer))[0]
        else:
            got = text
    except Exception:  # hostile text never raises
        return None
    return got if got is not None and got.strip() else None


def answer_text(answer):
    """A reference answer as text: 27.0 -> '27' (AMC stores floats), lists/dicts as JSON, None -> ''."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, (list, dict)):
        return json.dumps(answer)
    return "" if answer is None else str(answer)


def answer_problem(kind, answer):
    """Why a reference answer cannot be right for its kind (one phrase), or None: an mcq answer
    must be a letter, a tool answer the JSON list of {"Action", "Action_Input"} calls check_tool
    reads. Checked when a task file is read or written: a reference no response can ever match
    would otherwise score every rollout 0, forever, without a word."""
    text = answer_text(answer)
    if not text.strip():
        return "answer is missing or empty: every task needs a reference answer"
    if kind == "mcq" and _mcq_letter(text) is None:
        return f"an mcq answer must be one option letter like 'B', not {_clip_text(text, 40)!r}"
    if kind == "tool":
        try:
            _tool_reference(text)
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            return f"a tool answer must be a JSON list of {{\"Action\": name, \"Action_Input\": JSON object}} calls ({e})"
    if kind == "code" and (error := code_answer_error(answer)):
        return f"answer: {error} (see data/checkers.py, the code section)"
    return None


def _clip_text(s, n=80):
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n] + "..."


# --- locating the final answer -----------------------------------------------------------------

_BRACE_RE = re.compile(r"[{}]")
_BARE_ARG_RE = re.compile(r"[^\s$]+")


def _match_brace(s, i):
    """Index of the '}' closing the '{' at s[i], or None (unbalanced). Linear time."""
    depth = 0
    for m in _BRACE_RE.finditer(s, i):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


def _last_boxed(text):
    """(content of the last \\boxed{}/\\fbox{}, status): status is 'ok', 'none' or 'unclosed'."""
    tail = text[-TAIL_CHARS:]
    start, cmd = max((tail.rfind(c), c) for c in ("\\boxed", "\\fbox", "\\framebox"))
    if start < 0:
        return None, "none"
    i = start + len(cmd)
    while i < len(tail) and tail[i] == " ":
        i += 1
    if i < len(tail) and tail[i] == "{":
        end = _match_brace(tail, i)
        return (None, "unclosed") if end is None else (tail[i + 1:end], "ok")
    m = _BARE_ARG_RE.match(tail, i)  # the "\boxed 5" form
    return (m.group(), "ok") if m else (None, "unclosed")


def boxed_answer(text):
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, or None."""
    try:
        return _last_boxed(str(text))[0]
    except Exception:
        return None


def _last_tag(text, tag="answer"):
    """(stripped content of the last <tag>...</tag>, status 'ok' | 'none' | 'unclosed')."""
    tail = text[-TAIL_CHARS:]
    spellings = (tag, tag.capitalize(), tag.upper())  # not tail.lower(): it can change the length
    i = max(tail.rfind(f"<{t}>") for t in spellings)
    if i < 0:
        return None, "none"
    ends = [j for j in (tail.find(f"</{t}>", i) for t in spellings) if j >= 0]
    if not ends:
        return None, "unclosed"
    return tail[i + len(tag) + 2:min(ends)].strip(), "ok"


# --- math ----------------------------------------------------------------------------------------

def check_math(response, answer, equal=None):
    """The last \\boxed{} of the response against the reference; equal(pred, answer) decides
    (default math_equal)."""
    pred, status = _last_boxed(response)
    if status == "unclosed":
        return 0.0, TRUNCATED_FEEDBACK
    if not pred or not pred.strip():
        return 0.0, "No final answer found: put it in \\boxed{}."
    if (equal or math_equal)(pred, answer):
        return 1.0, None
    return 0.0, f"Your final answer {_clip_text(pred)} is wrong."


def check_math_verify(response, answer):
    """check_math with HF's math-verify deciding the equivalence (math_checker='math_verify'; pip
    install math-verify): the same final answer (the last \\boxed{}) and the same feedback, but both
    sides parsed to sympy. Slower (milliseconds, not microseconds) and stricter on some formats."""
    from math_verify import parse, verify  # optional: imported only when asked for
    return check_math(response, answer, equal=lambda pred, ref: verify(_math_verify_reference(ref),
                                                                       parse(f"\\boxed{{{pred}}}")))


@functools.lru_cache(maxsize=1024)
def _math_verify_reference(answer):
    """math-verify's parse of the reference, once per answer (a group's responses share it)."""
    from math_verify import parse
    return parse(f"\\boxed{{{answer}}}")


_REWRITES = {"{,}": ",", "\u2212": "-", "\u2013": "-", "\u03c0": "\\pi", "\u221a": "\\sqrt", "\u00d7": "\\times",
            "\u00b7": "\\cdot", "\u00f7": "\\div", "\u221e": "\\infty", "\u00b0": "", "\u00a0": " ",
            "\u222a": "\\cup", "\\lbrace": "\\{", "\\rbrace": "\\}", "\\dfrac": "\\frac",
            "\\tfrac": "\\frac", "\\displaystyle": "", "\\left": "", "\\right": "",
            "^{\\circ}": "", "^\\circ": "", "\\circ": "", "\\degree": "", "\\%": "", "%": "",
            "\\$": "", "$": ""}
_SPACING_RE = re.compile(r"\\[!,;:>]|\\q?quad(?![a-zA-Z])|~|(?<!\\)\\ |\n|\t")
_TEXT_CMDS = r"text|textbf|textit|textrm|textsf|mathrm|mathbf|mathit|mathsf|mbox|boldsymbol|bm|operatorname"
_TEXT_CMD_RE = re.compile(rf"\\(?:{_TEXT_CMDS})\s*\{{")
_UNITS = (r"dollars?|cents?|units?|degrees?|radians?|cm|mm|km|meters?|metres?|inch(?:es)?|feet|"
          r"foot|ft|yards?|miles?|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|"
          r"years?|mph|kg|grams?|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|gallons?|people|"
          r"persons?|students?|times|points?|percent")
# units after a number: "5.4 \text{ cents}", "864 \mbox{ inches}^2", "18 dollars", "15 cm^2"
_UNIT_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm|textrm)\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?[23]\}?)?$")
_UNIT_WORD_RE = re.compile(rf"\s(?:(?:square|sq\.?|cubic)\s+)?(?:{_UNITS})\.?(?:\^\{{?[23]\}}?)?$")
_SPACE_RE = re.compile(r" (?![a-zA-Z])|(?<![a-zA-Z]) ")   # keep a space only between two letters
# "x = -2 \text{ or } x = 1", "3, 5, \text{and } 7", "1 and 2": a list of solutions
_CONJ_RE = re.compile(r"\s*,?\s*\\(?:text|textrm|mathrm|mbox)\{\s*,?\s*(?:or|and)\s*,?\s*\}\s*"
                      r"|(?<=[\d)\]}])\s*,?\s+(?:or|and)\s+(?=[-+\d\\(\[a-zA-Z])")
_PLUS_INFTY_RE = re.compile(r"(^|[(\[,\s])\+\s*\\infty")   # a unary +\infty is \infty
_LIST_OF_NUMBERS_RE = re.compile(r"\d,\s+\d")   # "2, 100" is two numbers, "2,100" may be one
# "x=", "\theta=", "a_1=", "f(x)=", "f(2)=", "AB=" (a segment), "x\in"
_LHS_RE = re.compile(r"^(?:[a-zA-Z]|[A-Z]{2,3}|\\[a-zA-Z]+)(?:_\{?\w+\}?)?(?:\([a-zA-Z0-9]+\))?(?:=|\\in(?![a-zA-Z]))")
_RHS_VARIABLE_RE = re.compile(r"(?P<value>[^=]+)=[a-zA-Z]")  # "5=x"
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CMD_RE = re.compile(r"\\[a-zA-Z]+")
_WORD_RE = re.compile(r"[a-zA-Z]{2,}")


def normalize_math_answer(s):
    """A canonical string for a final answer (with or without \\boxed): the cheap part of
    equivalence. Strips $, spacing, \\left/\\right, \\text{}, units, degrees, percent,
    "x =", thousands separators, redundant parentheses; fixes \\frac12 and \\sqrt2."""
    s = "" if s is None else str(s)
    if len(s) > MAX_ANSWER_CHARS:
        return "".join(s.split())
    try:
        return _normalize_answer(s)
    except Exception:
        return "".join(s.split())


@functools.lru_cache(maxsize=1 << 14)   # reference answers are normalised over and over
def _normalize_answer(s):
    s = s.strip()
    if "box" in s:  # \boxed, \fbox, \framebox
        inner = boxed_answer(s)
        if inner is not None:
            s = inner
    for k, v in _REWRITES.items():
        if k in s:
            s = s.replace(k, v)
    spaced_list = _LIST_OF_NUMBERS_RE.search(s) is not None  # a typed space, not LaTeX's 10,\!080
    s = _SPACING_RE.sub(" ", s).strip()
    s = _PLUS_INFTY_RE.sub(r"\1\\infty", _CONJ_RE.sub(",", s))
    s = s.rstrip(". ")  # "18\text{ dollars}.": the unit is at the end once the period is gone
    for rx in (_UNIT_TEXT_RE, _UNIT_WORD_RE):  # units only after a number: "5 \text{ cm}", not "\text{east}"
        m = rx.search(s)
        if m and any(c.isdigit() for c in s[:m.start()]):
            s = s[:m.start()].strip()
    s = _unwrap_cmds(s, _TEXT_CMD_RE)
    s = _SPACE_RE.sub("", " ".join(s.split()))
    s = _fix_shorthand(s)
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    s = re.sub(r"_\{(\w+)\}", r"_\1", s)
    s = s.rstrip(".").strip()
    s = _strip_lhs(s)
    if not spaced_list and _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return _unparen(s)


def _unwrap_cmds(s, rx):
    """\\text{X} -> X for every command matched by rx."""
    i = 0
    while True:
        m = rx.search(s, i)
        if not m:
            return s
        end = _match_brace(s, m.end() - 1)
        if end is None:
            return s
        s = s[:m.start()] + s[m.end():end] + s[end + 1:]
        i = m.start()


def _read_arg(s, i):
    """One LaTeX argument at s[i:]: a {group}, a \\command or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] == "{":
        end = _match_brace(s, i)
        if end is None:
            raise ValueError("unbalanced")
        return s[i + 1:end], end + 1
    m = _CMD_RE.match(s, i)
    if m:
        return m.group(), m.end()
    return s[i], i + 1


def _fix_shorthand(s):
    """\\frac12 -> \\frac{1}{2}, \\frac9{19} -> \\frac{9}{19}, \\sqrt2 -> \\sqrt{2}."""
    if "\\frac" not in s and "\\sqrt" not in s:
        return s
    try:
        out, i = [], 0
        while i < len(s):
            if s.startswith("\\frac", i) and not s[i + 5:i + 6].isalpha():
                a, i = _read_arg(s, i + 5)
                b, i = _read_arg(s, i)
                out.append("\\frac{%s}{%s}" % (_fix_shorthand(a), _fix_shorthand(b)))
            elif s.startswith("\\sqrt", i) and not s[i + 5:i + 6].isalpha():
                i, index = i + 5, ""
                if s[i:i + 1] == "[":
                    close = s.index("]", i)
                    index, i = s[i:close + 1], close + 1
                a, i = _read_arg(s, i)
                out.append("\\sqrt%s{%s}" % (index, _fix_shorthand(a)))
            else:
                out.append(s[i])
                i += 1
        return "".join(out)
    except ValueError:
        return s


def _strip_lhs(s):
    """'x=5' -> '5', 'f(x)=x^2' -> 'x^2', 'AB=2\\sqrt{3}' -> '2\\sqrt{3}', 'x\\in[-2,7]' -> '[-2,7]', and
    the other way round '5=x' -> '5' when the value is a constant (not '5x-7y=0', not 'x+y=z')."""
    m = _LHS_RE.match(s)
    if m and m.end() < len(s) and "=" not in s[m.end():]:
        return s[m.end():]
    m = _RHS_VARIABLE_RE.fullmatch(s)
    if m and not re.search(r"[a-zA-Z]", _CMD_RE.sub("", m.group("value"))):
        return m.group("value")
    return s


def _close_of(s, i):
    """Index of the bracket closing the one at s[i] (any of ( [ { vs ) ] }), or None."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _unparen(s):
    """'(5)' -> '5' (and '\\text{(C)}' -> 'C' once normalize_math_answer has dropped the \\text); a tuple
    '(1,2)' or a product '(a+1)(b+2)' stays."""
    while len(s) >= 2 and s[0] == "(" and _close_of(s, 0) == len(s) - 1 and len(_split_top(s[1:-1], ",")) == 1:
        s = s[1:-1]
    return s


def _split_top(s, sep):
    """Split s at sep where it is outside every bracket."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _expand_pm(items):
    """'1\\pm\\sqrt{19}' -> ['1+\\sqrt{19}', '1-\\sqrt{19}']."""
    out = []
    for x in items:
        parts = _split_top(x, "\\pm")
        out.extend([parts[0] + "+" + parts[1], parts[0] + "-" + parts[1]] if len(parts) == 2 else [x])
    return [_unparen(_strip_lhs(x)) for x in out]


_MATRIX_RE = re.compile(r"\\begin\{([pbvBV]?matrix)\}(.*)\\end\{\1\}", re.S)


def _math_structure(s):
    """(kind, elements): 'atom', a tuple/interval by its brackets '()' '(]' '[)' '[]', an
    unordered 'list' / 'set' / 'union', a column vector 'vec' or 'matrix<r>x<c>'."""
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return "union", parts
    m = _MATRIX_RE.fullmatch(s)
    if m:
        rows = [r.split("&") for r in m.group(2).split("\\\\") if r.strip()]
        if rows and all(len(r) == 1 for r in rows):
            return "vec", [r[0] for r in rows]
        return f"matrix{len(rows)}x{len(rows[0]) if rows else 0}", [c for r in rows for c in r]
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set", _expand_pm(_split_top(s[2:-2], ","))
    if s[:1] in "([" and s[-1:] in ")]" and _close_of(s, 0) == len(s) - 1:
        items = _split_top(s[1:-1], ",")
        if len(items) > 1:
            return s[0] + s[-1], [_unparen(_strip_lhs(x)) for x in items]
    items = _expand_pm(_split_top(s, ","))
    return ("list", items) if len(items) > 1 else ("atom", [s])


_UNORDERED = ("list", "set", "union")
_SAME_KIND = ({"list", "set"}, {"()", "vec"})
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)|[+-]?\d+/\d+")
_FRAC_RE = re.compile(r"([+-]?)(\d*)\\frac\{([+-]?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}")


def _as_fraction(s):
    """An exact rational for a plain number: 27, 27.0, .5, 3/4, \\frac{3}{4}, -\\frac34, 1\\frac{4}{5}."""
    try:
        if _PLAIN_NUMBER_RE.fullmatch(s):
            return Fraction(s)
        m = _FRAC_RE.fullmatch(s)
        if m:
            sign, whole, a, b = m.groups()
            v = Fraction(a) / Fraction(b) + (int(whole) if whole else 0)  # 1\frac{4}{5} is a mixed number
            return -v if sign == "-" else v
    except (ValueError, ZeroDivisionError):
        pass
    return None


def math_equal(pred, ref):
    """True when two final answers (either may be wrapped in \\boxed) are equivalent."""
    try:
        pred, ref = str(pred).strip(), str(ref).strip()
        if pred == ref and pred:
            return True
        a, b = normalize_math_answer(pred), normalize_math_answer(ref)
        if not a or not b:
            return False
        if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
            return a == b
        return _math_equal_norm(a, b, 0)
    except Exception:
        return False


def _math_equal_norm(a, b, depth):
    if a == b:
        return True
    if depth > 3:
        return False
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb  # exact: 0.5 == 1/2, 27.0 == 27, but 0.33 != 1/3
    ka, ea = _math_structure(a)
    kb, eb = _math_structure(b)
    if ka != "atom" or kb != "atom":
        if not (ka == kb or any({ka, kb} <= k for k in _SAME_KIND)) or len(ea) != len(eb) or len(ea) > 32:
            return False
        if ka in _UNORDERED:  # solutions "1,-2" == "-2,1": greedy matching
            left = list(eb)
            for x in ea:
                j = next((j for j, y in enumerate(left) if _math_equal_norm(x, y, depth + 1)), None)
                if j is None:
                    return False
                del left[j]
            return True
        return all(_math_equal_norm(x, y, depth + 1) for x, y in zip(ea, eb))
    if _is_word(a) or _is_word(b):  # "\text{Evelyn}": compare as text, never as e*v*e*l*y*n
        return a.lower() == b.lower()
    return _numeric_equal(a, b)


def _is_word(s):
    return _WORD_RE.search(_CMD_RE.sub(" ", s)) is not None


# Symbolic equivalence: translate the (normalised) LaTeX into a small Python expression, parse it
# with ast (never eval) and evaluate both sides at a few fixed points with complex arithmetic.
# Overflow or a domain error at a point just skips that point.
_MATH_FUNCS = {"sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan, "cot": lambda z: 1 / cmath.tan(z),
               "sec": lambda z: 1 / cmath.cos(z), "csc": lambda z: 1 / cmath.sin(z), "arcsin": cmath.asin,
               "arccos": cmath.acos, "arctan": cmath.atan, "sinh": cmath.sinh, "cosh": cmath.cosh,
               "tanh": cmath.tanh, "ln": cmath.log, "log": cmath.log, "exp": cmath.exp, "sqrt": cmath.sqrt}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "kappa",
          "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi", "varphi", "chi", "psi", "omega"}
_SAMPLE_POINTS = (0.5772156649, 1.4142135623, 0.8346268416, 1.2020569031, 0.3183098861, 1.6180339887,
                  0.9159655941, 0.6931471805, 1.7320508075, 0.2614972128, 1.3063778838)
_DIGITS_RE = re.compile(r"\d+\.?\d*|\.\d+")


def _latex_to_py(s):
    """Python expression text for a LaTeX expression, or None when out of scope."""
    out, i, prev = [], 0, False  # prev: the last token ends an operand (juxtaposition = product)

    def operand(tok):
        nonlocal prev
        if prev:
            out.append("*")
        out.append(tok)
        prev = True

    while i < len(s):
        c = s[i]
        if c in "0123456789" or (c == "." and s[i + 1:i + 2].isdigit()):
            m = _DIGITS_RE.match(s, i)
            operand(repr(float(m.group())))
            i = m.end()
        elif c.isalpha():
            operand({"e": "c_e", "i": "c_i"}.get(c, "v_" + c))
            i += 1
        elif c == "\\":
            m = _CMD_RE.match(s, i)
            if not m:
                return None
            name, i = m.group()[1:], m.end()
            if name == "frac":
                a, i = _read_arg(s, i)
                b, i = _read_arg(s, i)
                pa, pb = _latex_to_py(a), _latex_to_py(b)
                if pa is None or pb is None:
                    return None
                operand(f"(({pa})/({pb}))")
            elif name == "sqrt":
                index = None
                if s[i:i + 1] == "[":
                    close = s.index("]", i)
                    index, i = _latex_to_py(s[i + 1:close]), close + 1
                a, i = _read_arg(s, i)
                pa = _latex_to_py(a)
                if pa is None:
                    return None
                operand(f"f_sqrt({pa})" if index is None else f"(({pa})**(1/({index})))")
            elif name in ("cdot", "times", "div"):
                out.append("/" if name == "div" else "*")
                prev = False
            elif name == "pi":
                operand("c_pi")
            elif name in _GREEK:
                operand("v_" + name)
            elif name in _MATH_FUNCS:
                while s[i:i + 1] == " ":
                    i += 1
                if s[i:i + 1] == "(":
                    operand("f_" + name)
                    prev = False  # the "(" that follows is its argument list
                else:
                    a, i = _read_arg(s, i)
                    pa = _latex_to_py(a)
                    if pa is None:
                        return None
                    operand(f"f_{name}({pa})")
            else:
                return None
        elif c in "+-*/":
            out.append(c)
            prev, i = False, i + 1
        elif c == "^":
            a, i = _read_arg(s, i + 1)
            pa = _latex_to_py(a)
            if pa is None or not out:
                return None
            out.append(f"**({pa})")
            prev = True
        elif c == "{":
            a, i = _read_arg(s, i)
            pa = _latex_to_py(a)
            if pa is None:
                return None
            operand(f"({pa})")
        elif c == "(":
            operand("(")
            prev, i = False, i + 1
        elif c == ")":
            out.append(")")
            prev, i = True, i + 1
        elif c == " ":
            i += 1
        else:
            return None
    return " ".join(out)


def _eval_expr(node, env):
    t = type(node)
    if t is ast.Constant and type(node.value) in (int, float):
        return complex(node.value)
    if t is ast.Name:
        return env[node.id]
    if t is ast.UnaryOp and type(node.op) in (ast.USub, ast.UAdd):
        v = _eval_expr(node.operand, env)
        return 0j - v if type(node.op) is ast.USub else v  # -(4+0j) is -4-0j, whose sqrt is -2i
    if t is ast.BinOp:
        a, b, op = _eval_expr(node.left, env), _eval_expr(node.right, env), type(node.op)
        if op is ast.Add:
            return a + b
        if op is ast.Sub:
            return a - b
        if op is ast.Mult:
            return a * b
        if op is ast.Div:
            return a / b
        if op is ast.Pow:
            return a ** b  # complex floats: OverflowError, never a huge integer
    if t is ast.Call and type(node.func) is ast.Name and node.func.id[2:] in _MATH_FUNCS and len(node.args) == 1:
        return _MATH_FUNCS[node.func.id[2:]](_eval_expr(node.args[0], env))
    raise ValueError("unsupported expression")


def _compile_expr(s):
    """(ast, variable names) for a side of an (in)equation, or None."""
    py = _latex_to_py(s)
    if not py:
        return None
    tree = ast.parse(py, mode="eval").body
    return tree, {n.id for n in ast.walk(tree) if type(n) is ast.Name and n.id.startswith("v_")}


def _sample_values(trees, names):
    """Each tree evaluated at 3 fixed points; None where any evaluation failed."""
    names = sorted(names)
    if len(names) > len(_SAMPLE_POINTS):
        return None
    rows = []
    for p in range(3):
        env = {"c_pi": cmath.pi, "c_e": cmath.e, "c_i": 1j}
        env.update({n: _SAMPLE_POINTS[(k + 4 * p) % len(_SAMPLE_POINTS)] + 0.1 * p for k, n in enumerate(names)})
        try:
            vals = [_eval_expr(t, env) for t in trees]
            rows.append(vals if all(cmath.isfinite(v) for v in vals) else None)
        except (ArithmeticError, ValueError, KeyError, TypeError):
            rows.append(None)
    return rows


def _close_num(x, y):
    """Relative: |x - y| <= 1e-12 max(|x|, |y|), at every magnitude: far above a few float roundings
    (~1e-16 each), tight enough that 10^9 - 1 is not 10^9 (1e-9 was not). An absolute floor would
    make 10^{-13} equal 0 while the plain number 0.0000000000001 (compared exactly) does not; so a
    small value equals only itself within the relative tolerance, and 0 only an exact 0."""
    return abs(x - y) <= 1e-12 * max(abs(x), abs(y))


@functools.lru_cache(maxsize=1 << 14)
def _numeric_equal(a, b):
    try:
        sides_a, sides_b = _split_top(a, "="), _split_top(b, "=")
        if len(sides_a) != len(sides_b) or len(sides_a) > 2:
            return False
        parsed = [_compile_expr(x) for x in sides_a + sides_b]
        if any(p is None for p in parsed):
            return False
        names = set().union(*(p[1] for p in parsed))
        rows = [r for r in _sample_values([p[0] for p in parsed], names) or [] if r is not None]
        if len(rows) < 2:
            return False
        if len(sides_a) == 1:
            return all(_close_num(r[0], r[1]) for r in rows)
        # equations: equivalent when lhs - rhs are proportional ("5x-7y=3" == "14y-10x=-6")
        diffs = [(r[0] - r[1], r[2] - r[3]) for r in rows]
        if any(abs(d2) < 1e-12 for _, d2 in diffs):
            return all(abs(d1) < 1e-12 and abs(d2) < 1e-12 for d1, d2 in diffs)
        ratios = [d1 / d2 for d1, d2 in diffs]
        return abs(ratios[0]) > 1e-12 and all(_close_num(q, ratios[0]) for q in ratios)
    except (ValueError, SyntaxError, RecursionError, MemoryError, ArithmeticError, TypeError):
        return False


# --- multiple choice -----------------------------------------------------------------------------

_LETTER_RE = re.compile(r"[\s(\[{*]*([A-Za-z])[\s)\]}*.:]*")
_ANSWER_IS_RE = re.compile(r"(?i:answer)[\s*:]*(?:(?i:is)[\s*:]*)?\(?([A-Z])\)?(?![A-Za-z0-9])")


def _answer_is_letter(text):
    """The letter of the last "the answer is (X)" near the end of text, or None."""
    m = None
    for m in _ANSWER_IS_RE.finditer(text[-3000:]):
        pass
    return m.group(1) if m else None


_MCQ_WRAP_RE = re.compile(rf"\\(?:boxed|fbox|{_TEXT_CMDS})\s*\{{")  # _TEXT_CMD_RE's commands and the boxes


def _mcq_letter(s):
    """The option letter s is: 'B', '(B)', '**B.**', '\\text{(B)}', '$\\boxed{B}$'; else None."""
    m = _LETTER_RE.fullmatch(_unwrap_cmds(s.strip().replace("$", ""), _MCQ_WRAP_RE)) if s is not None and len(s) < 100 else None
    return m.group(1).upper() if m else None


def check_mcq(response, answer):
    ref = _mcq_letter(answer) or answer.strip().upper()
    content, status = _last_tag(response)
    if status == "unclosed":
        return 0.0, TRUNCATED_FEEDBACK
    if status == "ok":
        got = _mcq_letter(content)
        if got is None:
            return 0.0, "The answer must be a single letter inside <answer></answer>."
    else:
        boxed, status = _last_boxed(response)
        if status == "unclosed":
            return 0.0, TRUNCATED_FEEDBACK
        got = _mcq_letter(boxed) if boxed is not None else None
        if got is None:
            got = _answer_is_letter(response)
        if got is None:
            return 0.0, "No final answer found: put the letter of your choice inside <answer></answer>."
    if got == ref:
        return 1.0, None
    return 0.0, f"Your final answer {got} is wrong."


# --- exact (toy suite) ---------------------------------------------------------------------------

def check_exact(response, answer):
    got, status = _last_tag(response)
    if status == "unclosed":
        return 0.0, TRUNCATED_FEEDBACK
    if status == "none":
        return 0.0, "No final answer found: put it inside <answer></answer>."
    if got == answer.strip():
        return 1.0, None
    if not got:
        return 0.0, "The <answer></answer> tags are empty."
    return 0.0, f"Your final answer {_clip_text(got)} is wrong."


# --- tool use (ReAct) ----------------------------------------------------------------------------

_ACTION_RE = re.compile(r"^[ \t*]*Action[ \t*]*:[ \t*]*(.*)$", re.M)  # "Action Input:" does not match
_INPUT_RE = re.compile(r"Action[ \t*]*Input[ \t*]*:[ \t*]*\s*")
_JSON_DECODER = json.JSONDecoder()


def _json_dict(value):
    """An Action Input as a dict: a JSON object, or a string holding one (the reference stores
    Action_Input as a JSON string; '' is no arguments); None when it is anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def _parse_tool_calls(text):
    """([(action name, input dict)], truncated): every Action with its Action Input; the input is
    {} when the call has none (no "Action Input:", or nothing after it) and None when what follows
    "Action Input:" is not a JSON object (malformed: not the same as no arguments)."""
    text = text[:TOOL_CHARS]
    matches = []
    for m in _ACTION_RE.finditer(text):
        matches.append(m)
        if len(matches) >= MAX_TOOL_CALLS:
            break
    calls, truncated = [], False
    for k, m in enumerate(matches):
        name = m.group(1).split("Action Input")[0].strip().strip("`*\"' ")
        end = matches[k + 1].start() if k + 1 < len(matches) else len(text)
        im = _INPUT_RE.search(text, m.start(), end)
        args = {}
        if im and text[im.end():end].strip():
            try:
                args = _json_dict(_JSON_DECODER.raw_decode(text, im.end())[0])
            except (ValueError, RecursionError):
                args, seg = None, text[im.end():end]
                truncated = k == len(matches) - 1 and seg.count("{") > seg.count("}")
        calls.append((name, args))
    return calls, truncated


def _same_json(a, b):
    """JSON equality that tells the types apart: Python's == says True == 1, a tool call does not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    return a == b


@functools.lru_cache(maxsize=4096)
def _tool_reference(answer):
    """The reference's calls as JSON text, [[name, Action_Input object], ...]; ValueError naming what
    is wrong (a call without an Action name, an Action_Input that is not a JSON object)."""
    try:
        ref = json.loads(answer)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg}") from None
    ref = [ref] if isinstance(ref, dict) else ref
    if not isinstance(ref, list) or not ref or not all(isinstance(item, dict) for item in ref):
        raise ValueError("not a JSON object or a non-empty list of them")
    calls = []
    for k, item in enumerate(ref, 1):
        name = item.get("Action")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"call {k} has no \"Action\" name")
        args = _json_dict(item.get("Action_Input", item.get("Action Input", {})))
        if args is None:
            raise ValueError(f"call {k}'s Action_Input is not a JSON object")
        calls.append([name.strip(), args])
    return json.dumps(calls)  # text: the cache hands out no mutable objects


def _same_calls(calls, ref_calls):
    """The same (name, arguments) calls as a multiset: each call matched to an equal, unused one."""
    left = list(ref_calls)
    for name, args in calls:
        j = next((j for j, (n, a) in enumerate(left) if n == name and _same_json(args, a)), None)
        if j is None:
            return False
        del left[j]
    return not left


def _merged(calls):
    merged = {}
    for _, args in calls:
        merged.update(args or {})
    return merged


def check_tool(response, answer):
    ref_calls = [tuple(c) for c in json.loads(_tool_reference(answer))]
    ref_names = [n for n, _ in ref_calls]
    calls, truncated = _parse_tool_calls(response)
    names = [n for n, _ in calls]
    malformed = [n for n, args in calls if args is None]
    if calls and not malformed and _same_calls(calls, ref_calls):
        return 1.0, None
    if truncated:
        return 0.0, TRUNCATED_FEEDBACK
    if not calls:
        return 0.0, "No tool call found: write 'Action: <tool name>' then 'Action Input: <JSON object>'."
    if malformed:
        called = _clip_text(", ".join(malformed), 200)
        return 0.0, f"The Action Input of {called} is not a JSON object: write 'Action Input: {{\"name\": value, ...}}'."
    if Counter(names) != Counter(ref_names):
        called = _clip_text(", ".join(names), 200)
        return 0.0, f"Action names do not match the tool calls the question needs (you called: {called})."
    merged, ref_merged = _merged(calls), _merged(ref_calls)
    if _same_json(merged, ref_merged):  # every argument is there, some in another call than the question needs
        return 0.0, "The Action Input arguments do not match the calls they belong to."
    missing = sorted(set(ref_merged) - set(merged))
    extra = sorted(set(merged) - set(ref_merged))
    wrong = sorted(k for k in set(merged) & set(ref_merged) if not _same_json(merged[k], ref_merged[k]))
    parts = [f"{what}: {', '.join(map(str, keys))}" for what, keys in
             (("missing arguments", missing), ("unexpected arguments", extra), ("wrong values for", wrong)) if keys]
    return 0.0, _clip_text("The Action Input arguments do not match (" + "; ".join(parts) + ").", 300)


# --- code (unit tests in a sandbox) --------------------------------------------------------------
# The answer is a JSON object (data/tasks.py checks it at load):
#   {"tests": [test, ...], "fn_name": str (optional), "timeout": seconds per test (optional),
#    "score": "all" (default: 1 if every test passes, else 0) or "fraction" (the share that pass)}
# and each test one of
#   {"input": str, "output": str}   stdin -> stdout (LiveCodeBench / Codeforces style); with fn_name
#                                   a call: input = one JSON argument a line, output = the JSON value
#                                   of fn_name(*args) (or Solution().fn_name, LeetCode style)
#   {"assert": str}                 test code run after the program, e.g. HumanEval's
#                                   "def check(candidate): ...\ncheck(f)"; passes if it raises nothing
# plus "public": true for the tests that feedback may show (input, expected, got); the others are
# hidden: their failure is reported without their content. With "expression": "x" (the toy
# domain) the response's answer is one Python expression in x, its last <answer></answer> (else its
# last code block), run as `def f(x): return (expr)` with fn_name "f" (a call test per point),
# and the feedback reads "f(4) gave 8, expected 9". Public tests run first; the program stops
# at the first failure unless score is "fraction". Every run goes through data/sandbox.py.

CODE_CHARS = 200_000        # the program is looked for in the last CODE_CHARS of a response
CODE_FEEDBACK_CHARS = 1500  # the longest feedback
_FENCE_RE = re.compile(r"```([^\n`]*)\n(.*?)```", re.S)
_PY_TAGS = ("python", "python3", "py", "")


def code_block(response, entry=None):
    """(program, status): the last fenced code block (the last Python-tagged one when a later block
    is not Python, e.g. sample output), status 'ok' | 'none' | 'unclosed'. With `entry`, the function
    the tests call (code_entry), the last Python block that defines it (or a LeetCode class Solution):
    a later block that only calls it ("Example usage: print(add(1, 2))") is not the program."""
    tail = str(response)[-CODE_CHARS:]
    blocks = [(m.group(1).strip().lower(), m.group(2), m.end()) for m in _FENCE_RE.finditer(tail)]
    end = blocks[-1][2] if blocks else 0
    if tail.count("```", end) % 2 == 1:  # an opened fence never closed: cut off mid-program
        return None, "unclosed"
    if not blocks:
        return None, "none"
    python = [b for b in blocks if b[0] in _PY_TAGS]
    if entry and python:
        defines = re.compile(rf"^[ \t]*(?:(?:async[ \t]+)?def[ \t]+{re.escape(entry)}[ \t]*\(|class[ \t]+Solution\b)", re.M)
        python = [b for b in python if defines.search(b[1])] or python
    return (python or blocks)[-1][1], "ok"


_CHECK_CALL_RE = re.compile(r"^check\((\w+)\)\s*\Z", re.M)  # HumanEval's test ends with check(<entry point>)


def code_entry(answer):
    """The function a code answer's tests call: its fn_name, else the name an assert test's final
    check(NAME) passes (HumanEval); None for stdin programs, expression tasks, or a bad answer."""
    try:
        tests, fn_name, _, _, expression = _code_reference(answer if isinstance(answer, str) else json.dumps(answer))
    except (ValueError, TypeError):
        return None
    return _entry_point(tests, fn_name, expression)


def _entry_point(tests, fn_name, expression):
    if expression:
        return None
    if fn_name:
        return fn_name
    names = {m.group(1) for t in tests if "assert" in t for m in [_CHECK_CALL_RE.search(t["assert"].strip())] if m}
    return names.pop() if len(names) == 1 else None


def code_answer_error(answer):
    """None if `answer` (a dict, or its JSON text) fits the code answer schema above, else what is wrong."""
    try:
        ref = json.loads(answer) if isinstance(answer, str) else answer
    except ValueError:
        return "a code answer must be a JSON object with a 'tests' list"
    if not isinstance(ref, dict) or not isinstance(ref.get("tests"), list) or not ref["tests"]:
        return "a code answer must be a JSON object with a non-empty 'tests' list"
    if "fn_name" in ref and not (isinstance(ref["fn_name"], str) and ref["fn_name"].isidentifier()):
        return "fn_name must be a Python identifier"
    if "timeout" in ref and not (isinstance(ref["timeout"], (int, float)) and 0 < ref["timeout"] <= 600):
        return "timeout must be a number of seconds in (0, 600]"
    if ref.get("score", "all") not in ("all", "fraction"):
        return "score must be 'all' or 'fraction'"
    if "expression" in ref and not (isinstance(ref["expression"], str) and ref["expression"].isidentifier()
                                    and ref.get("fn_name") == "f"):
        return "expression must name the variable (an identifier) and fn_name must be 'f'"
    for i, t in enumerate(ref["tests"]):
        ok = isinstance(t, dict) and (isinstance(t.get("assert"), str) or (isinstance(t.get("input"), str)
                                                                           and isinstance(t.get("output"), str)))
        if not ok:
            return f"test {i} must be {{\"input\": str, \"output\": str}} or {{\"assert\": str}}"
    return None


@functools.lru_cache(maxsize=1024)
def _code_reference(answer):
    """The answer's tests (public first), fn_name, timeout, fraction, expression variable."""
    error = code_answer_error(answer)
    if error:
        raise ValueError(error)
    ref = json.loads(answer)
    tests = sorted(ref["tests"], key=lambda t: not t.get("public", False))
    return tests, ref.get("fn_name"), ref.get("timeout"), ref.get("score") == "fraction", ref.get("expression")


def code_expression(answer):
    """The variable an expression task's answer names (its "expression"), or None: a program task,
    no answer given, or one that does not fit the schema."""
    try:
        return _code_reference(answer if isinstance(answer, str) else json.dumps(answer))[4]
    except (ValueError, TypeError):
        return None


MAX_EXPRESSION_CHARS = 300


def expression_text(response):
    """(text, status) of an expression answer: the last <answer></answer>, else the last code block."""
    expr, status = _last_tag(str(response))
    if status == "none":
        expr, status = code_block(response)
    return expr, status


def expression_program(response, var):
    """(program, status) for an expression answer: `def f(var): return (<expr>)`, status 'ok' |
    'none' | 'unclosed' | 'invalid' (not one Python expression)."""
    expr, status = expression_text(response)
    if status != "ok" or not expr or not expr.strip():
        return None, "none" if status == "ok" else status
    expr = expr.strip()
    try:
        if len(expr) > MAX_EXPRESSION_CHARS:
            raise SyntaxError("too long")
        ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, "invalid"
    return f"def f({var}):\n    return (\n{expr}\n    )\n", "ok"


def _call_driver(fn_name, args_text):
    """Test code for a call test: parse the JSON arguments, call the function, keep the JSON result."""
    return (f"import json as _json\n_args = [_json.loads(_l) for _l in {args_text!r}.splitlines() if _l.strip()]\n"
            f"_f = Solution().{fn_name} if 'Solution' in globals() else {fn_name}\n"
            f"__result__ = _json.dumps(_f(*_args))\n")


def _code_case(test, fn_name):
    from data.sandbox import Case
    if "assert" in test:
        return Case(code=test["assert"], main=False)
    if fn_name:
        return Case(code=_call_driver(fn_name, test["input"]), main=False)
    return Case(stdin=test["input"], main=True)


_INT_TOKEN_RE = re.compile(r"[+-]?\d+")
_FLOAT_TOKEN_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?i:inf|infinity|nan)")


def _close_token(a, b):
    """Two output tokens: integers equal as integers ("007" is 7, 1000000006 is not 1000000007: counts,
    sums and residues mod 1e9+7 are exact), decimals within 1e-6 (relative above 1), anything else
    as text ("1_000" is not 1000, although float() reads it so)."""
    if a == b:
        return True
    if _INT_TOKEN_RE.fullmatch(a) and _INT_TOKEN_RE.fullmatch(b):
        return int(a) == int(b)
    if not (_FLOAT_TOKEN_RE.fullmatch(a) and _FLOAT_TOKEN_RE.fullmatch(b)):
        return False
    x, y = float(a), float(b)
    return abs(x - y) <= 1e-6 * max(1.0, abs(y))


def same_output(got, expected):
    """stdout against the expected output: line by line, ignoring surrounding whitespace and trailing
    blank lines; integers compare exactly, decimals within 1e-6 (relative above 1) (LiveCodeBench's
    grader compares decimals exactly: a float printed with other rounding can pass here and fail there)."""
    a, b = got.strip().splitlines(), expected.strip().splitlines()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        x, y = x.strip(), y.strip()
        if x != y:
            xs, ys = x.split(), y.split()
            if len(xs) != len(ys) or not all(map(_close_token, xs, ys)):
                return False
    return True


def _close_json(a, b):
    """JSON values equal: two integers exactly, a float within 1e-6 (relative above 1); True is not 1
    (as in _same_json)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or abs(a - b) <= 1e-6 * max(1.0, abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_close_json, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close_json(a[k], b[k]) for k in a)
    return a == b


def _same_value(got, expected):
    try:
        return _close_json(json.loads(got), json.loads(expected))
    except (TypeError, ValueError, RecursionError):
        return False


def _test_passed(test, fn_name, result):
    if result.status != "ok":
        return False
    if "assert" in test:
        return True
    if fn_name:
        return result.result is not None and _same_value(result.result, test["output"])
    return same_output(result.stdout, test["output"])


def _clip_block(text, lines=8, chars=300):
    rows = str(text).splitlines() or [""]
    shown = "\n".join(r if len(r) <= chars else r[:chars] + "..." for r in rows[:lines])
    return shown + (f"\n... ({len(rows) - lines} more lines)" if len(rows) > lines else "")


def _expression_feedback(test, result):
    point = test["input"].strip()
    if result.status == "ok":
        return f"f({point}) gave {result.result}, expected {test['output'].strip()}."
    if result.status == "error":
        return f"f({point}) raised {result.detail.split(':')[0].strip()[:60]}."
    return f"f({point}): {result.detail or result.status}."


def _code_feedback(test, k, fn_name, result, n_public, expression=None):
    """What a programmer would see for the failing test k (1-based); a hidden test shows no content."""
    if expression and test.get("public", False):
        return _expression_feedback(test, result)
    if result.status == "ok":
        what = "wrong answer"
    elif result.status == "error":
        what = "error"
    else:
        what = result.detail or result.status
    if not test.get("public", False):
        if result.status == "error":
            what = "error: " + result.detail.split(":")[0].strip()[:60]  # the exception's type only
        plural = "s" if n_public > 1 else ""
        passed = f"passed the public test{plural} but " if n_public and k > n_public else ""
        return f"Your program {passed}failed a hidden test ({what})."
    if "assert" in test:
        shown = f"Test {k} failed ({what}).\nTest code:\n{_clip_block(test['assert'], 12)}"
    else:
        shown = f"Test {k} failed ({what}).\nInput:\n{_clip_block(test['input'])}"
        if result.status == "ok":
            got = result.result if fn_name else result.stdout
            shown += f"\nExpected:\n{_clip_block(test['output'])}\nGot:\n{_clip_block(got if got else '(nothing)')}"
    if result.status == "error" and result.stderr:
        shown += "\nError:\n" + _clip_block("\n".join(result.stderr.splitlines()[-6:]), 6)
    return shown[:CODE_FEEDBACK_CHARS]


def _code_job(response, answer):
    """(Job or None, (score, feedback) when there is nothing to run, scorer(results) -> (score, feedback))."""
    from data.sandbox import Job, Limits
    tests, fn_name, timeout, fraction, expression = _code_reference(answer)
    program, status = (expression_program(response, expression) if expression else
                       code_block(response, _entry_point(tests, fn_name, expression)))
    if status == "unclosed":
        return None, (0.0, TRUNCATED_FEEDBACK), None
    if status == "invalid":
        return None, (0.0, f"Your answer is not one Python expression in {expression}."), None
    if status == "none" or not program.strip():
        if expression:
            return None, (0.0, f"No final answer found: put a Python expression in {expression} inside "
                               "<answer></answer>."), None
        return None, (0.0, "No program found: put your code in a ```python code block."), None
    limits = Limits(timeout_s=float(timeout)) if timeout else Limits()
    keep_going = (lambda i, r: True) if fraction else (lambda i, r: _test_passed(tests[i], fn_name, r))
    job = Job(program, [_code_case(t, fn_name) for t in tests], limits, keep_going)
    n_public = sum(bool(t.get("public")) for t in tests)

    def score(results):
        passed = [_test_passed(t, fn_name, r) for t, r in zip(tests, results)]
        failed = next((i for i, ok in enumerate(passed) if not ok), None)
        if failed is None and len(results) == len(tests):
            return 1.0, None
        value = sum(passed) / len(tests) if fraction else 0.0
        if failed is None:  # the sandbox stopped early without a failing result (should not happen)
            return value, "Your program could not be run on every test."
        return value, _code_feedback(tests[failed], failed + 1, fn_name, results[failed], n_public, expression)
    return job, None, score


def check_code(response, answer):
    """Run the response's last fenced code block on the answer's tests in the sandbox (data/sandbox.py)."""
    from data.sandbox import run
    job, early, score = _code_job(response, answer)
    if job is None:
        return early
    return score(run(job.program, job.cases, job.limits, job.keep_going))


def check_code_many(responses, answers, workers=0):
    """[check_code(r, a) for r, a in zip(responses, answers)], the programs run in parallel across
    `workers` sandboxes (0 = one per core): a rollout batch's rewards in one call."""
    from data.sandbox import run_many
    prepared = [_code_job(r, a) for r, a in zip(responses, answers)]
    jobs = [job for job, _, _ in prepared if job is not None]
    results = iter(run_many(jobs, workers))
    return [early if job is None else score(next(results)) for job, early, score in prepared]


def check_batch(kinds, responses, answers, check_one):
    """[check_one(kind, response, answer) for each], except that the "code" ones run together on the
    sandbox pool (check_code_many): a rollout's or an eval chunk's programs in parallel. check_one is
    the caller's never-raising dispatch (train.reward); it also takes over if the pool fails."""
    out = [None] * len(kinds)
    code = [i for i, kind in enumerate(kinds) if kind == "code"]
    if code:
        try:
            batch = check_code_many(["" if responses[i] is None else str(responses[i]) for i in code],
                                    [answer_text(answers[i]) for i in code])
            for i, scored in zip(code, batch):
                out[i] = scored
        except Exception:  # a bad answer, the pool: each is checked alone below, where errors are handled
            pass
    return [o if o is not None else check_one(k, r, a) for o, k, r, a in zip(out, kinds, responses, answers)]


# The answer kinds: a task's `kind` names its checker here. train.py's reward() dispatches through this
# table and every task file is checked against it (data/tasks.py, data/common.py). A new kind: its
# check_<kind>(response, answer) above and a line here; final_answer (what eval.py counts as an empty
# answer) and answer_problem (which reference answers can ever be matched) read a kind's answer shape.
CHECKS = {"math": check_math, "mcq": check_mcq, "tool": check_tool, "exact": check_exact, "code": check_code}
