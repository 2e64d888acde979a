"""How many correct solutions the execution verifiers score 0: tests/correct_solutions.py (57
correct answers in the styles models write) through exec_tests and exec_tests_strict, with the
interpreter where it is, or a copy of it (hard links) in a private (mode-700) folder or in one
anyone may read, beside the repository. A solution counts as a false negative when either
verifier scores it below 1 (or refuses its test).

    python studies/verifier_false_negatives.py                      # this interpreter, rlhf/sandbox.py
    python studies/verifier_false_negatives.py --where private      # a copy in a mode-700 folder
    git show 863ba3a:rlhf/sandbox.py > /tmp/sandbox_old.py
    python studies/verifier_false_negatives.py --sandbox /tmp/sandbox_old.py --where readable
"""

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.correct_solutions import SOLUTIONS, interpreter_copy  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandbox", default=os.path.join(ROOT, "rlhf", "sandbox.py"), help="the sandbox.py to measure")
    parser.add_argument("--where", choices=["here", "private", "readable"], default="here",
                        help="the interpreter as it is, or a copy in a mode-700 or a world-readable folder")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("sandbox_measured", args.sandbox)
    sandbox = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sandbox)
    folder = None
    if args.where != "here":  # beside the repository: not under /tmp, which the sandbox covers with its tmpfs
        folder = tempfile.mkdtemp(prefix=".interpreter-", dir=ROOT)
        os.chmod(folder, 0o700 if args.where == "private" else 0o755)
        sys.executable = interpreter_copy(os.path.join(folder, "python"))
    try:
        failed = {}
        for verifier in (sandbox.exec_tests, sandbox.exec_tests_strict):
            for name, (completion, tests) in SOLUTIONS.items():  # one at a time: a refused test fails its row only
                try:
                    score = verifier(prompts=["p"], completions=[completion], tests=[tests])[0]
                except ValueError as e:
                    score = f"refused: {str(e)[:100]}"
                if score != 1.0:
                    failed.setdefault(name, []).append(f"{verifier.__name__}: {score}")
    finally:
        if folder:
            shutil.rmtree(folder)
    print(f"{len(failed)} of {len(SOLUTIONS)} correct solutions not scored 1 ({len(failed) / len(SOLUTIONS):.0%}) "
          f"[{args.sandbox}, interpreter {args.where}: {sys.executable}]")
    for name, why in failed.items():
        print(f"  {name}: {'; '.join(why)}")


if __name__ == "__main__":
    main()
