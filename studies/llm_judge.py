"""An LLM judge as a reward function, in TRL's reward-function form (docs/studies.md, claim 6).

    JUDGE_MODEL=runs/sft python grpo.py --model runs/sft --reward_fn studies/llm_judge.py:llm_judge

The judge is eval.py's `--judge llm:` judge: a causal LM asked which of two responses is better,
in both orders (the mean cancels a position bias; rlhf/evaluation/judges.py's llm_judge). A reward needs one score per
completion, so the judge compares each completion with a fixed baseline: the judge model's own
greedy response to the same prompt (made once per prompt and kept). The reward is
P(the completion is better than the baseline), in [0, 1].

JUDGE_MODEL (default runs/sft) is any causal LM folder or Hub id eval.py's judge reads; it loads
once per process, frozen, in fp32 on the CPU or the trainer's device. On the embedded world the
only local language models are the world's own tiny policies, which were never taught to judge:
the study measures how far such a judge agrees with the gold judge before reading anything into
a policy trained on it.
"""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules

_JUDGE = {}  # the judge model, its tokenizer, and each prompt's baseline response


def _judge():
    if not _JUDGE:
        import common
        from rlhf import sampling

        path = os.environ.get("JUDGE_MODEL", "runs/sft")
        args = SimpleNamespace(dtype="float32", attn_implementation="auto", trust_remote_code=False, use_peft=False,
                               load_in_4bit=False, load_in_8bit=False)
        _JUDGE.update(tokenizer=common.load_tokenizer(path, False), baselines={}, sampling=sampling)
        _JUDGE["model"] = common.freeze(common.load_model(path, args))
        print(f"llm_judge: judge model {path}; baseline: its own greedy response to each prompt")
    return _JUDGE


def llm_judge(prompts, completions, **kwargs):
    """P(completion better than the judge model's greedy response), one float per completion."""
    from rlhf import data
    from rlhf.evaluation import judges

    j = _judge()
    model, tokenizer, baselines = j["model"], j["tokenizer"], j["baselines"]
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    new = sorted({p for p in prompts if isinstance(p, str) and p not in baselines})
    if new:
        rendered = [data.render_prompt(tokenizer, p) for p in new]
        out, _, _ = j["sampling"].sample_texts(model, tokenizer, rendered, 48, do_sample=False)
        baselines.update(zip(new, out))
    base = [baselines[p] if isinstance(p, str) else "" for p in prompts]
    probs = judges.llm_judge(model, tokenizer, list(prompts), texts, base, batch_size=32)
    return [0.5 if t == b else float(p) for t, b, p in zip(texts, base, probs)]  # the baseline itself ties
