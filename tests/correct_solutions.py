"""Correct solutions in the styles models write them, each with the tests it must pass: the set on
which the execution verifiers may not score a correct answer 0 (tests/test_verifier_solutions.py).

Each entry is (completion, tests); a completion is a string or a conversation. The styles: imports
of the standard library, classes, recursion, prints, a `__main__` block, fences of every spelling,
CRLF line ends, prose before and after the code, content given as a list of parts, a usage example
after the solution, big integers and deeply nested answers."""

import math
import os
import shutil
import sys
import sysconfig

SQUARE = ["assert f(2) == 4", "assert f(-3) == 9", "assert f(0) == 0"]
WORDS = ["assert count_words('a b a') == {'a': 2, 'b': 1}", "assert count_words('') == {}"]
FIB = ["assert fib(10) == 55", "assert fib(1) == 1", "assert fib(30) == 832040"]
PALINDROME = ["assert is_palindrome('A man, a plan, a canal: Panama') == True", "assert is_palindrome('ab') == False"]
PRIMES = ["assert primes(20) == [2, 3, 5, 7, 11, 13, 17, 19]", "assert primes(2) == [2]"]
TOP2 = ["assert top_k([5, 1, 9, 3], 2) == [9, 5]", "assert top_k([1], 1) == [1]"]
MEAN = ["assert mean([1, 2, 3, 4]) == 2.5", "assert mean([7]) == 7"]
DEPTH = 120  # nested deeper than the harness's encoding limit of 100
NEST = [f"assert nest({DEPTH}) == {'[' * DEPTH + ']' * DEPTH}"]


def interpreter_copy(folder):
    """This interpreter again under `folder`: folder/bin/python3.x and its standard library
    (hard links where the file system allows: nothing copied) -> the new executable."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    stdlib = sysconfig.get_paths()["stdlib"]
    shutil.copytree(stdlib, os.path.join(folder, os.path.relpath(stdlib, sys.base_prefix)), copy_function=link,
                    ignore=shutil.ignore_patterns("site-packages", "test", "idlelib", "tkinter", "turtledemo"))
    os.makedirs(os.path.join(folder, "bin"))
    executable = os.path.join(folder, "bin", os.path.basename(os.path.realpath(sys.executable)))
    link(os.path.realpath(sys.executable), executable)
    return executable


def _big_factorial_test(n):
    """A test whose expected value has more digits than Python's default int-to-str limit (4300)."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return [f"assert fact({n}) == {math.factorial(n)}"]
    finally:
        sys.set_int_max_str_digits(old)


FACT = _big_factorial_test(1700)  # 4,740 digits

