"""An agent loop written against E2B's SDK, run unchanged on DSec: create a sandbox, write a task (a module and
its tests), run the tests, read the failures, write the next attempt, until they pass; then kill the sandbox.

    python examples/e2b_agent_loop.py          # DSEC_URL names the DSec (default nats://127.0.0.1:4222),
                                               # its `base` image built: dsec image build base --e2b-base

The "model" is a list of attempts, so the loop runs without one; the E2B calls are what a real agent makes.
"""
import libdsec.e2b

libdsec.e2b.install()   # from here on `import e2b` is DSec's facade; nothing below knows it

from e2b import Sandbox  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402

TESTS = '''
from solution import fizzbuzz

def test_numbers():
    assert [fizzbuzz(i) for i in (1, 2, 4)] == ["1", "2", "4"]

def test_words():
    assert (fizzbuzz(3), fizzbuzz(5), fizzbuzz(15)) == ("Fizz", "Buzz", "FizzBuzz")
'''
ATTEMPTS = [   # what a model would propose, one per turn
    "def fizzbuzz(n):\n    return str(n)\n",
    "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
    "    return str(n)\n",
    "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n"
    "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
]
RUNNER = '''
import sys, traceback, test_task
failed = 0
for name in sorted(n for n in dir(test_task) if n.startswith("test_")):
    try:
        getattr(test_task, name)()
        print("PASS", name)
    except AssertionError:
        failed += 1
        print("FAIL", name, traceback.format_exc().splitlines()[-1])
sys.exit(1 if failed else 0)
'''


def main() -> None:
    sbx = Sandbox.create(timeout=300, metadata={"job": "fizzbuzz"})
    try:
        sbx.files.write("task/test_task.py", TESTS)          # relative: under /home/user
        sbx.files.write("task/run_tests.py", RUNNER)
        for turn, attempt in enumerate(ATTEMPTS, 1):
            sbx.files.write("task/solution.py", attempt)
            try:
                result = sbx.commands.run("cd ~/task && python3 run_tests.py", timeout=60)
            except CommandExitException as failed:          # E2B raises on a non-zero exit
                print(f"turn {turn}: tests failed\n{failed.stdout}", end="")
                continue
            print(f"turn {turn}: tests pass\n{result.stdout}", end="")
            print(f"solved on turn {turn}: {sbx.files.read('task/solution.py').count(chr(10))} lines")
            return
        raise SystemExit("no attempt passed")
    finally:
        sbx.kill()


if __name__ == "__main__":
    main()
