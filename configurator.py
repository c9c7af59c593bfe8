"""
nanoGPT-style configuration for train.py / eval.py / sample.py: their defaults are module globals, the
values a run uses are the dict configure() returns (the globals stay the defaults):

    python train.py config/sdpo_toy.py --density=0.5 --out_dir=out/d05

Each positional argument is a python file executed in a namespace holding the current settings
(not the script's globals: a config file is a diff against the defaults); each --key=value
overrides one default. Values are parsed as python literals (plain words stay strings; a key whose
default is a string takes the text as given); the type must match the default's (an int where a
float is expected is fine) and a float must be finite. A config file may import modules and
define functions and classes; any other name it leaves behind is a setting (a data helper is
named _x, so that a typo'd key holding a list is not mistaken for one). Every bad input -- an
unknown key, a wrong type, nan/inf, a config file that is missing, unreadable, has a syntax
error, raises or calls sys.exit -- exits with one line naming the key or file:line, before any
work is done.
`--help` lists every key with its value and the comment beside it: the default, or what the config
files and overrides before or after it make it (`python train.py config/sdpo_math.py --help`).
"""
import ast
import difflib
import importlib
import inspect
import math
import re
import sys
import traceback

PLAIN = (bool, int, float, str)


class UserError(Exception):
    """Bad input from the user: the scripts print it as one line (error: ...) and exit 1, before
    anything on disk is touched."""


def require(module, setting, package=None):
    """An optional package, imported only when a setting asks for it; missing: one line naming both."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{setting} needs the {package or module} package: pip install {package or module}") from None

NON_FINITE_WORDS = {"nan", "inf", "infinity"}  # float() accepts these, with any case and sign
MAX_SEED = 2 ** 62  # seed + rank / eval offsets must stay inside torch's 64-bit generator seed


def check_seed(seed):
    """A seed every RNG takes (python's, torch's CPU and CUDA generators, with the per-rank offsets)."""
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed={seed} must be an integer in [0, 2**62]")


def config_keys(scope, source_file):
    """{key: help} for the script's defaults block: lowercase module-level names with a plain
    value (bool/int/float/str) assigned on a line `key = value  # help`."""
    helps = {}
    with open(source_file) as f:
        for line in f:
            m = re.match(r"^([a-z]\w*) = (.*?)\s+# (.*)$", line.rstrip("\n"))
            if m and isinstance(scope.get(m.group(1)), PLAIN):
                helps[m.group(1)] = m.group(3)
    return helps


def check_values(cfg, *, choices, ranges, positive, non_negative):
    """The value checks a type cannot make, from a script's tables: each choices key one of its options,
    each ranges key inside (low, high] ([low, high] when low is inclusive), positive > 0, non_negative >= 0."""
    for key, options in choices.items():
        if cfg[key] not in options:
            raise UserError(f"{key}={cfg[key]!r} is not one of {', '.join(options)}")
    for key, (low, high, low_ok) in ranges.items():
        v = cfg[key]
        if not ((v >= low if low_ok else v > low) and v <= high):
            raise UserError(f"{key}={v} is out of range {'[' if low_ok else '('}{low}, {high}]")
    for key in positive:
        if cfg[key] <= 0:
            raise UserError(f"{key}={cfg[key]} must be positive")
    for key in non_negative:
        if cfg[key] < 0:
            raise UserError(f"{key}={cfg[key]} must be >= 0")


def parse_stages(stages, dataset, max_iters):
    """'a:100,b:50' -> [('a', 100), ('b', 50)]; '' -> [(dataset, max_iters)] (train.py's stages key)."""
    if not stages:
        return [(dataset, max_iters)]
    out = []
    for part in stages.split(","):
        name, sep, iters = part.strip().rpartition(":")
        if not sep or not name or not iters.isdigit() or int(iters) <= 0:
            raise UserError(f"stages entry {part!r} is not 'dataset:iters' (e.g. stages='toy/add:200,toy/mul:200')")
        out.append((name, int(iters)))
    return out


def check_template(key, template, fields):
    """A str.format template setting, tried with a dummy value for each of its fields: an unknown
    {field}, a positional {} or a lone brace is one line at check time, not a KeyError mid-run."""
    try:
        template.format(**{f: "x" for f in fields})
    except KeyError as e:
        problem = f"unknown field {{{e.args[0]}}}"
    except IndexError:
        problem = "a positional field {} needs a name"
    except (ValueError, AttributeError, TypeError) as e:
        problem = one_line(e)
    else:
        return
    raise UserError(f"{key}={template!r}: {problem}: it may use {', '.join('{' + f + '}' for f in fields)} "
                    "(write {{ and }} for literal braces)")


def literal(raw):
    """'0.5' -> 0.5, 'True' -> True, 'out/x' -> 'out/x' (a plain word stays a string)."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def one_line(text):
    """Collapse whitespace so a message from python (or a config file) cannot span lines."""
    return " ".join(str(text).split())


def non_finite(value):
    """nan/inf as a float (1e400 parses to inf) or as a word float() would read ('nan', '-inf',
    'Infinity'): either would only surface, if at all, as a NaN loss hours into a run."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):  # 10**400 has no float
        return abs(value) > sys.float_info.max
    return isinstance(value, str) and value.strip().lower().lstrip("+-") in NON_FINITE_WORDS


def _short(value, n=40):
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def coerce(key, value, default, where):
    """Return value if it has the default's type (int accepted for float) and, for a float, is
    finite; else exit naming the key."""
    if isinstance(default, float) and non_finite(value):
        raise SystemExit(f"error: {where}: {key}={_short(value)} must be a finite number like the default {default!r}")
    if isinstance(default, float) and type(value) is int:
        return float(value)
    if type(value) is not type(default):
        raise SystemExit(f"error: {where}: {key}={value!r} should be {type(default).__name__} "
                         f"like the default {default!r}")
    return value


def compile_config(path):
    """The config file's code object, compiled under its real name so that a syntax error, and
    any traceback frame while it runs, names the file and line instead of "<string>"."""
    try:
        with open(path, "rb") as f:  # bytes: compile() honours a coding line and reports bad encodings
            source = f.read()
    except FileNotFoundError:
        raise SystemExit(f"error: config file {path} not found") from None
    except IsADirectoryError:
        raise SystemExit(f"error: config file {path} is a directory, not a python file") from None
    except OSError as e:
        raise SystemExit(f"error: config file {path} cannot be read: {one_line(e.strerror or e)}") from None
    try:
        return compile(source, path, "exec")
    except SyntaxError as e:
        where = f"{path}:{e.lineno}" if e.lineno else path
        text = f" ({one_line(e.text)})" if e.text and e.text.strip() else ""
        raise SystemExit(f"error: {where}: {one_line(e.msg)}{text}") from None
    except ValueError as e:  # null bytes on older pythons (a SyntaxError without a line on newer ones)
        raise SystemExit(f"error: {path}: {one_line(e)}") from None


def run_config(path, values):
    """Execute the config file with the current settings visible (it may read them) and return the
    names it leaves behind. One namespace, so functions defined in the file see its imports. An
    exception exits with the file's own line (the deepest frame in the file), not a traceback."""
    code = compile_config(path)
    namespace = dict(values)
    try:
        exec(code, namespace)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # a config file's sys.exit(0) must not end the run "fine"
        lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == path]
        where = f"{path}:{lines[-1]}" if lines else path
        if isinstance(e, SystemExit):
            raise SystemExit(f"error: {where}: the config file exits (sys.exit({e.code!r})): a config file only sets "
                             "values; remove the exit") from None
        message = f"{type(e).__name__}: {one_line(e)}" if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: {where}: {message}") from None
    return namespace


