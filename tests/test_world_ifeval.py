"""The instruction-following world (embedded:ifeval): each family's verifier on answers that meet
and miss it, answers that try to game the verifiers, the strict verifier, the splits."""

import json

import pytest

from rlhf import reward_contract
from worlds import world_ifeval as wi
from worlds.world_ifeval import ifeval_strict


def conv(text):
    return [{"role": "user", "content": text}]


def study(name):
    """studies/<name>.py as a module (studies/ is not a package)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "studies", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def score(answer, constraints, keyword="ocean", prompt="Describe the ocean.", family=None):
    """ifeval_strict (or ifeval_<family>) on one answer, as TRL passes it: an assistant message."""
    fn = wi.VERIFIERS[f"ifeval_{family}"] if family else ifeval_strict
    return fn([conv(prompt)], [[{"role": "assistant", "content": answer}]], constraints=[constraints],
              keyword=[keyword])[0]


# one case per family: (constraints, an answer that meets them, one that misses them)
CASES = {
    "lowercase": (["lowercase"], "the ocean is deep and wide.", "The ocean is deep and wide."),
    "uppercase": (["uppercase"], "THE OCEAN IS DEEP.", "THE OCEAN is deep."),
    "include_word": (["include_word:blue"], "The ocean is blue and deep.", "The ocean is deep and wide."),
    "forbid_word": (["forbid_word:ocean"], "The sea is vast and deep.", "Oceans are vast and deep."),
    "max_words": (["max_words:6"], "The ocean is vast and deep.", "The ocean is vast and deep and very old."),
    "start_with": (["start_with:Indeed"], "Indeed, the ocean is vast.", "The ocean is vast, indeed."),
    "end_with": (["end_with:always"], "The ocean moves always.", "The ocean always moves."),
    "no_commas": (["no_commas"], "The ocean is vast and deep.", "The ocean is vast, deep and old."),
    "quotes": (["quotes"], '"The ocean is vast and deep."', 'The ocean is "vast" and deep.'),
    "bullets": (["bullets:2"], "- The ocean is deep.\n- It covers most of Earth.",
                "- The ocean is deep.\n- It covers most of Earth.\n- It is salty."),
    "json": (["json"], '{"answer": "The ocean is vast and deep."}', '{"reply": "The ocean is vast and deep."}'),
    "number_only": (["number_only:83"], "83", "38 + 45 = 83"),
}


def test_every_family_has_a_case():
    assert set(CASES) == set(wi.FAMILIES)


@pytest.mark.parametrize("family", wi.FAMILIES)
def test_each_family_verifier_meets_and_misses(family):
    constraints, good, bad = CASES[family]
    kw = "83" if family == "number_only" else "ocean"
    assert score(good, constraints, kw, family=family) == 1.0 and score(good, constraints, kw) == 1.0
    assert score(bad, constraints, kw, family=family) == 0.0 and score(bad, constraints, kw) == 0.0
    # a family's verifier does not apply to a prompt without that family (TRL's None)
    other = "lowercase" if family != "lowercase" else "no_commas"
    assert score(good, constraints, kw, family=other) is None


@pytest.mark.parametrize("family", wi.FAMILIES)
def test_gaming_answers_score_zero(family):
    """Empty, the constraint's word alone, an echo of the prompt, a degenerate repetition: 0 for
    the family's verifier and the strict one, whatever the constraint."""
    constraints, good, _ = CASES[family]
    kw = "83" if family == "number_only" else "ocean"
    _, arg = wi.split_constraint(constraints[0])
    prompt = "Describe the ocean. " + wi.instruction(__import__("random").Random(0), constraints[0])
    word = "number" if family == "number_only" else arg or "ocean"  # number_only's argument is the answer itself
    gaming = ["", "   ", word, prompt, "ocean ocean ocean ocean", "the " * 30]
    if family == "json":
        gaming += ['{"answer": ""}', '{"answer": "ocean"}']
    if family == "quotes":
        gaming += ['""', '"ocean"']
    if family == "bullets":
        gaming += ["- ocean\n- ocean", "- \n- "]
    for answer in gaming:
        for fam in (family, None):
            assert score(answer, constraints, kw, prompt=prompt, family=fam) == 0.0, (answer, fam)


