"""The studies' summary scripts (docs/studies.md, claims 3, 4 and 6) on hand-written run and eval
folders: what they read, what they count, and the JSON they write."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "studies", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _results(path, policies, runs):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "results.json"), "w") as f:
        json.dump({"policies": policies, "runs": runs}, f)


def _policy(score, paths):
    return {"paths": paths, "score": score, "score_ci_low": score - 0.1, "score_ci_high": score + 0.1,
            "score_seed_ci_low": score - 0.2, "score_seed_ci_high": score + 0.2}


def _main(module, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["study", *argv])
    module.main()


def test_dual_clip_counts_collapses_and_binding_steps(tmp_path, monkeypatch):
    runs = tmp_path / "sweep"
    grpo = lambda dual: [{"step": i + 1, "reward": r, "clip_ratio": 0.01, "clip_ratio/dual_mean": d}
                         for i, (r, d) in enumerate(zip([0.4, 0.4, 0.4, 0.4, 0.9, 0.1], dual))]
    _write(str(runs / "c3" / "seed0" / "metrics.jsonl"), grpo([0, 0.001, 0, 0.002, 0, 0]))
    _write(str(runs / "c3" / "seed1" / "metrics.jsonl"), grpo([0] * 6) + [{"step": 6, "eval_reward": 0.5}])
    ppo = [{"step": 1, "reward": 0.5, "clipfrac": 0.1, "dual_clip_frac": 0.0, "vf_loss": 1.0}]
    _write(str(runs / "c0" / "seed0" / "metrics.jsonl"), ppo)
    paths = {s: sorted(str(p) for p in (runs / s).iterdir()) for s in ("c3", "c0")}
    _results(str(tmp_path / "eval"), {"sft": _policy(0.8, ["sft"]), "dual": _policy(0.6, paths["c3"]), "off": _policy(0.3, paths["c0"])},
             {"sft": {"path": "sft", "score": 0.8}, "d0": {"path": paths["c3"][0], "score": 0.9},
              "d1": {"path": paths["c3"][1], "score": 0.3}, "o0": {"path": paths["c0"][0], "score": 0.3}})
    out = tmp_path / "dual.json"
    _main(_study("dual_clip"), ["--runs", str(runs), "--eval", str(tmp_path / "eval"), "--output", str(out)], monkeypatch)
    result = json.loads(out.read_text())
    assert result["collapse_below"] == pytest.approx(0.4)
    dual, off = result["settings"]["c3"], result["settings"]["c0"]
    assert dual["method"] == "dual" and dual["accuracy_per_seed"] == [0.9, 0.3] and dual["runs_collapsed"] == 1
    first, second = dual["training"]
    assert first["steps_dual_binds"] == 2 and second["steps_dual_binds"] == 0 and first["script"] == "grpo"
    assert first["reward_first_4_steps"] == pytest.approx(0.4) and first["reward_last_20_steps"] == pytest.approx(2.6 / 6)
    assert off["training"][0]["script"] == "ppo" and off["runs_collapsed"] == 1


def test_optim_precision_measures_the_gap_of_moving_means(tmp_path, monkeypatch):
    runs = tmp_path / "sweep"
    base = [1.0] * 10
    _write(str(runs / "optimadamw-dtypefloat32" / "seed0" / "metrics.jsonl"), [{"step": i + 1, "loss": x} for i, x in enumerate(base)])
    drift = [1.0] * 6 + [2.0] * 4  # one jump: with a window of 2 the moving means part by 1.0 from step 8 on
    _write(str(runs / "optimadamw_8bit-dtypefloat32" / "seed0" / "metrics.jsonl"), [{"step": i + 1, "loss": x} for i, x in enumerate(drift)])
    for s, score in (("optimadamw-dtypefloat32", 0.5), ("optimadamw_8bit-dtypefloat32", 0.6)):
        with open(runs / s / "seed0" / "summary.json", "w") as f:
            json.dump({"gold_score": score}, f)
    _main(_study("optim_precision"), ["--runs", str(runs), "--metric", "loss", "--window", "2", "--output", str(tmp_path / "o")], monkeypatch)
    result = json.loads((tmp_path / "o.json").read_text())
    row = result["settings"]["optimadamw_8bit-dtypefloat32"]["per_seed"][0]
    assert row["max_gap_vs_optimadamw-dtypefloat32"] == pytest.approx(1.0) and row["step_of_max_gap"] == 8
    assert row["first_step_differing"] == 7 and row["final_metric"] == pytest.approx(2.0) and row["score"] == 0.6
    assert "max_gap_vs_optimadamw-dtypefloat32" not in result["settings"]["optimadamw-dtypefloat32"]["per_seed"][0]
    assert (tmp_path / "o.png").exists()


def test_judge_agreement_counts_over_the_comparisons_gold_decides(tmp_path, monkeypatch):
    key = lambda i, w: {"prompt_id": i, "policy_a": "a", "policy_b": "b", "winner": w}
    gold = [key(0, "a"), key(1, "b"), key(2, "tie"), key(3, "a"), {**key(4, "a"), "policy_b": "reference"}]
    judge = [key(0, "a"), key(1, "a"), key(2, "a"), key(3, "tie"), {**key(4, "b"), "policy_b": "reference"}]
    for name, rows in (("gold", gold), ("judge", judge)):
        _write(str(tmp_path / name / "judgments.jsonl"), rows)
    _main(_study("judge_agreement"), [str(tmp_path / "gold"), str(tmp_path / "judge"), "--output", str(tmp_path / "a.json")], monkeypatch)
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["comparisons"] == 4 and result["gold_decided"] == 3  # the reference's rows are left out
    assert result["agree"] == pytest.approx(1 / 3) and result["judge_tie"] == pytest.approx(1 / 3)
    assert result["disagree"] == pytest.approx(1 / 3) and result["gold_ties_judge_decided"] == pytest.approx(1 / 4)


def test_reward_blindspot_pairs_miscopy_one_fact_and_skip_test_posts(monkeypatch):
    from worlds import world
    study = _study("reward_blindspot")
    small = world.build_world(0, sizes={"sft": 10, "prefs": 10, "contrast": 10, "rl": 10, "test": 20})
    monkeypatch.setattr(world, "build_world", lambda seed: small)
    rows = study.pairs(0, 0.5, 200)
    assert len(rows) == 200 and not {world.post_from_prompt(r["prompt"]) for r in rows} & set(small["test"]["post"])
    for r in rows:  # labels carry the gold scores of what they label
        post = world.post_from_prompt(r["prompt"])
        assert world.gold_score(post, r["chosen"]) == r["chosen_gold"] and world.gold_score(post, r["rejected"]) == r["rejected_gold"]
    confused_rows = [r for r in rows if any(world.gold_counts(world.post_from_prompt(r["prompt"]), t)["unsupported"] == 1
                                             and len(t.split(".")) - 1 == len(world.key_facts(world.post_from_prompt(r["prompt"])))
                                             for t in (r["chosen"], r["rejected"]))]
    assert len(confused_rows) > 50  # half the writers are confused
    minimal = study.minimal_pairs(0, 0.5, 200)  # --writer minimal: the reference against one error
    assert len(minimal) == 200 and not {r["post"] for r in minimal} & set(small["test"]["post"])
    kinds = {"copy": 0, "omission": 0, "annotators": 0}
    for r in minimal:
        counts = world.gold_counts(r["post"], r["rejected"])
        reference = " " + world.reference_summary(world.key_facts(r["post"]))
        if r["chosen"] == reference and counts["missed"] == 1 and counts["unsupported"] == 1:
            kinds["copy"] += 1  # every clause of the reference but one, which states a fact the post does not
            assert len(r["rejected"].split()) == len(reference.split()), r
        elif r["chosen"] == reference and counts["missed"] == 1 and counts["unsupported"] == 0:
            kinds["omission"] += 1  # a lazy annotator against a careful one gives these too
        else:
            kinds["annotators"] += 1
    assert kinds["copy"] > 70 and kinds["omission"] > 30 and kinds["annotators"] > 20, kinds


def test_copy_errors_counts_clauses_by_place_and_where_a_wrong_one_took_its_words():
    study = _study("copy_errors")
    post = "alice bought the bike . i think bob lost the red phone . carol was happy ."
    rows = [{"prompt": f"POST: {post}\nTL;DR:", "responses": {
        "a": " alice bought bike . bob lost phone .",    # both right
        "b": " alice bought bike . bob bought bike .",   # the second takes the first fact's action and object
        "c": " alice lost bike .",                       # the next fact's action
        "d": " alice bought bike . dave lost phone . the end ."}}]  # a person with no fact; no fact
    assert study.copy_errors(rows, "a") == ({0: (1, 1), 1: (1, 1)}, {})
    assert study.copy_errors(rows, "b") == ({0: (1, 1), 1: (0, 1)}, {"action from -1; object from -1": 1})
    assert study.copy_errors(rows, "c") == ({0: (0, 1)}, {"action from +1": 1})
    assert study.copy_errors(rows, "d")[1] == {"no fact of this person": 1, "no fact": 1}


def test_unused_rows_early_stops_reads_the_stop_and_frozen_rows_stay_zero():
    """studies/unused_rows.py: at a greedy stop before the post's last fact, the probabilities of
    EOS and of the names are the model's; rows frozen at zero stay zero through an optimizer step."""
    from types import SimpleNamespace

    import torch

    from worlds import scratch
    from worlds import world
    study = _study("unused_rows")
    tok = world.build_tokenizer()
    post = "bob sold the car . i think alice lost the red kettle ."
    clause = tok(" bob sold car .", add_special_tokens=False)["input_ids"]
    names = [tok(" " + p, add_special_tokens=False)["input_ids"][0] for p in world.PEOPLE]

    class Scripted:  # writes the first fact's clause, then: EOS 0.4, five names 0.1 each, " ." 0.1
        def __call__(self, input_ids):
            written = input_ids.shape[1] - prompt_len
            probs = torch.zeros(len(tok))
            if written < len(clause):
                probs[clause[written]] = 1.0
            else:
                probs[tok.eos_token_id], probs[names[:5]], probs[clause[-1]] = 0.4, 0.1, 0.1
            return SimpleNamespace(logits=probs.log()[None, None])

    prompt = world.PROMPT_TEMPLATE.format(post=post)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    got = study.early_stops(Scripted(), tok, {"prompt": [prompt], "post": [post]})
    assert got == {"early_stops": 1, "early_stops_names_above_eos": 1, "early_stop_p_eos": 0.4,
                   "early_stop_p_names": 0.5, "early_stop_p_top_name": 0.1}

    world_rows = world.build_world(0, sizes={"sft": 20, "prefs": 2, "contrast": 0, "rl": 2, "test": 2})["sft"]
    texts = [p + c for p, c in zip(world_rows["prompt"], world_rows["completion"])]
    model = study.freeze_zero_rows(scratch.build_model(tok, 32, 1, 0, texts=texts))
    weight = model.get_input_embeddings().weight
    zero = (weight == 0).all(1)
    assert 250 < int(zero.sum()) < len(tok)  # the bytes the text never uses
    before = weight.detach().clone()
    ids = torch.tensor([tok(texts[0], add_special_tokens=False)["input_ids"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert torch.equal(weight[zero], before[zero]) and not torch.equal(weight[~zero], before[~zero])


def test_reward_blindspot_pair_kind_finds_the_world_contrast_pairs():
    from worlds import world
    study = _study("reward_blindspot")
    annotators = world.build_world(5, sizes={"sft": 10, "prefs": 300, "contrast": 0, "rl": 10, "test": 10})["prefs"]
    mixed = world.build_world(5, sizes={"sft": 10, "prefs": 300, "contrast": 600, "rl": 10, "test": 10})["prefs"]
    before = [study.pair_kind(r) for r in annotators]
    assert before.count("copy") == 0 and before.count("annotators") > 200  # annotators never miscopy
    after = [study.pair_kind(r) for r in mixed]
    # two in three contrast pairs hold a copy error, one in three an omission (plus the annotators' few)
    assert 350 <= after.count("copy") <= 450 and 170 <= after.count("omission") - before.count("omission") <= 250
    assert after.count("annotators") == before.count("annotators")


def test_reward_blindspot_repeat_case_tells_what_a_word_counter_sees():
    study = _study("reward_blindspot")
    post = "alice lost the phone . bob lost the bike at the park . carol sold the lamp ."
    # the reference repeats "lost": a counter of repeated words sees nothing new in a copied object ...
    assert study.repeat_case(post, " alice lost phone . bob lost bike . carol sold lamp .",
                             " alice lost bike . bob lost bike . carol sold lamp .") == "reference_repeats_a_word"
    # ... nor in an action that no fact of the post has
    assert study.repeat_case(post, " alice lost phone . bob lost bike .",
                             " alice hid phone . bob lost bike .") == "wrong_word_not_in_post"
    assert study.repeat_case("carol sold the lamp . erin hid the car .", " carol sold lamp . erin hid car .",
                             " carol sold car . erin hid car .") == "reference_repeats_none"


def test_demo_seeds_reads_a_demo_folder_into_one_row(tmp_path, capsys, monkeypatch):
    study = _study("demo_seeds")
    for sub in ("eval", "reward", "sft"):
        (tmp_path / sub).mkdir()
    (tmp_path / "sft" / "args.json").write_text(json.dumps({"seed": 4}))
    (tmp_path / "reward" / "summary.json").write_text(json.dumps(
        {"test_accuracy": 0.8, "test_label_ceiling": 0.9, "probe_accuracy": {"omission": 1.0, "wrong_object": 0.875, "wrong_action": 0.5}}))
    pairs = [{"policy_a": m, "policy_b": "sft", "win_rate": 0.70 if m != "ppo" else 0.69, "ci_low": 0.6, "ci_high": 0.8}
             for m in study.METHODS] + [{"policy_a": "sft", "policy_b": "reference", "win_rate": 0.25, "ci_low": 0, "ci_high": 1}]
    policies = {m: {"score": 0.5} for m in ["sft", *study.METHODS]}
    (tmp_path / "eval" / "results.json").write_text(json.dumps({"pairwise": pairs, "policies": policies}))
    monkeypatch.setattr("sys.argv", ["demo_seeds.py", str(tmp_path)])
    study.main()
    header, rule, row = capsys.readouterr().out.splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(header.strip("|").split("|")) == rule.count("---")
    assert cells[:5] == ["4", "0.500", "0.800 (0.900)", "1.00 / 0.88 / 0.50", "0.75"]
    assert cells[5] == "0.690 (0.60, 0.80), 0.500" and cells[6] == "**0.700 (0.60, 0.80), 0.500**"  # bold: the target holds


def test_reward_blindspot_logprob_kinds_score_each_response_by_the_policy(tmp_path, monkeypatch):
    import torch

    from worlds import scratch
    from worlds import world
    study = _study("reward_blindspot")
    small = world.build_world(3, sizes={"sft": 10, "prefs": 40, "contrast": 120, "rl": 2, "test": 2})
    monkeypatch.setattr(world, "build_world", lambda seed: small)
    tok = world.build_tokenizer()
    model = scratch.build_model(tok, 32, 1, 0).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rows = small["prefs"].select(range(3))
    got = study.logprob_scores(model, tok, rows["prompt"], rows["rejected"], batch_size=2)
    for row, lp in zip(rows, got.tolist()):  # the same sum as one sequence through the model, EOS included
        p = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(row["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0].float().log_softmax(-1)
        want = sum(float(logits[len(p) - 1 + t, c[t]]) for t in range(len(c)))
        assert abs(lp - want) < 1e-4, (lp, want)
    out = study.kinds(str(tmp_path), 3, logprob=True)
    assert sum(k["pairs"] for k in out.values()) == 16 and set(out) <= {"copy", "omission", "annotators"}
    assert out["copy"]["label_ceiling"] > 0.9
    by_case = out["copy"]["by_case"]  # the copy errors again, by what a counter of repeated words sees
    assert sum(v["pairs"] for v in by_case.values()) == out["copy"]["pairs"]
    assert set(by_case) <= {"reference_repeats_none", "reference_repeats_a_word", "wrong_word_not_in_post"}
