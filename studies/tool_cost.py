"""studies/tool_cost.py: a price on tool calls for the arithmetic world's calculator (docs/worlds.md, "The arithmetic world with a calculator"). With the strict verifier alone a call costs nothing, so GRPO
learns to call the tool on every problem; with this reward added, a call must pay for itself.

    python grpo.py --model runs/sft_arith_tools --dataset embedded:arith_tools --tools worlds/calculator.py:add \
        --reward_fn arith_strict,studies/tool_cost.py:tool_cost --reward_weights 1,0.2 ...
"""


def tool_cost(prompts, completions, **kwargs):
    """Minus the number of tool calls in each exchange (its tool turns; TRL's messages); 0 for text."""
    return [-float(sum(m["role"] == "tool" for m in c)) if isinstance(c, list) else 0.0 for c in completions]