def test_response_checks():
    # max_words at its boundary: 6 words pass a limit of 6, 7 do not
    assert score("The ocean is vast and deep.", ["max_words:6"]) == 1.0
    assert score("The ocean is vast and very deep.", ["max_words:6"]) == 0.0
    # a topic answer names its topic (any form), unless that word is forbidden
    assert score("It is vast and deep.", ["max_words:8"]) == 0.0
    assert score("Oceans are vast and deep.", ["max_words:8"]) == 1.0
    assert score("It is vast and deep.", ["forbid_word:ocean"]) == 1.0
    # fewer than MIN_WORDS words; a word three times in a row; mostly one word
    assert score("ocean waves", ["max_words:8"]) == 0.0
    assert score("the ocean is deep deep deep", ["max_words:8"]) == 0.0
    assert score("ocean blue ocean blue ocean blue ocean blue", ["include_word:blue"]) == 0.0
    # an echo: six words of the prompt in a row
    prompt = "Write one sentence about the ocean. Include the word 'blue'."
    assert score("write one sentence about the ocean blue", ["include_word:blue"], prompt=prompt) == 0.0
    assert score("The ocean looks blue from the beach.", ["include_word:blue"], prompt=prompt) == 1.0


def test_a_system_turn_is_echoed_too():
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    prompt = [{"role": "system", "content": system}, {"role": "user", "content": "Describe swimming. Do not say 'swimming'."}]
    answer = [{"role": "assistant", "content": system}]
    assert ifeval_strict([prompt], [answer], [["forbid_word:swimming"]], ["swimming"]) == [0.0]
    answer = [{"role": "assistant", "content": "People move through water using their arms and legs."}]
    assert ifeval_strict([prompt], [answer], [["forbid_word:swimming"]], ["swimming"]) == [1.0]


@pytest.mark.parametrize("with_system", [True, False])
def test_answers_addressed_to_the_model_score_zero(with_system):
    """What GRPO found (make demo-real, first run): the system prompt SmolLM2's chat template adds,
    echoed verbatim or as a short template on it, passed the topic checks. The world's prompts state
    that system turn; one that does not is checked against it all the same (the template adds it)."""
    prompt = wi.conversation("Write one sentence about the desert. Answer in at most 8 words.")
    prompt = prompt if with_system else prompt[1:]
    assert prompt[0]["role"] == ("system" if with_system else "user")

    def strict(answer, constraints=("max_words:8",)):
        return ifeval_strict([prompt], [[{"role": "assistant", "content": answer}]], [list(constraints)], ["desert"])[0]

    for answer in ["You are a desert.", "You are a green desert.", "you are the desert sand", "You are desert wind",
                   "You're a desert wind",
                   "helpful AI assistant named SmolLM trained desert"]:  # the last: an echo of the system turn
        assert strict(answer) == 0.0, answer
    # verbatim, where nothing else refuses it (no topic word needed when the keyword is forbidden)
    assert strict("You are a helpful AI assistant named SmolLM, trained by Hugging Face", ["forbid_word:desert"]) == 0.0
    assert strict("It is a helpful AI assistant named SmolLM.", ["forbid_word:desert"]) == 0.0  # an echo, not addressed
    assert strict("Sand dunes stretch for miles under the sun.", ["forbid_word:desert"]) == 1.0
    assert strict("The desert is hot and dry.") == 1.0
    assert strict("Deserts are dry places.") == 1.0
    # the rule follows the system turn the prompt states: another one opens otherwise
    other = [{"role": "system", "content": "Answer briefly."}, prompt[-1]]
    assert ifeval_strict([other], [[{"role": "assistant", "content": "You are a desert."}]], [["max_words:8"]],
                         ["desert"]) == [1.0]


