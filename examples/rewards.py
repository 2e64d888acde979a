"""A reward function in TRL's contract, for examples/prompts.jsonl: called by keyword with the
completions and the dataset's other columns (here `topic`), it returns one float per completion."""


def brief_and_on_topic(completions, topic, **kwargs):
    """1 for a sentence of 5 to 12 words that names its topic and does not repeat itself, else 0;
    minus 0.1 per word over 12. (A toy: it checks form, not whether the sentence is true.)"""
    rewards = []
    for completion, t in zip(completions, topic):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        words = text.lower().split()
        name = t.split()[-1]
        stem = name[:-1] if name.endswith("s") else name  # "bees" and "bee", "chess" and "ches"
        good = 5 <= len(words) <= 12 and stem in text.lower() and len(set(words)) >= 0.8 * len(words)
        rewards.append(float(good) - 0.1 * max(0, len(words) - 12))
    return rewards
