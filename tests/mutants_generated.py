"""Generated mutants: mutmut (https://github.com/boxed/mutmut, 3.x) writes every one-line mutant
its operators know in the equation functions of the algorithm files (losses, advantages, GAE, KL,
clipping, eval's statistics) and in some plumbing (tool-call parsing, checkpoint order, the reward contract; TARGETS
below) and runs, for each, the tests that cover that file
(TESTS below; the fast ones: unit tests against the equations and the main() spies of
test_main_calls.py). Unlike tests/mutants.py, no one chose these mutants: the score measures the
suite, not a list written against it. Not part of `make test` (make mutants-generated).

    python tests/mutants_generated.py                  # every file, one after the other
    python tests/mutants_generated.py --only ppo.py    # one file

Each file runs in its own temporary copy of the repository (git-tracked files), where every other
function of that file is wrapped in mutmut's `# pragma: no mutate start/end`, so only TARGETS are
mutated. Survivors are printed with their diff (mutmut show); the docs list each with its reason.
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGETS = {
    "grpo.py": ["nanstd", "group_advantages", "batch_advantages", "batch_normalisers", "importance_sampling_weights",
                "masked_mean", "grpo_loss"],
    "ppo.py": ["masked_mean", "minibatch_tokens", "masked_whiten", "per_token_rewards", "gae", "policy_loss", "value_loss",
               "explained_variance"],
    "dpo.py": ["dpo_loss", "chosen_nll", "pair_logps"],
    "reward.py": ["bradley_terry_loss", "pair_scores"],
    "sft.py": ["sft_loss"],
    "eval.py": ["outcomes_from_scores", "outcomes_from_probs", "function_outcomes", "bootstrap_indices", "resample_counts", "bootstrap_plan",
                "resampled_totals", "percentile_ci", "mean_cis", "nan_mean_cis", "pass_at_k", "pass_at_k_stats", "group_stats",
                "win_rate_stats", "win_matrix", "bradley_terry_elo", "unbounded_elo", "expected_wins"],
    # plumbing where a slip needs two conditions at once (a boundary, several calls or rows)
    "rlhf/tools.py": ["parse_tool_calls", "read_call", "execute"],
    "rlhf/checkpoints.py": ["delete_old_checkpoints", "checkpoints", "last_checkpoint", "_earlier_checkpoints",
                            "abandon_newer_checkpoints"],
    "rlhf/reward_contract.py": ["is_module_spec", "call_reward_fns", "weighted_rewards", "load_reward_fns", "check_reward_names",
                                "check_reward_data", "load_eval_reward_fns", "parse_reward_weights"],
    "rlhf/sampling.py": ["stop_token_ids", "logit_transform", "lm_logits", "position_ids", "completion_states", "fits_one_row",
                         "prompt_rows", "block_attention", "prompt_block_attention", "completion_logprobs", "packed_logprobs",
                         "token_logprobs", "_head_logprobs", "generate", "states_before", "sampling_noise", "noise_key", "_next_token", "processed_logits",
                         "reward_completions", "completion_id_lists", "decode_completions", "sample_texts", "sequence_scores", "completion_scores",
                         "reward_model_scores", "score_texts"],
    "rlhf/decoding.py": ["can_pack", "pack", "packed_matmul", "packed_weights", "preallocate", "_write_in_place",
                         "cache_buffers", "_buffer", "llama_weights", "llama_step", "_rms_norm", "_rotary"],
    "rlhf/data.py": ["load_data", "named_data", "is_task", "set_max_steps", "check_folder", "check_jsonl", "require_columns",
                     "is_conversational", "check_messages", "check_text", "check_readable", "render_prompt",
                     "check_renders_tools", "render_completion", "render_turns", "sft_pairs", "preference_triples",
                     "batch_indices", "rank_batch", "count_truncated", "truncation_counts", "encode_prompts",
                     "encode_completions", "encode_turns", "encode_examples", "pack", "packed_batch", "_ends_with_stop",
                     "_has_bos", "_pad"],
    "rlhf/evaluation/judges.py": ["answer_token_ids", "prompt_text", "fill_template", "load_judge_template", "judge_input",
                                  "prob_first_better", "llm_judge", "position_debiased", "pairwise_first_better", "_shown",
                                  "answer_prob", "post_json", "http_first_better"],
}
T = "tests/"
TESTS = {
    "grpo.py": [T + "test_grpo.py::test_group_advantages_on_hand_built_rewards", T + "test_grpo.py::test_loss_matches_the_formula",
                T + "test_grpo.py::test_dual_clip_bounds_negative_advantages",
                T + "test_grpo.py::test_on_policy_ratio_is_one_and_kl_zero_at_the_reference",
                T + "test_grpo.py::test_two_micro_batches_train_like_one",
                T + "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations",
                T + "test_vllm.py::test_importance_sampling_weights_equal_trls",
                T + "test_vllm.py::test_is_weights_multiply_the_policy_loss_before_the_kl",
                T + "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference",
                T + "test_flag_effects.py::test_mask_truncated_completions_zeroes_the_loss_mask_of_cut_completions",
                T + "test_equation_edges.py"],
    "ppo.py": [T + "test_ppo.py::test_vectorised_gae_matches_a_python_loop", T + "test_ppo.py::test_dual_clip_loss_matches_the_formula",
               T + "test_ppo.py::test_value_loss_matches_the_formula", T + "test_ppo.py::test_kl_penalty_and_score_placement",
               T + "test_ppo.py::test_first_minibatch_has_ratio_one", T + "test_ppo.py::test_masked_whiten_over_real_tokens",
               T + "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights", T + "test_equation_edges.py"],
    "dpo.py": [T + "test_dpo.py::test_dpo_loss_on_a_hand_computed_pair", T + "test_dpo.py::test_dpo_loss_and_gradient_match_the_equations",
               T + "test_dpo.py::test_step_zero_loss_is_ln2_and_margins_are_zero",
               T + "test_dpo.py::test_precomputed_and_live_reference_give_the_same_loss",
               T + "test_dpo.py::test_rpo_nll_is_the_per_token_nll_of_the_chosen_responses",
               T + "test_main_calls.py::test_dpo_main_passes_policy_and_reference_log_probs_in_order", T + "test_equation_edges.py"],
    "reward.py": [T + "test_reward.py::test_bradley_terry_loss_and_accuracy_on_hand_built_pairs",
                  T + "test_reward.py::test_pair_scores_match_scoring_each_sequence_alone",
                  T + "test_main_calls.py::test_reward_main_passes_chosen_then_rejected_scores",
                  T + "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes[reward]"],
    "sft.py": [T + "test_main_calls.py::test_sft_main_passes_the_loss_mask_and_the_step_token_count",
               T + "test_sft.py::test_two_micro_batches_train_like_one_of_twice_the_size",
               T + "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes[sft]", T + "test_equation_edges.py"],
    "eval.py": [T + "test_eval.py", T + "test_eval_stats.py", "-k", "not end_to_end and not methods_from_the_command_line"],
    "rlhf/tools.py": [T + "test_tools.py::test_parse_tool_calls", T + "test_tools.py::test_one_call_context_and_mask",
                      T + "test_boundaries.py::test_the_forms_of_a_tool_call_models_write",
                      T + "test_boundaries.py::test_several_calls_in_one_turn_each_reach_their_own_row",
                      T + "test_boundaries.py::test_what_parsing_and_the_sandbox_answer_at_their_edges"],
    "rlhf/checkpoints.py": [T + "test_boundaries.py::test_checkpoints_are_ordered_by_step_not_by_name",
                            T + "test_boundaries.py::test_an_unreadable_checkpoint_offers_only_older_ones_in_order",
                            T + "test_boundaries.py::test_abandoning_a_checkpoint_twice_keeps_the_newest_abandoned_one",
                            T + "test_trl_knobs.py::test_small_knobs",
                            T + "test_run_folder.py::test_resuming_an_older_checkpoint_abandons_the_newer_ones",
                            T + "test_resume.py::test_training_state_round_trips_optimizer_scheduler_and_rng"],
    "rlhf/reward_contract.py": [T + "test_reward_contract.py", T + "test_rows.py",
                                T + "test_guards.py::test_nan_reward_from_a_reward_function_names_the_prompt",
                                T + "test_guards.py::test_reward_functions_return_any_real_number_and_may_not_exit",
                                T + "test_common.py::test_reward_fn_from_file_gets_extra_columns",
                                T + "test_field_tasks.py::test_a_module_function_loads_by_its_dotted_name_in_every_script",
                                T + "test_field_tasks.py::test_a_dotted_name_that_does_not_import_says_so",
                                T + "test_never_lose_a_run.py::test_a_wrong_reward_stops_with_one_sentence",
                                T + "test_never_lose_a_run.py::test_an_eval_dataset_the_rewards_cannot_score_stops_before_step_1"],
    "rlhf/sampling.py": [T + "test_sampling.py", T + "test_rows.py", T + "test_stop_rule.py", T + "test_architectures.py",
                         T + "test_reward.py", T + "test_sft.py::test_packed_rows_give_the_unpacked_loss",
                         T + "test_throughput.py::test_a_prompt_and_its_completions_in_one_row_see_the_prompt_and_themselves",
                         "-k", "not end_to_end"],
    "rlhf/decoding.py": [T + "test_decoding.py", T + "test_architectures.py::test_greedy_generate_matches_hf",
                         T + "test_sampling.py::test_generate_greedy_matches_hf_generate"],
    "rlhf/data.py": [T + "test_refusals.py", T + "test_encoding.py", T + "test_common.py", T + "test_sampling.py", T + "test_stop_rule.py",
                     T + "test_boundaries.py", T + "test_guards.py", T + "test_sft.py", T + "test_tools.py",
                     T + "test_field_tasks.py", T + "test_sft.py::test_packed_rows_give_the_unpacked_loss", "-k",
                     "not end_to_end and not from_scratch and not nan_loss and not help_imports and not adamw and not raising_reward "
                     "and not long_prompts_are_cut and not any_model_on_conversational"],
    "rlhf/evaluation/judges.py": [T + "test_refusals.py", T + "test_judge_http.py", T + "test_eval.py", T + "test_rows.py",
                                  "-k", "not end_to_end and not methods_from_the_command_line"],
}
OTHER = ["common.py", "sweep.py", "kto.py", "distill.py", "pytest.ini", "rlhf/", "worlds/", "studies/"]


def fence(path, targets):
    """Wrap the top-level functions of `path` outside `targets` in mutmut's no-mutate pragmas."""
    src = open(path).read()
    tree = ast.parse(src)
    found = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert set(targets) <= found, f"{path}: no function {sorted(set(targets) - found)} (refresh TARGETS)"
    marks, fenced = {}, False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (node.name in targets) == fenced:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            marks[first] = "# pragma: no mutate " + ("end" if fenced else "start")
            fenced = not fenced
    lines = []
    for i, line in enumerate(src.splitlines()):
        lines += [marks[i]] if i in marks else []
        lines.append(line)
    lines += ["# pragma: no mutate end"] if fenced else []
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def beside(copy, path, name):
    """What mutmut copies unmutated for `path` (a file, or a folder ending in /): the folder whole,
    or, when it holds the mutated file `name`, each of its other entries (recursively into the
    subfolder that holds `name`)."""
    if not (path.endswith("/") and name.startswith(path)):
        return [path]
    out = []
    for entry in sorted(os.listdir(os.path.join(copy, path))):
        sub = os.path.join(path, entry)
        if sub == name:
            continue
        out += beside(copy, sub + "/", name) if os.path.isdir(os.path.join(copy, sub)) else [sub]
    return out


