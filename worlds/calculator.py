"""The arithmetic world's calculator tool (`grpo.py --dataset embedded:arith_tools --tools worlds/calculator.py:add`).

A tool file as tools.py runs it: a function with type hints and a Google-style docstring (its JSON
schema comes from them), the standard library only, no state. Every call runs this file again in
sandbox.py's limited child process.
"""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
