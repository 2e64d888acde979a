"""One contract for what rewards receive, the same in every script that scores completions:
a reward function gets TRL's exact form (the decoded text, unchanged; one assistant message
holding it after a conversational prompt), a reward model reward.py's rendering of it. One
reward function and one reward model give identical scores through grpo.py, ppo.py,
dpo.py --online and eval.py."""

from types import SimpleNamespace

import torch
from conftest import chat_tokenizer

import common
import data
import dpo
import eval as ev
import grpo
import ppo
import reward
import sampling

REWARD_FN = '''
SEEN = []


def shape(prompts, completions, **columns):
    """A TRL-style format reward: reads c[0]["content"] after a conversation, c itself after text."""
    texts = [c[0]["content"] if isinstance(p, list) else c for p, c in zip(prompts, completions)]
    SEEN.extend(texts)
    return [float(t.startswith("alice")) + 0.01 * len(t) for t in texts]
'''


def test_every_script_scores_a_completion_alike(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = chat_tokenizer()
    rm_path = str(tmp_path / "rm")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(rm_path)
    tok.save_pretrained(rm_path)
    fn_path = tmp_path / "rewards.py"
    fn_path.write_text(REWARD_FN)
    spec = f"{fn_path}:shape"

    # a text prompt and a conversational one; the completions as the policy's generate + decode give them
    prompts = ["POST: alice bought the bike .\nTL;DR:", [{"role": "user", "content": "POST: bob lost the phone ."}]]
    c_ids, c_mask = data.encode_completions(tok, [" alice bought bike .", "bob lost phone ."])
    texts = sampling.decode_completions(tok, c_ids, c_mask, torch.tensor([False, False]))
    assert texts == [" alice bought bike .", "bob lost phone ."]  # the text itself: no EOS, nothing added or stripped
    columns = {"post": ["alice bought the bike .", "bob lost the phone ."]}
    args = SimpleNamespace(eval_batch_size=8, max_prompt_length=512, reward_model=rm_path, reward_fn=spec, reward_weights="", max_steps=1,
                           dtype="float32", attn_implementation="sdpa", trust_remote_code=False)

    # grpo.py: both sources at once, (N, K); the reward model centred by its reward_mean (0 here)
    rewards, _ = grpo.load_rewards(args)
    by_grpo = grpo.score(rewards, prompts, texts, None, columns, args)
    fn_scores, rm_scores = by_grpo[:, 0], by_grpo[:, 1]
    seen = rewards[0]["fn"].__globals__["SEEN"]
    assert seen == texts  # the function read the decoded text itself, after text and conversation alike
    # ppo.py
    rm, rm_tok = common.load_reward_model(rm_path, args)
    torch.testing.assert_close(ppo.score(common.load_reward_fns(spec), None, None, prompts, texts, None, columns, args), fn_scores)
    torch.testing.assert_close(ppo.score(None, rm, rm_tok, prompts, texts, None, columns, args), rm_scores)
    # dpo.py --online: its judges receive sample_pairs' reward_completions
    completions = sampling.reward_completions(prompts, texts)
    judge, _ = dpo.make_judge(SimpleNamespace(**{**vars(args), "reward_model": ""}), False)
    torch.testing.assert_close(judge(prompts, completions, None, columns), fn_scores)
    judge, _ = dpo.make_judge(SimpleNamespace(**{**vars(args), "reward_fn": ""}), False)
    torch.testing.assert_close(judge(prompts, completions, None, columns), rm_scores)
    # eval.py --judge gold --reward_fn ... and --judge rm:PATH
    by_eval = ev.judge_scores("gold", None, {"p": texts}, prompts, columns, args)["p"]
    torch.testing.assert_close(torch.tensor(by_eval, dtype=torch.float32), fn_scores)
    by_eval = ev.judge_scores("rm", rm_path, {"p": texts}, prompts, columns, args)["p"]
    torch.testing.assert_close(torch.tensor(by_eval, dtype=torch.float32), rm_scores)
    # ... and the reward model read what reward.py trains on: its rendering of (prompt, answer)
    for i, p in enumerate(prompts):
        answer = texts[i] if isinstance(p, str) else [{"role": "assistant", "content": texts[i]}]
        trained, _ = reward.pair_scores(rm, rm_tok, reward.render(rm_tok, [(p, answer, answer)]),
                                        SimpleNamespace(max_prompt_length=512, max_completion_length=256))
        assert abs(float(trained[0]) - float(rm_scores[i])) < 1e-5