def test_forbid_word_never_forbids_the_topic():
    """The world forbids a common word, not the topic's keyword, so a non-answer cannot pass: the first
    real GRPO run passed forbid_word prompts with "I'm not sure what you're talking about."."""
    world = wi.build_world(seed=0)
    rows = [r for split in ("rl", "test") for r in world[split] if r["family"] == "forbid_word"]
    assert len(rows) > 50 and {wi.split_constraint(r["constraints"][0])[1] for r in rows} == set(wi.FORBID_WORDS)
    for r in rows:
        assert wi.split_constraint(r["constraints"][0])[1] not in (r["keyword"], r["keyword"] + "s")
    r = next(r for r in rows if len(r["constraints"]) == 1)
    arg, kw = wi.split_constraint(r["constraints"][0])[1], r["keyword"]
    strict = lambda answer: ifeval_strict([r["prompt"]], [answer], [r["constraints"]], [kw])[0]  # noqa: E731
    assert strict("I'm not sure what you're talking about.") == 0.0
    assert strict(f"I like the {kw} {arg} more.") == 0.0 and strict(f"I like the {kw} {arg.upper()}.") == 0.0
    assert strict(f"I like the {kw} more than anything.") == 1.0
    # the forbidden word alone, not a word that starts with it: "the" forbids "The", not "they"
    assert score("They say the sea is vast.", ["forbid_word:the"]) == 0.0
    assert score("They say oceans are vast.", ["forbid_word:the"]) == 1.0


def test_world_prompts_state_the_system_turn():
    world = wi.build_world(seed=0, sizes={"rl": 50, "test": 50})
    for split in ("rl", "test"):
        for p in world[split]["prompt"]:
            assert [m["role"] for m in p] == ["system", "user"] and p[0]["content"] == wi.SYSTEM


def test_strict_needs_every_constraint():
    cs = ["lowercase", "include_word:blue"]
    assert score("the ocean is blue.", cs) == 1.0
    assert score("The ocean is blue.", cs) == 0.0 and score("The ocean is blue.", cs, family="include_word") == 1.0
    assert score("the ocean is deep.", cs) == 0.0 and score("the ocean is deep.", cs, family="lowercase") == 1.0
    # the text after a plain-string prompt works as well (TRL's standard format)
    assert ifeval_strict(["Describe the ocean."], ["the ocean is blue."], [cs], ["ocean"]) == [1.0]


def test_verifiers_load_by_name():
    assert reward_contract.load_reward_fn("ifeval_strict") is ifeval_strict
    assert reward_contract.load_reward_fn("ifeval_max_words").__name__ == "ifeval_max_words"


def test_splits_are_disjoint_fixed_and_hold_out_families():
    worlds = {s: wi.build_world(seed=s, sizes={"rl": 400}) for s in (0, 1)}
    test = worlds[0]["test"]
    assert len(test) >= 300 and test.to_list() == worlds[1]["test"].to_list()  # the same for every seed
    assert set(test["family"][:wi.TEST_SIZE]) == set(wi.WORLD_FAMILIES)
    # then the same tasks in IFEval's wording, for every family IFEval has
    assert set(test["family"][wi.TEST_SIZE:]) == {wi.IFEVAL + f for f in wi.WORLD_FAMILIES if f in wi.IFEVAL_WORDING}
    for world in worlds.values():
        rl = world["rl"]
        assert not set(rl["topic"]) & set(test["topic"])  # disjoint by topic (and number pair)
        assert not {r[-1]["content"] for r in rl["prompt"]} & {r[-1]["content"] for r in test["prompt"]}
        held = {wi.split_constraint(c)[0] for cs in rl["constraints"] for c in cs} & set(wi.HELD_OUT)
        assert not held  # the transfer families are never trained on
    assert worlds[0]["rl"]["prompt"] != worlds[1]["rl"]["prompt"]
    for r in test:  # the family is the first constraint's; no contradicting pair
        fams = [wi.split_constraint(c)[0] for c in r["constraints"]]
        assert all(f.startswith(wi.IFEVAL) for f in fams) == r["family"].startswith(wi.IFEVAL)  # one wording a prompt
        fams, r["family"] = [wi.base_family(f) for f in fams], wi.base_family(r["family"])
        assert fams[0] == r["family"] and len(set(fams)) == len(fams)
        assert frozenset(fams) not in wi.CLASH