SOLUTIONS = {
    # ---- plain code
    "plain": ("def f(x):\n    return x * x", SQUARE),
    "lambda": ("f = lambda x: x ** 2", SQUARE),
    "type hints": ("def f(x: int) -> int:\n    return x * x", SQUARE),
    "recursion": ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)", FIB),
    "a class behind the function": (
        "class Counter:\n    def __init__(self):\n        self.seen = {}\n"
        "    def add(self, w):\n        self.seen[w] = self.seen.get(w, 0) + 1\n"
        "def count_words(s):\n    c = Counter()\n    for w in s.split():\n        c.add(w)\n    return c.seen", WORDS),
    "a nested helper": (
        "def is_palindrome(s):\n    def clean(t):\n        return [c.lower() for c in t if c.isalnum()]\n"
        "    return clean(s) == clean(s)[::-1]", PALINDROME),
    "a generator": (
        "def primes(n):\n    def gen():\n        for k in range(2, n + 1):\n"
        "            if all(k % d for d in range(2, int(k ** 0.5) + 1)):\n                yield k\n"
        "    return list(gen())", PRIMES),
    "prints while solving": ("def f(x):\n    print('squaring', x)\n    return x * x\nprint(f(3))", SQUARE),
    "a global constant": ("POWER = 2\ndef f(x):\n    return x ** POWER", SQUARE),
    "an exception handled": ("def mean(xs):\n    try:\n        return sum(xs) / len(xs)\n    except ZeroDivisionError:\n"
                             "        return 0.0", MEAN),
    # ---- the standard library
    "import typing": ("from typing import List\ndef primes(n: int) -> List[int]:\n"
                      "    return [k for k in range(2, n + 1) if all(k % d for d in range(2, k))]", PRIMES),
    "import collections": ("from collections import Counter\ndef count_words(s):\n    return dict(Counter(s.split()))", WORDS),
    "import functools (lru_cache)": ("import functools\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n"
                                     "    return n if n < 2 else fib(n - 1) + fib(n - 2)", FIB),
    "import re": ("import re\ndef is_palindrome(s):\n    t = re.sub(r'[^a-z0-9]', '', s.lower())\n    return t == t[::-1]",
                  PALINDROME),
    "import string": ("import string\ndef is_palindrome(s):\n    t = [c for c in s.lower() if c in string.ascii_lowercase]\n"
                      "    return t == t[::-1]", PALINDROME),
    "import random (seeded, unused in the answer)": (
        "import random\nrandom.seed(0)\ndef f(x):\n    return x * x", SQUARE),
    "import heapq": ("import heapq\ndef top_k(xs, k):\n    return heapq.nlargest(k, xs)", TOP2),
    "import itertools": ("import itertools\ndef primes(n):\n    return [k for k in itertools.takewhile(lambda k: k <= n, "
                         "itertools.count(2)) if all(k % d for d in range(2, k))]", PRIMES),
    "import math": ("import math\ndef primes(n):\n    return [k for k in range(2, n + 1) if all(k % d for d in "
                    "range(2, math.isqrt(k) + 1))]", PRIMES),
    "import statistics": ("import statistics\ndef mean(xs):\n    return statistics.mean(xs)", MEAN),
    "import dataclasses": ("from dataclasses import dataclass\n@dataclass\nclass Box:\n    v: int\n"
                           "def f(x):\n    return Box(x * x).v", SQUARE),
    "import enum": ("import enum\nclass Op(enum.Enum):\n    SQUARE = 2\ndef f(x):\n    return x ** Op.SQUARE.value", SQUARE),
    "import fractions": ("from fractions import Fraction\ndef mean(xs):\n    m = Fraction(sum(xs), len(xs))\n"
                         "    return float(m) if m.denominator != 1 else int(m)", MEAN),
    "import operator and functools.reduce": ("import operator\nfrom functools import reduce\ndef fact(n):\n"
                                             "    return reduce(operator.mul, range(1, n + 1), 1)", FACT),
    "import bisect": ("import bisect\ndef top_k(xs, k):\n    s = []\n    for x in xs:\n        bisect.insort(s, x)\n"
                      "    return s[::-1][:k]", TOP2),
    "import json": ("import json\ndef count_words(s):\n    d = {}\n    for w in s.split():\n        d[w] = d.get(w, 0) + 1\n"
                    "    return json.loads(json.dumps(d))", WORDS),
    "import copy": ("import copy\ndef top_k(xs, k):\n    ys = copy.deepcopy(xs)\n    ys.sort(reverse=True)\n    return ys[:k]",
                    TOP2),
    "import textwrap and unicodedata": ("import textwrap, unicodedata\ndef is_palindrome(s):\n"
                                        "    t = [c.lower() for c in unicodedata.normalize('NFC', s) if c.isalnum()]\n"
                                        "    return t == t[::-1]", PALINDROME),
    "import decimal": ("from decimal import Decimal\ndef mean(xs):\n    m = Decimal(sum(xs)) / Decimal(len(xs))\n"
                       "    return int(m) if m == int(m) else float(m)", MEAN),
    "import sys (recursion limit)": ("import sys\nsys.setrecursionlimit(10000)\ndef fib(n, a=0, b=1):\n"
                                     "    return a if n == 0 else fib(n - 1, b, a + b)", FIB),
    # ---- run as a script
    "a __main__ block that reads input": (
        "def f(x):\n    return x * x\n\nif __name__ == '__main__':\n    n = int(input())\n    print(f(n))", SQUARE),
    "a main() that prints": ("def f(x):\n    return x * x\ndef main():\n    print(f(4))\nif __name__ == \"__main__\":\n    main()",
                             SQUARE),
    # ---- fences
    "```python": ("```python\ndef f(x):\n    return x * x\n```", SQUARE),
    "``` python (a space)": ("``` python\ndef f(x):\n    return x * x\n```", SQUARE),
    "```Python": ("```Python\ndef f(x):\n    return x * x\n```", SQUARE),
    "```python3": ("```python3\ndef f(x):\n    return x * x\n```", SQUARE),
    "```py": ("```py\ndef f(x):\n    return x * x\n```", SQUARE),
    "``` with no language": ("```\ndef f(x):\n    return x * x\n```", SQUARE),
    "CRLF line ends": ("Here you go:\r\n```python\r\ndef f(x):\r\n    return x * x\r\n```\r\n", SQUARE),
    "CRLF without a fence": ("def f(x):\r\n    return x * x\r\n", SQUARE),
    "a docstring holding triple backticks": (
        "```python\ndef f(x):\n    \"\"\"Square x.\n\n    ```\n    >>> f(3)\n    9\n    ```\n    \"\"\"\n    return x * x\n```",
        SQUARE),
    "a docstring holding a fence at column 0": (
        "```python\ndef fib(n):\n    \"\"\"Fibonacci.\n\n```\nfib(10) == 55\n```\n\"\"\"\n"
        "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```", FIB),
    "fenced, indented inside a list item": ("1. The code:\n\n   ```python\n   def f(x):\n       return x * x\n   ```\n", SQUARE),
    # ---- prose around the code
    "prose before and after the fence": ("To square a number, multiply it by itself.\n\n```python\ndef f(x):\n"
                                         "    return x * x\n```\n\nThis runs in O(1).", SQUARE),
    "prose then unfenced code": ("Here is the solution:\n\ndef f(x):\n    return x * x", SQUARE),
    "prose, unfenced code, prose": ("Sure! The function is:\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                                    "        a, b = b, a + b\n    return a\nIt runs in linear time.", FIB),
    "a usage example in a second python block": (
        "```python\ndef f(x):\n    return x * x\n```\n\nExample:\n\n```python\nprint(f(5))  # 25\n```", SQUARE),
    "a doctest-style usage block after the solution": (
        "```python\ndef top_k(xs, k):\n    return sorted(xs, reverse=True)[:k]\n```\nUsage:\n```python\n>>> top_k([3, 1, 2], 2)\n"
        "[3, 2]\n```", TOP2),
    "a usage line that reads input after the solution": ("def f(x):\n    return x * x\n\nprint(f(int(input())))", SQUARE),
    "a helper block and then the solution block": (
        "First a helper:\n```python\ndef clean(s):\n    return [c.lower() for c in s if c.isalnum()]\n```\n"
        "Then:\n```python\ndef is_palindrome(s):\n    return clean(s) == clean(s)[::-1]\n```", PALINDROME),
    "a shell block after the solution": ("```python\ndef f(x):\n    return x * x\n```\nRun it with:\n```bash\npython sq.py\n```",
                                         SQUARE),
    # ---- conversations
    "a conversation": ([{"role": "assistant", "content": "```python\ndef f(x):\n    return x * x\n```"}], SQUARE),
    "content as a list of parts": (
        [{"role": "assistant", "content": [{"type": "text", "text": "```python\ndef f(x):\n"},
                                           {"type": "text", "text": "    return x * x\n```"}]}], SQUARE),
    "content as a list of strings": ([{"role": "assistant", "content": ["def f(x):\n", "    return x * x\n"]}], SQUARE),
    # ---- big and deep answers
    "a factorial of more than 4300 digits": ("import math\ndef fact(n):\n    return math.factorial(n)", FACT),
    "a loop to a big integer": ("def fact(n):\n    r = 1\n    for k in range(2, n + 1):\n        r *= k\n    return r", FACT),
    "an answer nested deeper than 100": ("def nest(d):\n    v = []\n    for _ in range(d - 1):\n        v = [v]\n    return v",
                                         NEST),
}
