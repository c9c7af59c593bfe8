"""
nanoGPT-style configuration, exec'd by train.py / eval.py / sample.py into their globals:

    python train.py config/sdpo_toy.py --density=0.5 --out_dir=out/d05

Each positional argument is a python file executed in the script's globals (a config file is
a diff against the defaults); each --key=value overrides one default. Values are parsed as
python literals (plain words stay strings); the type must match the default's (an int where a
float is expected is fine). An unknown key or a wrong type exits with a one-line error naming
the key. `--help` lists every key with its default and the comment beside it.
"""
import ast
import re
import sys


def config_keys(scope, source_file):
    """{key: help} for the script's defaults block: lowercase module-level names with a plain
    value (bool/int/float/str) assigned on a line `key = value  # help`."""
    helps = {}
    with open(source_file) as f:
        for line in f:
            m = re.match(r"^([a-z]\w*) = (.*?)\s+# (.*)$", line.rstrip("\n"))
            if m and isinstance(scope.get(m.group(1)), (bool, int, float, str)):
                helps[m.group(1)] = m.group(3)
    return helps


def literal(raw):
    """'0.5' -> 0.5, 'True' -> True, 'out/x' -> 'out/x' (a plain word stays a string)."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def coerce(key, value, default, where):
    """Return value if it has the default's type (int accepted for float), else exit naming the key."""
    if isinstance(default, float) and type(value) is int:
        return float(value)
    if type(value) is not type(default):
        raise SystemExit(f"error: {where}: {key}={value!r} should be {type(default).__name__} "
                         f"like the default {default!r}")
    return value


def configure(scope, argv, source_file):
    """Apply config files and --key=value overrides to `scope` (a script's globals)."""
    helps = config_keys(scope, source_file)
    keys = {k: scope[k] for k in helps}
    if "--help" in argv or "-h" in argv:
        width = max(map(len, keys))
        print(f"usage: python {source_file.rsplit('/', 1)[-1]} [config/file.py ...] [--key=value ...]\n")
        for k, v in keys.items():
            print(f"  --{k:<{width}} = {v!r:<24} {helps[k]}")
        raise SystemExit(0)
    for arg in argv:
        if not arg.startswith("--"):
            try:
                with open(arg) as f:
                    code = f.read()
            except OSError:
                raise SystemExit(f"error: config file {arg} not found") from None
            file_scope = {k: scope[k] for k in keys}  # a config file may read the current values
            exec(code, {}, file_scope)
            for k, v in file_scope.items():
                if k.startswith("_"):
                    continue
                if k not in keys:
                    raise SystemExit(f"error: {arg} sets unknown config key '{k}' (see --help)")
                scope[k] = coerce(k, v, keys[k], arg)
        else:
            key, sep, raw = arg[2:].partition("=")
            if not sep:
                raise SystemExit(f"error: {arg}: write --{key}=value")
            if key not in keys:
                close = [k for k in keys if k.startswith(key[:3])][:3]
                hint = f" (did you mean {', '.join(close)}?)" if close else " (see --help)"
                raise SystemExit(f"error: unknown config key '{key}'{hint}")
            value = raw if isinstance(keys[key], str) else literal(raw)  # --out_dir=123 is a string
            scope[key] = coerce(key, value, keys[key], arg)
    return {k: scope[k] for k in keys}
