"""pass@1 of the demo kit's HumanEval task (demo_humaneval.yaml): the generated completion is executed.

With one greedy sample per problem, pass@1 (Chen et al. 2021, the unbiased estimator 1 − C(n−c, k)/C(n, k) at
n = k = 1) is 1 when the completion passes the problem's tests and 0 otherwise. The program — prompt, completion,
the tests and ``check(entry_point)`` — runs in a fresh Python interpreter in a temporary directory, isolated
(``-I``), with a time limit; anything but a clean exit is a failure.
"""

import subprocess
import sys
import tempfile

TIME_LIMIT_S = 10.0


def passes(program: str, time_limit: float = TIME_LIMIT_S) -> bool:
    """Whether `program` exits cleanly within `time_limit` seconds in a separate interpreter."""
    with tempfile.TemporaryDirectory(prefix="submerge-humaneval-") as folder:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", program], cwd=folder, capture_output=True,
                                  timeout=time_limit, check=False)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def pass_at_1(doc, results):
    completion = results[0]
    program = f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"
    return {"pass@1": 1.0 if passes(program) else 0.0}