def run_file(name, mutmut, timeout):
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="mutmut-") as copy:
        for f in filter(None, tracked.split("\0")):
            if os.path.isfile(os.path.join(ROOT, f)):
                os.makedirs(os.path.join(copy, os.path.dirname(f)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, f), os.path.join(copy, f))
        fence(os.path.join(copy, name), TARGETS[name])
        also = []
        for f in [*TARGETS, *OTHER]:
            if f != name and not any(d.endswith("/") and f.startswith(d) for d in OTHER if d != f):
                also += beside(copy, f, name)
        with open(os.path.join(copy, "setup.cfg"), "w") as f:
            f.write("[mutmut]\nsource_paths=\n    " + name + "\nalso_copy=\n" + "".join(f"    {a}\n" for a in also)
                    + "pytest_add_cli_args_test_selection=\n" + "".join(f"    {t}\n" for t in TESTS[name]))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
        start, run = time.time(), None
        try:
            run = subprocess.run([*mutmut, "run", "--max-children", "1"], cwd=copy, env=env, timeout=timeout,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if run.returncode and "__mutmut_" not in subprocess.run([*mutmut, "results", "--all", "true"], cwd=copy,
                                                                     env=env, capture_output=True, text=True).stdout:
                sys.exit(f"{name}: `{' '.join(mutmut)} run` exited {run.returncode} and wrote no mutant (is mutmut "
                         f"installed? `make mutants-generated` installs it):\n{run.stderr[-2000:]}")
        except subprocess.TimeoutExpired:
            print(f"{name}: stopped after {timeout} s (--timeout); the results so far:")
        seconds = time.time() - start
        results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=copy, env=env, capture_output=True, text=True).stdout
        status = {}
        for line in results.splitlines():
            if ":" in line and "__mutmut_" in line:
                mutant, state = (x.strip() for x in line.rsplit(":", 1))
                status[mutant] = state
        killed = sum(s in ("killed", "timeout") for s in status.values())
        survived = sorted(m for m, s in status.items() if s == "survived")
        other = sorted(f"{m} ({s})" for m, s in status.items() if s not in ("killed", "timeout", "survived"))
        print(f"{name}: {killed}/{len(status)} killed, {len(survived)} survived, {len(other)} other, {seconds:.0f} s")
        for m in survived:
            diff = subprocess.run([*mutmut, "show", m], cwd=copy, env=env, capture_output=True, text=True).stdout
            print(f"--- survived: {m}\n" + "\n".join(l for l in diff.splitlines() if l.startswith(("+", "-")) and
                                                       not l.startswith(("+++", "---"))))
        for m in other:
            print(f"--- {m}")
        if any(s == "not checked" for s in status.values()) and run is not None:
            print(f"{name}: mutants left unchecked; mutmut's last words:\n{run.stderr[-3000:]}")
        return killed, len(status)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="Comma-separated files (default: all of TARGETS).")
    parser.add_argument("--timeout", type=int, default=1800, help="Seconds per file.")
    parser.add_argument("--mutmut", default="mutmut", help="The mutmut command (default: mutmut on PATH).")
    args = parser.parse_args()
    files = args.only.split(",") if args.only else list(TARGETS)
    start, killed, total = time.time(), 0, 0
    for name in files:
        k, n = run_file(name, args.mutmut.split(), args.timeout)
        killed, total = killed + k, total + n
    print(f"generated mutants: {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