def test_dpo_pairs_from_own_samples():
    """studies/ifeval_pairs.py: pairs of a prompt with a pass and a fail, chosen a pass that was not
    truncated, rejected a fail, distinct texts, in sample order, at most per_prompt; all-pass or
    all-fail prompts give none."""
    module = study("ifeval_pairs")
    rows = [{"prompt": conv(f"p{i}"), "family": "lowercase"} for i in range(3)]
    texts = ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"]
    scores = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    truncated = [False, True, False, False, False, False, False, False, False]
    pairs = module.preference_pairs(rows, texts, scores, truncated, 3)
    assert [(p["prompt"][0]["content"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("p0", "a2", "a0"), ("p2", "c0", "c1")]
    assert pairs[0]["chosen"][0]["role"] == "assistant" and pairs[0]["family"] == "lowercase"
    texts = ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    truncated = [False] * 8
    texts[3] = "a1"  # the same failing text twice is one rejected answer
    pairs = module.preference_pairs(rows[:2], texts, scores, truncated, 4, per_prompt=2)
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("a0", "a1"), ("a2", "a1"), ("b0", "b1"), ("b0", "b2")]
    pairs = module.preference_pairs(rows[:2], texts, scores, truncated, 4, per_prompt=4)
    assert len(pairs) == 5 and (pairs[-1]["chosen"][0]["content"], pairs[-1]["rejected"][0]["content"]) == ("b0", "b3")


def test_kto_rows_from_the_same_samples():
    """studies/ifeval_pairs.py --kto_output: each distinct sample of a prompt once, thumbs up for a pass
    that was not truncated, down for a fail; a truncated pass is left out, as from the pairs."""
    module = study("ifeval_pairs")
    rows = [{"prompt": conv(f"p{i}"), "family": "lowercase"} for i in range(2)]
    texts = ["a0", "a1", "a0", "a3", "b0", "b1", "b2", "b0"]
    scores = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    truncated = [False, True, False, False, False, False, False, False]
    kto = module.unpaired_rows(rows, texts, scores, truncated, 4)
    assert [(r["prompt"][0]["content"], r["completion"][0]["content"], r["label"]) for r in kto] == [
        ("p0", "a0", True), ("p0", "a3", False), ("p1", "b0", False), ("p1", "b1", False), ("p1", "b2", True)]
    assert kto[0]["completion"][0]["role"] == "assistant" and kto[0]["family"] == "lowercase"


def test_wording_report_compares_each_task_with_its_twin(tmp_path):
    """studies/ifeval_wording.py: each test task with an IFEval-worded twin is paired with that twin
    (the same task, IFEval's wording), and a policy's accuracy and its gain over the base are read on
    those tasks only, in each wording, from eval.py's judgments."""
    module = study("ifeval_wording")
    test = wi.build_world(0, sizes={"rl": 10})["test"]
    pairs = module.twin_pairs(test)
    assert len(pairs) == len(test) - wi.TEST_SIZE > 100
    for o, t in pairs:
        assert test[t]["prompt"] == wi.ifeval_twin(test[o])["prompt"] and test[t]["family"].startswith(wi.IFEVAL)
    twins = {t for _, t in pairs}
    with open(tmp_path / "judgments.jsonl", "w") as f:  # grpo passes every original, no twin; the base nothing
        for i in range(len(test)):
            f.write(json.dumps({"prompt_id": i, "policy_a": "grpo", "policy_b": "base", "score_a": float(i not in twins),
                                "score_b": 0.0}) + "\n")
    scores = module.scores_by_policy(str(tmp_path))
    rows = module.table(["base", "grpo"], scores, pairs).splitlines()
    assert rows[2].startswith("| base | 0.000 (0.000, 0.000) | 0.000 (0.000, 0.000) | - | -")
    assert rows[3] == "| grpo | 1.000 (1.000, 1.000) | 0.000 (0.000, 0.000) | 1.000 (1.000, 1.000) | 0.000 (0.000, 0.000) |"


def test_report_pools_a_methods_seeds():
    """studies/ifeval_report.py: a method over several training seeds shows each seed's accuracy and
    the answers' shares pooled over its runs (not its first run's alone)."""
    module = study("ifeval_report")
    group = {"score": 0.5, "ci_low": 0.0, "ci_high": 1.0, "n": 2}
    policy = lambda runs: {"score": 0.5, "score_ci_low": 0.1, "score_ci_high": 0.9, "by_group": {"max_words": group},  # noqa: E731
                           "runs": runs, "truncated_frac": 0.0}
    results = {"policies": {"base": policy(["base"]), "grpo": {**policy(["grpo/seed0", "grpo/seed1"]),
                                                               "score_seed_ci_low": 0.05, "score_seed_ci_high": 0.95}},
               "runs": {"base": {"score": 0.5}, "grpo/seed0": {"score": 0.25}, "grpo/seed1": {"score": 0.75}},
               "pairwise": []}
    generations = [{"responses": {"base": "The ocean is deep.", "grpo/seed0": "", "grpo/seed1": "The sea is wide today."}},
                   {"responses": {"base": "The sky is blue.", "grpo/seed0": "Rain falls.", "grpo/seed1": "Snow."}}]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in module.table(results, generations).splitlines()}
    assert rows["per run (training seed)"] == ["0.500", "0.250, 0.750 |"]
    assert rows["strict accuracy, all families"] == ["**0.500** (0.100, 0.900)", "**0.500** (0.050, 0.950) |"]  # seeds + prompts
    assert rows["empty answers"] == ["0.000", "0.250 |"]  # one empty answer of grpo's four, not 1 of 2
    assert rows["mean length (words)"] == ["4.0", "2.0 |"]  # (0 + 5 + 2 + 1) / 4; the first run alone: 1.0