def is_helper(value):
    """Modules, functions and classes a config file defines or imports: code, never a setting."""
    return inspect.ismodule(value) or callable(value)


def settings_in_file(path, current):
    """{key: value} a config file sets. Names starting with _ and the modules, functions and classes
    it imports or defines are its own helpers; any other unknown name holding a value (a number, a
    string, a list, None, ...) is most likely a typo of a key, so it is refused."""
    out = {}
    for k, v in run_config(path, current).items():
        if k.startswith("_") or (k not in current and is_helper(v)):
            continue
        if k not in current:
            close = difflib.get_close_matches(k, list(current), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise SystemExit(f"error: {path} sets unknown config key '{k}' ({hint}see --help; name a helper _{k})")
        out[k] = v
    return out


def print_help(keys, cfg, helps, source_file, given):
    """Every key with the value this command line gives it (the default without config files or
    overrides) and its help; a key the arguments changed is marked *, with its default after it."""
    width = max(map(len, keys))
    changed = [k for k in keys if cfg[k] != keys[k]]  # (coerce keeps each value the default's type)
    lines = [f"usage: python {source_file.rsplit('/', 1)[-1]} [config/file.py ...] [--key=value ...]"]
    if given:
        lines.append(f"values after {' '.join(given)} ({len(changed)} changed, marked *)")
    lines.append("")
    for k in keys:
        mark, note = ("*", f" (default {keys[k]!r})") if k in changed else (" ", "")
        lines.append(f" {mark}--{k:<{width}} = {cfg[k]!r:<24} {helps[k]}{note}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        sys.stdout = None  # nothing left to flush at exit (which would raise again)


def configure(scope, argv, source_file):
    """The config a run uses: the defaults in `scope` (a script's globals; never written to), then
    the config files and --key=value overrides in `argv`, in order -> {key: value}. With --help (or
    -h) anywhere: the keys with the values the other arguments give them, then exit 0."""
    helps = config_keys(scope, source_file)
    keys = {k: scope[k] for k in helps}
    cfg = dict(keys)
    wants_help = "--help" in argv or "-h" in argv
    argv = [a for a in argv if a not in ("--help", "-h")]
    for arg in argv:
        if not arg.startswith("--"):
            for k, v in settings_in_file(arg, dict(cfg)).items():  # a config file may read the current values
                cfg[k] = coerce(k, v, keys[k], arg)
        else:
            key, sep, raw = arg[2:].partition("=")
            if not sep:
                raise SystemExit(f"error: {arg}: write --{key}=value")
            if key not in keys:
                close = [k for k in keys if k.startswith(key[:3])][:3]
                hint = f" (did you mean {', '.join(close)}?)" if close else " (see --help)"
                raise SystemExit(f"error: unknown config key '{key}'{hint}")
            value = raw if isinstance(keys[key], str) else literal(raw)  # --out_dir=123 is a string
            if isinstance(keys[key], bool) and raw.lower() in ("true", "false"):  # --tail=false as --tail=False
                value = raw.lower() == "true"
            cfg[key] = coerce(key, value, keys[key], arg)
    if wants_help:
        print_help(keys, cfg, helps, source_file, argv)
        raise SystemExit(0)
    return cfg