def test_seeds_table_runs_every_method_on_its_own_seeds_data():
    """`make -n`: real-more SEED=1 trains online DPO with the verifier as its judge, the reward model
    on seed 1's own labelled pairs and PPO against that reward model; demo-real-seeds pools each
    method's runs over the seeds (a slip in a path would mix seeds or train PPO on seed 0's model).
    Only recipes without $(MAKE) in them, which `make -n` really prints and does not run."""
    import os
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = lambda *a: subprocess.run(["make", "-n", "--no-print-directory", *a], cwd=root, capture_output=True,  # noqa: E731
                                    text=True, check=True).stdout
    stages = run("real-eval-online", "real-eval-ppo", "SEED=1")
    assert "dpo.py --online --seed 1" in stages and "--reward_fn ifeval_strict" in stages
    assert "--output_dir runs/real_seed1/dpo_online" in stages
    assert "reward.py --seed 1 --model models/SmolLM2-135M-Instruct --dataset runs/real_seed1/pairs.jsonl" in stages
    assert "ppo.py --seed 1 --model models/SmolLM2-135M-Instruct --reward_model runs/real_seed1/reward" in stages
    assert "ppo=runs/real_seed1/ppo " in stages and "dpo_online=runs/real_seed1/dpo_online " in stages
    assert "--cache_dir runs/real_seed1/cache" in stages
    seeds = run("real-seeds-eval", "REAL_SEEDS=0 2")  # demo-real-seeds' last step (-n would run its loop's makes)
    for m in ("grpo", "dpo", "dpo_online", "ppo"):
        assert f" {m}=runs/real/{m},runs/real_seed2/{m} " in seeds


# ---------------------------------------------------------------- IFEval's own checkers (lm-eval)
def ifeval_checker(family, arg):
    """lm-eval's checker of the IFEval instruction that `family` states in IFEval's wording, built
    with the argument the world's prompt states."""
    from lm_eval.tasks.ifeval import instructions_registry

    iid = wi.IFEVAL_WORDING[family][0]
    kwargs = {"include_word": lambda: {"keywords": [arg]}, "forbid_word": lambda: {"forbidden_words": [arg]},
              "max_words": lambda: {"num_words": int(arg) + 1, "relation": "less than"},
              "end_with": lambda: {"end_phrase": arg}, "bullets": lambda: {"num_bullets": int(arg)}}.get(family, dict)()
    checker = instructions_registry.INSTRUCTION_DICT[iid](iid)
    return checker, checker.build_description(**kwargs)


def answers_for(row):
    """Answers to one prompt: ones that meet and miss each family's rule at its edges (a full stop
    after the end phrase, "it's" as two words, a keyword inside a longer word, a forbidden word's
    plural), and the gaming answers the response checks refuse."""
    kw, text = row["keyword"], row["prompt"][-1]["content"]
    args = [wi.split_constraint(c)[1] for c in row["constraints"]]
    arg = args[0] or "blue"
    plain = f"The {kw} is calm and bright in the morning"
    return [plain, plain + ".", plain.lower(), plain.upper(), plain.upper() + " " + arg.upper(), f"{plain} {arg}",
            f"{plain} {arg}.", f'"{plain} {arg}"', f"{plain}, {arg}", f"the {kw} is calm, it's {arg}",
            f"The {kw} is {arg}s and more", f"The {kw} is very old and golden {arg}", f"every {kw} is bold",
            f"The {kw}'s colour is everyday and {arg}", f"* the {kw}\n* is calm\n* {arg}", f"- the {kw}\n- is {arg}",
            f"**the {kw}** is calm\n* one\n- two", f'{{"answer": "the {kw} is {arg}"}}', f'```json\n{{"{kw}": 1}}\n```',
            f"the {kw} " + " ".join(["word"] * int(args[0] if args[0].isdigit() else 3)), f"The {kw} {kw} {kw} is {arg}",
            # gaming: empty, the argument alone, an echo of the prompt, degenerate, off-topic, addressed to the model
            "", "   ", arg, text, f"{arg} {arg} {arg} {arg}", "It is calm and bright today.", "You are a helpful " + kw]


def test_ifeval_wording_is_ifevals_own():
    """Each family's IFEval wording is what lm-eval's build_description writes for its instruction."""
    pytest.importorskip("lm_eval.tasks.ifeval.instructions", reason="lm-eval is not installed (pip install -r requirements-tasks.txt)")
    for family, (_, wording) in wi.IFEVAL_WORDING.items():
        arg = {"include_word": "morning", "forbid_word": "very", "max_words": "6", "end_with": "today", "bullets": "3"}.get(family, "")
        _, theirs = ifeval_checker(family, arg)
        assert wording.format(arg=arg, arg_plus_one=int(arg) + 1 if arg.isdigit() else "") == theirs, family


def test_ifeval_checkers_agree_with_the_verifiers():
    """On every other IFEval-worded test prompt and ~28 answers each (a few thousand in all, edges
    and gaming answers included), the world's rule for each constraint (check_ifeval) gives what
    lm-eval's checker gives, and the verifiers' score is IFEval's verdict with the response checks
    on top: 1 exactly when the answer is a response and every IFEval checker passes it."""
    pytest.importorskip("lm_eval.tasks.ifeval.instructions", reason="lm-eval is not installed (pip install -r requirements-tasks.txt)")
    import langdetect

    langdetect.DetectorFactory.seed = 0  # IFEval's case checkers ask langdetect, which samples
    rows = [r for r in wi.build_world(0, sizes={"rl": 10})["test"] if r["family"].startswith(wi.IFEVAL)][::2]
    language_decides = 0
    compared, refused, not_english, families = 0, 0, [], set()
    for row in rows:
        cs = [wi.split_constraint(c) for c in row["constraints"]]
        checkers = [(wi.base_family(f), arg, ifeval_checker(wi.base_family(f), arg)[0]) for f, arg in cs]
        for answer in answers_for(row):
            verdicts = []
            for family, arg, checker in checkers:
                theirs = bool(checker.check_following(answer)) if answer.strip() else False  # IFEval scores an empty answer 0
                if family in ("lowercase", "uppercase") and any(c.isalpha() for c in answer) and langdetect.detect(answer) != "en":
                    # IFEval's case checkers also ask langdetect for English; check_ifeval does not (its docstring)
                    theirs = answer.islower() if family == "lowercase" else answer.isupper()
                    not_english.append(answer)
                ours = bool(wi.check_ifeval(family, arg, answer)) if answer.strip() else False
                assert ours == theirs, (row["constraints"], family, answer)
                verdicts.append(theirs)
                families.add(family)
                compared += 1
            response = wi.is_response(answer, wi._prompt_text(row["prompt"]), row["constraints"], row["keyword"])
            assert score(answer, row["constraints"], row["keyword"], prompt=row["prompt"][-1]["content"]) == float(response and all(verdicts))
            refused += not response
            language_decides += response and answer in not_english
    assert compared >= 300 and refused >= len(rows) * 6  # a few thousand verdicts; every gaming answer refused
    # the one rule left out: langdetect calls some short all-capital or all-lowercase English answers
    # another language (67 of 3780 verdicts here), where IFEval gives 0 and the verifiers 1
    assert language_decides <= compared / 20, language_decides
    assert families == {f for f in wi.WORLD_FAMILIES if f in wi.IFEVAL_WORDING}
