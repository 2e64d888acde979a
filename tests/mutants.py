"""The suite proves itself: one-line mistakes a developer might make in an equation, a mask, a
reference, a stop rule, the bootstrap, a guard or a checkpoint, each with the tests that must
fail when it is made. Every entry changes one line of a temporary copy of the repository (its
git-tracked files); a mutant whose tests still pass is a *survivor*: a hole in the warranty.

    python tests/mutants.py                 # every mutant (make mutants); docs/tests.md gives its time
    python tests/mutants.py --list          # names, files and tests, without running anything
    python tests/mutants.py --only ppo_missing_eos_sign,eval_elo_unpaired

An entry is stale when its `original` text is no longer found exactly once in its file (the line
was edited): the runner refuses to run and names it, so refresh it (or drop it) with the change
that made it stale. Tests run one pytest process per mutant, -x, OMP_NUM_THREADS=1; first the
unmutated copy must pass every listed test (`--no_baseline` skips that check).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str  # text found exactly once in the file (a whole line or a unique part of it)
    replacement: str
    tests: list  # pytest node ids (tests/test_x.py::test_y[param]) that must fail
    note: str = field(default="")  # e.g. "reward contract: refresh after the call_reward_fn rewrite"


T = "tests/"
MUTANTS = [
    # ---------------------------------------------------------------- ppo.py
    Mutant("ppo_missing_eos_sign", "ppo.py",
           "scores = torch.where(rollout.truncated, -args.missing_eos_penalty, scores)",
           "scores = torch.where(rollout.truncated, args.missing_eos_penalty, scores)",
           [T + "test_ppo.py::test_a_completion_without_eos_scores_minus_the_penalty"]),
    Mutant("ppo_clip_min_to_max", "ppo.py",
           "surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - cliprange, 1 + cliprange) * advantages)",
           "surrogate = torch.max(ratio * advantages, torch.clamp(ratio, 1 - cliprange, 1 + cliprange) * advantages)",
           [T + "test_ppo.py::test_dual_clip_loss_matches_the_formula[3.0]"]),
    Mutant("ppo_clip_range_one_sided", "ppo.py",
           "torch.clamp(ratio, 1 - cliprange, 1 + cliprange) * advantages)",
           "torch.clamp(ratio, 1 - cliprange, 1 + 2 * cliprange) * advantages)",
           [T + "test_ppo.py::test_dual_clip_loss_matches_the_formula[3.0]"]),
    Mutant("ppo_dual_clip_max_to_min", "ppo.py",
           "torch.max(surrogate, dual_clip_c * advantages), surrogate)",
           "torch.min(surrogate, dual_clip_c * advantages), surrogate)",
           [T + "test_ppo.py::test_dual_clip_loss_matches_the_formula[3.0]"]),
    Mutant("ppo_dual_clip_on_positive_advantages", "ppo.py",
           "objective = torch.where(advantages < 0, torch.max(",
           "objective = torch.where(advantages > 0, torch.max(",
           [T + "test_ppo.py::test_dual_clip_loss_matches_the_formula[3.0]"]),
    Mutant("ppo_value_clip_max_to_min", "ppo.py",
           "losses = torch.max((values - returns) ** 2, (clipped - returns) ** 2)",
           "losses = torch.min((values - returns) ** 2, (clipped - returns) ** 2)",
           [T + "test_ppo.py::test_value_loss_matches_the_formula"]),
    Mutant("ppo_value_clip_around_returns", "ppo.py",
           "clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)",
           "clipped = returns + torch.clamp(values - returns, -cliprange_value, cliprange_value)",
           [T + "test_ppo.py::test_value_loss_matches_the_formula"]),
    Mutant("ppo_gae_delta_sign", "ppo.py",
           "deltas = (rewards + gamma * next_values - values) * mask",
           "deltas = (rewards + gamma * next_values + values) * mask",
           [T + "test_ppo.py::test_vectorised_gae_matches_a_python_loop[1.0-0.95]"]),
    Mutant("ppo_gae_no_lambda", "ppo.py",
           "(gamma * lam) ** lag.clamp(min=0)",
           "gamma ** lag.clamp(min=0)",
           [T + "test_ppo.py::test_vectorised_gae_matches_a_python_loop[1.0-0.95]"]),
    Mutant("ppo_gae_returns_without_values", "ppo.py",
           "return advantages, advantages + values",
           "return advantages, advantages",
           [T + "test_ppo.py::test_vectorised_gae_matches_a_python_loop[1.0-0.95]"]),
    Mutant("ppo_whiten_unmasked_mean", "ppo.py",
           "mean = parallel.all_reduce((x * mask).sum(), \"sum\") / count",
           "mean = parallel.all_reduce(x.sum(), \"sum\") / count",
           [T + "test_ppo.py::test_masked_whiten_over_real_tokens"]),
    Mutant("ppo_whiten_keeps_mean", "ppo.py",
           "return whitened if shift_mean else whitened + mean",
           "return whitened + mean if shift_mean else whitened",
           [T + "test_ppo.py::test_masked_whiten_over_real_tokens"]),
    Mutant("ppo_k1_kl_sign", "ppo.py",
           "kl = (logprobs - ref_logprobs) * completion_mask",
           "kl = (ref_logprobs - logprobs) * completion_mask",
           [T + "test_ppo.py::test_kl_penalty_and_score_placement"]),
    Mutant("ppo_score_off_by_one", "ppo.py",
           "last = completion_mask.sum(1).long() - 1",
           "last = completion_mask.sum(1).long() - 2",
           [T + "test_ppo.py::test_kl_penalty_and_score_placement"]),
    Mutant("ppo_reference_is_the_policy", "ppo.py",
           "ref_logprobs.append(sampling.completion_logprobs(ref_policy, mb[\"prompt_ids\"]",
           "ref_logprobs.append(sampling.completion_logprobs(policy, mb[\"prompt_ids\"]",
           [T + "test_ppo.py::test_a_completion_without_eos_scores_minus_the_penalty"]),
    Mutant("ppo_logprobs_without_temperature", "ppo.py",
           "lp, _, v = policy_and_values(policy, critic, mb, args.temperature)",
           "lp, _, v = policy_and_values(policy, critic, mb, 1.0)",
           [T + "test_ppo.py::test_a_completion_without_eos_scores_minus_the_penalty"]),
    Mutant("ppo_eval_reward_fn_is_the_training_reward", "ppo.py",
           "list(eval_fns.values()), raw, sampling.reward_completions(raw, texts)",
           "reward_fns[0], raw, sampling.reward_completions(raw, texts)",
           [T + "test_ppo.py::test_eval_reward_fn_scores_the_eval_completions_apart"]),
    # ---------------------------------------------------------------- grpo.py
    Mutant("grpo_group_mean_over_batch", "grpo.py",
           "advantages = grouped - grouped.nanmean(1, keepdim=True)",
           "advantages = grouped - grouped.nanmean()",
           [T + "test_grpo.py::test_group_advantages_on_hand_built_rewards"]),
    Mutant("grpo_group_std_over_batch", "grpo.py",
           "advantages = advantages / (nanstd(grouped, 1, keepdim=True) + ADV_EPS)",
           "advantages = advantages / (nanstd(grouped) + ADV_EPS)",
           [T + "test_grpo.py::test_group_advantages_on_hand_built_rewards"]),
    Mutant("grpo_k3_kl_wrong", "grpo.py",
           "kl = torch.exp(delta) - delta - 1  # (N, C)",
           "kl = torch.exp(delta) - 1  # (N, C)",
           [T + "test_grpo.py::test_loss_matches_the_formula[dapo]"]),
    Mutant("grpo_kl_direction", "grpo.py",
           "delta = ref_logprobs - logprobs",
           "delta = logprobs - ref_logprobs",
           [T + "test_grpo.py::test_loss_matches_the_formula[dapo]"]),
    Mutant("grpo_kl_sign_in_loss", "grpo.py",
           "per_token_loss = per_token_loss + args.beta * kl",
           "per_token_loss = per_token_loss - args.beta * kl",
           [T + "test_grpo.py::test_loss_matches_the_formula[dapo]"]),
    Mutant("grpo_clip_higher_ignored", "grpo.py",
           "torch.clamp(ratio, 1 - args.epsilon, 1 + epsilon_high) * adv)",
           "torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon) * adv)",
           [T + "test_grpo.py::test_dual_clip_bounds_negative_advantages"]),
    Mutant("grpo_dual_clip_max_to_min", "grpo.py",
           "surrogate = torch.where(adv < 0, torch.max(surrogate, args.dual_clip_c * adv), surrogate)",
           "surrogate = torch.where(adv < 0, torch.min(surrogate, args.dual_clip_c * adv), surrogate)",
           [T + "test_grpo.py::test_dual_clip_bounds_negative_advantages"]),
    Mutant("grpo_loss_grpo_token_mean_over_batch", "grpo.py",
           "per_seq = (per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)",
           "per_seq = (per_token_loss * mask).sum(1) / mask.sum().clamp(min=1)",
           [T + "test_grpo.py::test_loss_matches_the_formula[grpo]"]),
    Mutant("grpo_loss_dr_grpo_normaliser", "grpo.py",
           "loss = (per_token_loss * mask).sum() / (num_sequences * args.max_completion_length)",
           "loss = (per_token_loss * mask).sum() / (num_sequences * mask.shape[1])",
           [T + "test_grpo.py::test_loss_matches_the_formula[dr_grpo]"]),
    Mutant("grpo_loss_bnpo_unweighted", "grpo.py",
           "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1) * (mask.shape[0] / num_sequences)",
           "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1)",
           [T + "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations[bnpo-token]"]),
    Mutant("grpo_loss_dapo_per_sequence", "grpo.py",
           "loss = (per_token_loss * mask).sum() / num_tokens",
           "loss = (per_token_loss * mask).sum() / num_sequences",
           [T + "test_grpo.py::test_loss_matches_the_formula[dapo]"]),
    Mutant("grpo_gspo_sum_not_mean", "grpo.py",
           "log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))",
           "log_ratio = (log_ratio * mask).sum(1, keepdim=True)",
           [T + "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations[grpo-sequence]"]),
    Mutant("grpo_cispo_weight_not_detached", "grpo.py",
           "per_token_loss = -torch.clamp(ratio, max=1 + epsilon_high).detach() * adv * logprobs",
           "per_token_loss = -torch.clamp(ratio, max=1 + epsilon_high) * adv * logprobs",
           [T + "test_trl_knobs.py::test_cispo_keeps_the_gradient_of_clipped_tokens"]),
    Mutant("grpo_peft_reference_with_adapters_on", "grpo.py",
           "with lora.adapters_off(ref_model):",
           "with torch.no_grad():",
           [T + "test_peft.py::test_grpo_main_takes_the_reference_with_the_adapters_off"]),
    Mutant("grpo_logprobs_without_temperature", "grpo.py",
           "mb[\"attention_mask\"], args.temperature, with_entropy=True)",
           "mb[\"attention_mask\"], with_entropy=True)",
           [T + "test_peft.py::test_grpo_main_takes_the_reference_with_the_adapters_off"]),
    Mutant("grpo_eval_reward_fn_is_the_training_reward", "grpo.py",
           "held_out = common.call_reward_fns(list(eval_fns.values()), raw,",
           "held_out = common.call_reward_fns([r[\"fn\"] for r in rewards if \"fn\" in r], raw,",
           [T + "test_grpo.py::test_eval_reward_fn_scores_the_eval_completions_apart"]),
    # ---------------------------------------------------------------- the reward contract (reward_contract.py)
    Mutant("common_reward_weights_ignored", "rlhf/reward_contract.py",
           "reward = (scores * weights).nansum(1)  # (N,)",
           "reward = scores.nansum(1)  # (N,)",
           [T + "test_reward_contract.py::test_none_is_nan_and_left_out_of_the_weighted_sum"]),
    Mutant("common_reward_none_applies_not_nan", "rlhf/reward_contract.py",
           "return torch.where(scores.isnan().all(1), float(\"nan\"), reward)",
           "return reward",
           [T + "test_reward_contract.py::test_none_is_nan_and_left_out_of_the_weighted_sum"]),
    Mutant("common_reward_none_refused", "rlhf/reward_contract.py",
           "if r is None:  # TRL: not applicable to this sample, left out of the weighted sum",
           "if r is None and False:  # TRL: not applicable to this sample, left out of the weighted sum",
           [T + "test_reward_contract.py::test_none_is_nan_and_left_out_of_the_weighted_sum"]),
    Mutant("common_reward_count_unchecked", "rlhf/reward_contract.py",
           "if len(out) != len(completions):",
           "if False:",
           [T + "test_reward_contract.py::test_a_reward_function_returning_the_wrong_count_is_refused"]),
    Mutant("reward_weights_nan_accepted", "rlhf/reward_contract.py",
           "if not all(math.isfinite(w) for w in weights):",
           "if False:",
           [T + "test_never_lose_a_run.py::test_a_wrong_reward_stops_with_one_sentence[nan_weight]"]),
    Mutant("reward_dict_iterated", "rlhf/reward_contract.py",
           "if isinstance(out, (collections.abc.Mapping, collections.abc.Set, str, bytes))",
           "if isinstance(out, (str, bytes))",
           [T + "test_never_lose_a_run.py::test_a_wrong_reward_stops_with_one_sentence[dict]"]),
    Mutant("grpo_reward_std_in_float32", "grpo.py",
           "x64 = x.double()",
           "x64 = x",
           [T + "test_never_lose_a_run.py::test_rewards_of_0_and_1e20_give_full_size_advantages"]),
    Mutant("eval_dataset_columns_unchecked", "rlhf/reward_contract.py",
           "if p.default is p.empty or p.name in trained_columns:",
           "if p.default is p.empty:",
           [T + "test_never_lose_a_run.py::test_an_eval_dataset_the_rewards_cannot_score_stops_before_step_1[grpo]"]),
    Mutant("eval_dataset_verifiers_not_tried", "rlhf/reward_contract.py",
           "if ours and len(ds):",
           "if False:",
           [T + "test_never_lose_a_run.py::test_an_eval_dataset_the_rewards_cannot_score_stops_before_step_1[gold]"]),
    Mutant("resume_ignores_changed_files", "rlhf/checkpoints.py",
           "    check_input_files(args, folder)\n    if saved.get(",
           "    if saved.get(",
           [T + "test_never_lose_a_run.py::test_resume_refuses_a_reward_file_or_dataset_that_changed[r.py]"]),
    # ---------------------------------------------------------------- vLLM's correction, tools, the sandbox
    Mutant("grpo_is_weights_not_truncated", "grpo.py",
           "return torch.clamp(rho, max=cap) if mode.endswith(\"truncate\")",
           "return rho if mode.endswith(\"truncate\")",
           [T + "test_vllm.py::test_importance_sampling_weights_equal_trls"]),
    Mutant("tools_replies_trained", "rlhf/tools.py",
           "own[i] += [0] * len(glue)",
           "own[i] += [1] * len(glue)",
           [T + "test_tools.py::test_tool_tokens_receive_no_gradient"]),
    Mutant("sandbox_processes_allowed", "rlhf/sandbox.py",
           "\"RLIMIT_NPROC\": 1}",
           "\"RLIMIT_NPROC\": 4096}",
           [T + "test_sandbox.py::test_fork_bomb_cannot_fork"]),
    Mutant("sandbox_tool_reply_run_as_code", "rlhf/sandbox.py",
           "answers = [m.get(\"content\") for m in completion if m.get(\"role\") == \"assistant\"]",
           "answers = [m.get(\"content\") for m in completion]",
           [T + "test_sandbox_attacks.py::test_every_attack_scores_zero_and_correct_code_one[exec_tests]"]),
    Mutant("sandbox_assert_free_test_scored", "rlhf/sandbox.py",
           "    if not body:",
           "    if False:",
           [T + "test_sandbox_attacks.py::test_tests_not_of_the_form_are_refused_naming_the_row[a comment]"]),
    Mutant("sandbox_returned_value_not_compared", "rlhf/sandbox.py",
           "and result[1] == expected",
           "and result[1] is not None",
           [T + "test_sandbox_attacks.py::test_every_attack_scores_zero_and_correct_code_one[exec_tests_strict]"]),
    Mutant("sandbox_mounts_left_writable", "rlhf/sandbox.py",
           "attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)",
           "attr = (ctypes.c_uint64 * 4)(0, 0, 0, 0)",
           [T + "test_sandbox.py::test_writing_outside_the_working_dir_fails"]),
    Mutant("sandbox_ipc_namespace_shared", "rlhf/sandbox.py",
           "libc.unshare(0x40000000 | 0x08000000 | 0x00020000)",
           "libc.unshare(0x40000000 | 0x00020000)",
           [T + "test_sandbox_attacks.py::test_system_v_shared_memory_does_not_reach_the_next_run"]),
    Mutant("sandbox_keyrings_allowed", "rlhf/sandbox.py",
           "    if job[\"seccomp\"]:",
           "    if False:",
           [T + "test_sandbox_attacks.py::test_the_kernel_keyring_does_not_reach_the_next_run"]),
    Mutant("sandbox_private_home_left_hidden", "rlhf/sandbox.py",
           "            if top not in (None, *tops) and not any(under(top, s) for s in job[\"scratch\"]):",
           "            if False:",
           [T + "test_verifier_solutions.py::test_a_private_home_shows_the_code_its_standard_library_only"]),
    Mutant("sandbox_unshare_allowed", "rlhf/sandbox.py",
           "425, 426, 427, 272, 308, 319, 434)),",
           "425, 426, 427)),",
           [T + "test_verifier_solutions.py::test_the_filter_denies_new_namespaces_memfd_and_pidfd"]),
    Mutant("judge_verdict_from_the_first_letter", "rlhf/evaluation/judges.py",
           "if not isinstance(text, str) or text.strip() not in (\"A\", \"B\"):",
           "if not isinstance(text, str) or text.strip()[:1] not in (\"A\", \"B\"):",
           [T + "test_judge_http.py::test_an_answer_that_is_not_a_verdict_is_one_sentence_naming_it"]),
    Mutant("eval_cache_one_sample_repeated", "rlhf/evaluation/policies.py",
           "j = cached[p][taken[p]] if taken[p] < len(cached[p]) else None",
           "j = cached[p][0] if taken[p] < len(cached[p]) else None",
           [T + "test_eval.py::test_fewer_samples_per_prompt_from_the_cache_are_distinct_samples"]),
    Mutant("gguf_fixed_temporary_folder", "rlhf/real_model.py",
           "tmp = tempfile.mkdtemp(prefix=f\".{os.path.basename(folder)}.\", suffix=\".partial\", dir=parent)",
           "tmp = folder + \".tmp\"; os.makedirs(tmp, exist_ok=True)",
           [T + "test_gguf.py::test_a_symlinked_tmp_is_not_written_through"]),
    Mutant("resume_folders_not_hashed", "rlhf/checkpoints.py",
           "if not path or not (os.path.isfile(path) or os.path.isdir(path)):",
           "if not path or not os.path.isfile(path):",
           [T + "test_never_lose_a_run.py::test_resume_refuses_a_folder_or_imported_module_that_changed"]),
    # ---------------------------------------------------------------- dpo.py
    Mutant("dpo_sigmoid_sign", "dpo.py",
           "losses = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)",
           "losses = -(1 - eps) * F.logsigmoid(-beta * logits) - eps * F.logsigmoid(beta * logits)",
           [T + "test_dpo.py::test_dpo_loss_on_a_hand_computed_pair"]),
    Mutant("dpo_margin_reference_swapped", "dpo.py",
           "logits = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)",
           "logits = (chosen_logps - ref_rejected_logps) - (rejected_logps - ref_chosen_logps)",
           [T + "test_dpo.py::test_dpo_loss_and_gradient_match_the_equations[sigmoid-0.0]"]),
    Mutant("dpo_cdpo_smoothing_sign", "dpo.py",
           "losses = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)",
           "losses = -(1 - eps) * F.logsigmoid(beta * logits) + eps * F.logsigmoid(-beta * logits)",
           [T + "test_dpo.py::test_dpo_loss_and_gradient_match_the_equations[sigmoid-0.2]"]),
    Mutant("dpo_robust_no_denominator", "dpo.py",
           "eps * F.logsigmoid(-beta * logits)) / (1 - 2 * eps)",
           "eps * F.logsigmoid(-beta * logits))",
           [T + "test_dpo.py::test_dpo_loss_and_gradient_match_the_equations[robust-0.2]"]),
    Mutant("dpo_ipo_target", "dpo.py",
           "losses = (logits - 1 / (2 * beta)) ** 2",
           "losses = (logits - 1 / beta) ** 2",
           [T + "test_dpo.py::test_dpo_loss_and_gradient_match_the_equations[ipo-0.0]"]),
    Mutant("dpo_ipo_sums_not_means", "dpo.py",
           "logps = logps / completion_mask.sum(1).clamp(min=1)",
           "logps = logps",
           [T + "test_dpo.py::test_precomputed_and_live_reference_give_the_same_loss[ipo]"]),
    Mutant("dpo_rpo_nll_per_sequence", "dpo.py",
           "per_token = chosen_logps if loss_type == \"ipo\" else chosen_logps / chosen_mask.sum(1).clamp(min=1)",
           "per_token = chosen_logps",
           [T + "test_dpo.py::test_rpo_nll_is_the_per_token_nll_of_the_chosen_responses"]),
    Mutant("dpo_peft_reference_with_adapters_on", "dpo.py",
           "with lora.adapters_off(ref_model):",
           "with torch.no_grad():",
           [T + "test_peft.py::test_4bit_trains_on_the_cpu_through_sft_dpo_and_grpo"]),
    # ---------------------------------------------------------------- reward.py, sft.py
    Mutant("reward_saved_pad_token_is_eos", "reward.py",
           "        tokenizer.pad_token = pad",
           "        tokenizer.pad_token = tokenizer.pad_token",
           [T + "test_real_model.py::test_a_saved_reward_model_scores_in_transformers_as_in_the_project"],
           note="needs models/ (make real-model): linked into the copy"),
    Mutant("reward_bradley_terry_sign", "reward.py",
           "margin = chosen_rewards - rejected_rewards  # (B,)",
           "margin = rejected_rewards - chosen_rewards  # (B,)",
           [T + "test_reward.py::test_bradley_terry_loss_and_accuracy_on_hand_built_pairs"]),
    Mutant("reward_pair_rows_swapped", "reward.py",
           "return scores[0::2], scores[1::2]",
           "return scores[1::2], scores[0::2]",
           [T + "test_reward.py::test_pair_scores_match_scoring_each_sequence_alone"]),
    Mutant("reward_expanded_layer_not_zeroed", "reward.py",
           "torch.nn.init.zeros_(proj.weight)",
           "proj.weight.mul_(1.0)",
           [T + "test_reward.py::test_expanded_layers_start_as_the_trunk_train_and_load_as_saved"]),
    Mutant("reward_main_skips_expansion", "reward.py",
           "expand_layers(model, args.expand_layers)  # before distributing",
           "expand_layers(model, 0)  # before distributing",
           [T + "test_reward.py::test_reward_end_to_end_on_the_embedded_world"]),
    Mutant("sft_packing_positions_not_reset", "rlhf/data.py",
           "positions = [[p for i in row for p in range(len(ids[i]))] for row in rows]",
           "positions = [list(range(sum(len(ids[i]) for i in row))) for row in rows]",
           [T + "test_sft.py::test_sft_max_length_packing_and_epochs_through_main"]),
    Mutant("sft_completion_mask_as_loss_mask", "sft.py",
           "loss = sft_loss(logprobs, loss_mask, rank_tokens)",
           "loss = sft_loss(logprobs, completion_mask, rank_tokens)",
           [T + "test_sft.py::test_multi_turn_sft_trains_only_the_assistant_turns"]),
    Mutant("scratch_unused_rows_left_random", "worlds/scratch.py",
           "model.get_input_embeddings().weight[unused] = 0.0",
           "model.get_input_embeddings().weight[unused] *= 1.0",
           [T + "test_scratch.py::test_tokens_the_training_text_never_contains_start_at_zero_and_move_as_one"]),
    # ---------------------------------------------------------------- sampling.py, data.py
    Mutant("sampling_top_p_summed_from_the_top", "rlhf/sampling.py",
           "drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p",
           "drop = (lambda p: p.cumsum(-1) - p > top_p)(logits.sort(-1, descending=True)[0].softmax(-1)).flip(-1)",
           [T + "test_real_model.py::test_top_p_keeps_the_tokens_transformers_keeps"],
           note="the rule before 2026-12-06 (float32 sum from the top); needs models/ (make real-model)"),
    Mutant("sampling_score_before_the_last_token", "rlhf/sampling.py",
           "last = completion_mask.sum(1)  # (B*k,)",
           "last = completion_mask.sum(1) - 1  # (B*k,)",
           [T + "test_reward.py::test_pair_scores_match_scoring_each_sequence_alone"]),
    Mutant("sampling_generation_config_stops_ignored", "rlhf/sampling.py",
           "stops = torch.tensor(stop_token_ids(model, tokenizer), device=prompt_ids.device)",
           "stops = torch.tensor([tokenizer.eos_token_id], device=prompt_ids.device)",
           [T + "test_sampling.py::test_a_generation_config_stop_token_ends_the_completion"]),
    Mutant("sampling_stop_token_dropped_from_mask", "rlhf/sampling.py",
           "completion_mask = (arange[None] <= first_stop[:, None]).long()",
           "completion_mask = (arange[None] < first_stop[:, None]).long()",
           [T + "test_sampling.py::test_generate_masks_after_eos_and_flags_truncation"]),
    Mutant("sampling_logprobs_without_temperature", "rlhf/sampling.py",
           "    logits = transform(logits) if transform is not None else logits\n    logits = logits / temperature if",
           "    logits = transform(logits) if transform is not None else logits\n    logits = logits if",
           [T + "test_sampling.py::test_completion_logprobs_match_full_softmax[None]"]),
    Mutant("sampling_logprobs_off_by_one", "rlhf/sampling.py",
           "hidden = states[:, :-1]  # (B, C, H): the state before each completion token",
           "hidden = states[:, 1:]  # (B, C, H): the state before each completion token",
           [T + "test_sampling.py::test_completion_logprobs_match_full_softmax[None]"]),
    Mutant("sampling_stop_tokens_not_the_union", "rlhf/sampling.py",
           "return sorted({tokenizer.eos_token_id, *listed})",
           "return sorted(set(listed) or {tokenizer.eos_token_id})",
           [T + "test_sampling.py::test_stop_token_ids_are_the_union_of_eos_and_the_generation_config"]),
    Mutant("data_completion_without_eos", "rlhf/data.py",
           "            ids = ids + [eos]\n",
           "            ids = ids\n",
           [T + "test_common.py::test_encode_pads_and_eos"]),
    Mutant("data_prompts_right_padded", "rlhf/data.py",
           "ids, mask = _pad(seqs, tokenizer.pad_token_id, left=True)",
           "ids, mask = _pad(seqs, tokenizer.pad_token_id, left=False)",
           [T + "test_common.py::test_encode_pads_and_eos"]),
    Mutant("data_loss_mask_trains_every_turn", "rlhf/data.py",
           "ids, train = ids + t, train + [int(is_trained)] * len(t)",
           "ids, train = ids + t, train + [1] * len(t)",
           [T + "test_trl_knobs.py::test_every_assistant_turn_is_trained_and_nothing_else"]),
    # ---------------------------------------------------------------- memory.py: the plan on the real model
    Mutant("memory_plan_prompt_copied_per_completion", "rlhf/memory.py",
           "prompts = train_sequences if ckpt or not train_prompts else train_prompts  # each prompt's forward",
           "prompts = train_sequences  # each prompt's forward",
           [T + "test_real_model.py::test_the_grpo_memory_plan_is_within_20_percent_of_the_peak[long]"],
           note="needs models/ (make real-model)"),
    # ---------------------------------------------------------------- common.py, checkpoints.py: optimizer, guards
    Mutant("common_stochastic_rounding_truncates", "common.py",
           "target.copy_(((bits + noise) & -65536).view(torch.float32))",
           "target.copy_((bits & -65536).view(torch.float32))",
           [T + "test_common.py::test_stochastic_rounding_is_unbiased"]),
    Mutant("common_nan_guard_off", "common.py",
           "    if not torch.isfinite(t).all():\n        what =",
           "    if False:\n        what =",
           [T + "test_guards.py::test_check_finite_names_what_and_when"]),
    Mutant("common_gradient_norm_guard_skipped", "common.py",
           "check_finite(\"the gradient norm\", grad_norm, step)",
           "grad_norm",
           [T + "test_guards.py::test_nan_gradient_stops_before_the_optimizer_touches_the_weights"]),
    Mutant("common_fused_clip_not_applied", "common.py",
           "optimizer.grad_scale = scale if scale > 1 else None",
           "optimizer.grad_scale = None",
           [T + "test_flag_effects.py::test_fused_adamw_clips_inside_its_kernel_as_clip_grad_norm_then_step[0.5]"]),
    Mutant("common_sparse_gradient_left_sparse", "common.py",
           "            p.grad = p.grad.to_dense()",
           "            pass",
           [T + "test_common.py::test_a_tied_embedding_trains_with_a_sparse_gradient_that_lands_dense"]),
    Mutant("models_sparse_embedding_untied", "rlhf/models.py",
           "            and head.weight is embedding.weight):",
           "            ):",
           [T + "test_common.py::test_a_tied_embedding_trains_with_a_sparse_gradient_that_lands_dense"]),
    Mutant("sampling_inference_mode_on_sharded_weights", "rlhf/sampling.py",
           "with torch.inference_mode(not sharded):",
           "with torch.inference_mode(True):",
           [T + "test_sampling.py::test_decoding_runs_in_inference_mode_and_returns_tensors_autograd_can_save"]),
    Mutant("checkpoints_nan_weight_saved", "rlhf/checkpoints.py",
           "if (bad := basics.nonfinite_tensor(tensors)) is not None:",
           "if False:",
           [T + "test_guards.py::test_no_checkpoint_holds_a_nan_weight_and_none_is_resumed"]),
    Mutant("checkpoints_written_in_place", "rlhf/checkpoints.py",
           "tmp = folder.rstrip(\"/\") + \".tmp\"",
           "tmp = folder.rstrip(\"/\")",
           [T + "test_guards.py::test_a_crash_while_saving_leaves_no_half_checkpoint"]),
    Mutant("checkpoints_config_moved_first", "rlhf/checkpoints.py",
           "names = sorted(os.listdir(tmp), key=lambda n: n == \"config.json\")",
           "names = sorted(os.listdir(tmp), key=lambda n: n != \"config.json\")",
           [T + "test_guards.py::test_a_crash_while_saving_leaves_no_half_checkpoint"]),
    # ---------------------------------------------------------------- eval.py: bootstrap and Elo
    Mutant("eval_ci_level_90", "eval.py",
           "CI_LEVEL = 0.95",
           "CI_LEVEL = 0.90",
           [T + "test_eval.py::test_paired_bootstrap_ci_covers_true_win_rate"]),
    Mutant("eval_elo_unpaired", "eval.py",
           "totals = {(names.index(a), names.index(b)): resampled_totals(method_outcomes[a, b], prompt_counts,",
           "totals = {(names.index(a), names.index(b)): resampled_totals(method_outcomes[a, b], "
           "bootstrap_plan(n, [1], args.num_bootstrap, args.seed + 7 * names.index(a) + names.index(b))[0],",
           [T + "test_eval.py::test_elo_bootstrap_resamples_the_prompts_once_for_every_pair"]),
    Mutant("eval_ties_count_as_losses", "eval.py",
           "return (np.sign(np.asarray(score_a, float) - np.asarray(score_b, float)) + 1) / 2",
           "return (np.sign(np.asarray(score_a, float) - np.asarray(score_b, float)) > 0).astype(float)",
           [T + "test_eval.py::test_outcomes_ties_count_half"]),
    Mutant("eval_two_level_runs_not_resampled", "eval.py",
           "run_counts = [resample_counts(rng.integers(0, r, size=(num_bootstrap, r)), r) for r in num_runs]",
           "run_counts = [np.ones((num_bootstrap, r)) for r in num_runs]",
           [T + "test_eval.py::test_two_level_bootstrap_coverage"]),
    Mutant("eval_bt_mm_update", "eval.py",
           "new = total_wins / (games / (p[..., :, None] + p[..., None, :])).sum(-1)",
           "new = total_wins / (games / (p[..., :, None] * p[..., None, :])).sum(-1)",
           [T + "test_eval.py::test_bradley_terry_recovers_known_strengths"]),
    Mutant("eval_elo_scale", "eval.py",
           "return 1000 + 400 * np.log10(p / p[..., :1])",
           "return 1000 + 400 * np.log(p / p[..., :1])",
           [T + "test_eval.py::test_bradley_terry_recovers_known_strengths"]),
    Mutant("eval_judge_asked_in_one_order", "rlhf/evaluation/judges.py",
           "return (a_first + (1 - b_first)) / 2",
           "return a_first",
           [T + "test_eval.py::test_http_judge_against_a_local_server"]),
    Mutant("eval_reward_fn_score_counts_none_as_zero", "eval.py",
           "return float(v.sum() / has.sum()), float(lo), float(hi), float(seed_lo), float(seed_hi)",
           "return float(v.sum() / has.size), float(lo), float(hi), float(seed_lo), float(seed_hi)",
           [T + "test_eval.py::test_each_reward_function_beside_the_weighted_sum_and_a_cached_subset"]),
    # ---------------------------------------------------------------- main() at its calls (test_main_calls.py)
    Mutant("grpo_main_old_logprobs_keep_their_gradient", "grpo.py",
           "mb[\"old_logprobs\"] = logprobs.detach()",
           "mb[\"old_logprobs\"] = logprobs",
           [T + "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference"]),
    Mutant("grpo_main_loss_logprobs_swapped", "grpo.py",
           "loss, metrics = grpo_loss(logprobs, mb[\"old_logprobs\"],",
           "loss, metrics = grpo_loss(mb[\"old_logprobs\"], logprobs,",
           [T + "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference"]),
    Mutant("grpo_main_advantages_unscaled", "grpo.py",
           "for b in batches], G, args.scale_rewards, args.advantage_estimator,",
           "for b in batches], G, \"none\", args.advantage_estimator,",
           [T + "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference"]),
    Mutant("grpo_main_advantage_estimator_dropped", "grpo.py",
           "for b in batches], G, args.scale_rewards, args.advantage_estimator,",
           "for b in batches], G, args.scale_rewards, \"grpo\",",
           [T + "test_main_calls.py::test_grpo_main_advantage_estimator_reaches_the_loss[rloo]",
            T + "test_main_calls.py::test_grpo_main_advantage_estimator_reaches_the_loss[reinforce_pp]"]),
    Mutant("grpo_rloo_baseline_includes_the_sample", "grpo.py",
           "baseline = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)",
           "baseline = grouped.nansum(1, keepdim=True) / scorable",
           [T + "test_grpo.py::test_rloo_advantages_leave_each_sample_out",
            T + "test_main_calls.py::test_grpo_main_advantage_estimator_reaches_the_loss[rloo]"]),
    Mutant("grpo_reinforce_pp_moments_per_completion", "grpo.py",
           "w = lengths.double() * (~r.isnan())",
           "w = torch.ones_like(r) * (~r.isnan())",
           [T + "test_grpo.py::test_reinforce_pp_advantages_are_openrlhfs_token_whitening",
            T + "test_main_calls.py::test_grpo_main_advantage_estimator_reaches_the_loss[reinforce_pp]"]),
    Mutant("grpo_rloo_normalise_per_micro_batch", "grpo.py",
           "everything = parallel.all_gather(torch.cat(rewards))  # (N_all,)",
           "everything = torch.cat(rewards[-1:] * len(rewards))  # (N_all,)",
           [T + "test_grpo.py::test_batch_wide_estimators_span_the_optimizer_batch[rloo-batch]"]),
    Mutant("grpo_dynamic_sampling_never_refills", "grpo.py",
           "    if not args.dynamic_sampling:\n        return scored, {}",
           "    if True:\n        return scored, {}",
           [T + "test_grpo.py::test_dynamic_sampling_refills_tied_groups_and_logs_it"]),
    Mutant("grpo_dynamic_sampling_keeps_the_tied", "grpo.py",
           "(tied if is_tied else keep).append((k, g))",
           "(keep if is_tied else tied).append((k, g))",
           [T + "test_grpo.py::test_dynamic_sampling_refills_tied_groups_and_logs_it"]),
    Mutant("grpo_dynamic_sampling_one_extra_rollout_past_the_bound", "grpo.py",
           "for k in range(args.max_resample + 1):",
           "for k in range(args.max_resample + 2):",
           [T + "test_grpo.py::test_dynamic_sampling_refills_tied_groups_and_logs_it"]),
    Mutant("grpo_sequence_sum_ratio_is_a_mean", "grpo.py",
           "log_ratio = (log_ratio * mask).sum(1, keepdim=True)  # (N, 1)",
           "log_ratio = (log_ratio * mask).mean(1, keepdim=True)  # (N, 1)",
           [T + "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations[grpo-sequence_sum]"]),
    Mutant("kto_reference_point_with_gradient", "kto.py",
           "z0 = parallel.all_reduce((kl_logps - ref_kl_logps).mean().detach()).clamp(min=0)",
           "z0 = (kl_logps - ref_kl_logps).mean().clamp(min=0)",
           [T + "test_kto.py::test_kto_gradient_flows_through_the_rows_not_the_reference_point"]),
    Mutant("kto_reference_point_not_floored", "kto.py",
           "z0 = parallel.all_reduce((kl_logps - ref_kl_logps).mean().detach()).clamp(min=0)",
           "z0 = parallel.all_reduce((kl_logps - ref_kl_logps).mean().detach())",
           [T + "test_kto.py::test_kto_loss_matches_the_equations"]),
    Mutant("kto_undesirable_sign", "kto.py",
           "undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))",
           "undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))",
           [T + "test_kto.py::test_kto_loss_matches_the_equations"]),
    Mutant("kto_weights_swapped", "kto.py",
           "losses = torch.where(labels, desirable, undesirable)  # (B,)",
           "losses = torch.where(~labels, desirable, undesirable)  # (B,)",
           [T + "test_kto.py::test_kto_loss_matches_the_equations"]),
    Mutant("kto_mismatched_pairs_are_matched", "kto.py",
           "pairs = parallel.shard([block[-1]] + block[:-1])  # TRL's rotation",
           "pairs = parallel.shard(list(block))  # TRL's rotation",
           [T + "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference"]),
    Mutant("kto_pairs_rotated_within_each_rank", "kto.py",
           "pairs = parallel.shard([block[-1]] + block[:-1])",
           "pairs = [parallel.shard(block)[-1]] + parallel.shard(block)[:-1]",
           [T + "test_distributed.py::test_kto_two_ranks_match_one_rank_with_twice_the_batch"]),
    # ---------------------------------------------------------------- distill.py
    Mutant("distill_jsd_mixture_weights_swapped", "distill.py",
           "log_m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))",
           "log_m = torch.logaddexp(t + math.log1p(-beta), s + math.log(beta))",
           [T + "test_distill.py::test_generalized_jsd_matches_the_equation[0.7-0.3]",
            T + "test_distill.py::test_distill_main_on_the_embedded_world[mixed_jsd_tempered]"]),
    Mutant("distill_jsd_terms_swapped", "distill.py",
           "return beta * (t.exp() * (t - log_m)).sum(-1) + (1 - beta) * (s.exp() * (s - log_m)).sum(-1)",
           "return (1 - beta) * (t.exp() * (t - log_m)).sum(-1) + beta * (s.exp() * (s - log_m)).sum(-1)",
           [T + "test_distill.py::test_generalized_jsd_matches_the_equation[0.7-0.3]",
            T + "test_distill.py::test_distill_main_on_the_embedded_world[mixed_jsd_tempered]"]),
    Mutant("distill_forward_kl_is_reverse", "distill.py",
           "return (t.exp() * (t - s)).sum(-1)",
           "return (s.exp() * (s - t)).sum(-1)",
           [T + "test_distill.py::test_generalized_jsd_matches_the_equation[1.0-0.0]"]),
    Mutant("distill_teacher_untempered", "distill.py",
           "t = F.log_softmax(teacher_logits / temperature, -1)",
           "t = F.log_softmax(teacher_logits, -1)",
           [T + "test_distill.py::test_generalized_jsd_matches_the_equation[0.7-1.0]",
            T + "test_distill.py::test_distill_main_on_the_embedded_world[mixed_jsd_tempered]"]),
    Mutant("distill_state_after_the_token", "distill.py",
           "hidden = sampling.completion_states(model, *args)[:, :-1]",
           "hidden = sampling.completion_states(model, *args)[:, 1:]",
           [T + "test_distill.py::test_distill_main_on_the_embedded_world[mixed_jsd_tempered]"]),
    Mutant("distill_loss_over_padding", "distill.py",
           "keep = batch[\"completion_mask\"].bool()  # (B, C)",
           "keep = torch.ones_like(batch[\"completion_mask\"]).bool()  # (B, C)",
           [T + "test_distill.py::test_distill_main_on_the_embedded_world[mixed_jsd_tempered]"]),
    Mutant("distill_loss_over_what_the_model_reads", "distill.py",
           "keep = batch[\"completion_mask\"].bool()  # (B, C)",
           "keep = batch[\"attention_mask\"].bool()  # (B, C)",
           [T + "test_distill.py::test_chunked_heads_equal_full_logits_and_their_gradient"]),
    Mutant("distill_token_mean_per_micro_batch", "distill.py",
           "loss = divergence.sum() / normaliser  # this micro-batch's part of L",
           "loss = divergence.sum() / mb[\"completion_mask\"].sum() / len(batches)  # this micro-batch's part of L",
           [T + "test_distill.py::test_distill_main_on_the_embedded_world[mixed_jsd_tempered]"]),
    Mutant("distill_lmbda_is_the_off_policy_fraction", "distill.py",
           "return bool(torch.rand((), generator=torch.Generator().manual_seed(key)) < args.lmbda)",
           "return bool(torch.rand((), generator=torch.Generator().manual_seed(key)) >= args.lmbda)",
           [T + "test_distill.py::test_distill_main_on_the_embedded_world[off_policy_reverse_kl_lora]"]),
    Mutant("dpo_eval_live_reference_with_adapters_on", "dpo.py",
           "ref_chosen_logps, ref_rejected_logps = reference_logps(eval_ref, ref_model, s, batch, args)",
           "ref_chosen_logps, ref_rejected_logps = pair_logps(ref_model, batch, args.loss_type) if eval_ref is None else reference_logps(eval_ref, ref_model, s, batch, args)",
           [T + "test_peft.py::test_dpo_held_out_metrics_read_the_reference_with_the_adapters_off"]),
    Mutant("kto_main_weights_dropped", "kto.py",
           "args.desirable_weight, args.undesirable_weight)",
           "1.0, 1.0)",
           [T + "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference"]),
    Mutant("kto_reference_cache_of_another_block", "kto.py",
           "return ref_cache[block].to(common.device()).unbind(1)",
           "return ref_cache[(block + 1) % len(ref_cache)].to(common.device()).unbind(1)",
           [T + "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference",
            T + "test_kto.py::test_kto_end_to_end_precompute_on_and_off"]),
    Mutant("grpo_main_reference_at_temperature_1", "grpo.py",
           "rollout.attention_mask, temperature)",
           "rollout.attention_mask)",
           [T + "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference"]),
    Mutant("ppo_main_gae_gamma_lam_swapped", "ppo.py",
           "gae(rewards, values, mask, args.gamma, args.lam)",
           "gae(rewards, values, mask, args.lam, args.gamma)",
           [T + "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights"]),
    Mutant("ppo_main_critic_regressed_onto_advantages", "ppo.py",
           "value_loss(mb_values, mb[\"values\"], mb[\"returns\"]",
           "value_loss(mb_values, mb[\"values\"], mb[\"advantages\"]",
           [T + "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights"]),
    Mutant("ppo_main_vf_coef_dropped", "ppo.py",
           "loss = pg_loss + args.vf_coef * vf_loss",
           "loss = pg_loss + vf_loss",
           [T + "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights"]),
    Mutant("ppo_main_reference_at_temperature_1", "ppo.py",
           "mb[\"completion_ids\"], mb[\"completion_mask\"], args.temperature))",
           "mb[\"completion_ids\"], mb[\"completion_mask\"]))",
           [T + "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights"]),
    Mutant("ppo_main_policy_loss_logprobs_swapped", "ppo.py",
           "policy_loss(logprobs, mb[\"old_logprobs\"], mb[\"advantages\"], mb_mask,",
           "policy_loss(mb[\"old_logprobs\"], logprobs, mb[\"advantages\"], mb_mask,",
           [T + "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights"]),
    Mutant("dpo_main_reference_logps_swapped", "dpo.py",
           "                chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,\n",
           "                chosen_logps, rejected_logps, ref_rejected_logps, ref_chosen_logps,\n",
           [T + "test_main_calls.py::test_dpo_main_passes_policy_and_reference_log_probs_in_order"]),
    Mutant("dpo_main_nll_on_the_rejected_rows", "dpo.py",
           "batch[\"completion_mask\"][:chosen_logps.shape[0]]",
           "batch[\"completion_mask\"][chosen_logps.shape[0]:]",
           [T + "test_main_calls.py::test_dpo_main_passes_policy_and_reference_log_probs_in_order"]),
    Mutant("reward_main_pair_swapped", "reward.py",
           "loss, m = bradley_terry_loss(chosen_rewards, rejected_rewards)",
           "loss, m = bradley_terry_loss(rejected_rewards, chosen_rewards)",
           [T + "test_main_calls.py::test_reward_main_passes_chosen_then_rejected_scores"]),
    Mutant("sft_main_micro_batch_token_mean", "sft.py",
           "loss = sft_loss(logprobs, loss_mask, rank_tokens)",
           "loss = sft_loss(logprobs, loss_mask, loss_mask.sum())",
           [T + "test_main_calls.py::test_sft_main_passes_the_loss_mask_and_the_step_token_count"]),
    # ---------------------------------------------------------------- where two conditions meet (issue 65)
    # after the first update (test_after_update.py): at step 1 these tensors are equal, from step 2 on they differ
    Mutant("ppo_main_kl_penalty_reads_the_reference_as_the_policy", "ppo.py",
           "rewards, kl, non_score_reward = per_token_rewards(scores, old_logprobs, ref_logprobs, mask, args.kl_coef)",
           "rewards, kl, non_score_reward = per_token_rewards(scores, ref_logprobs, old_logprobs, mask, args.kl_coef)",
           [T + "test_after_update.py::test_ppo_second_rollout_and_second_minibatch"]),
    Mutant("grpo_main_old_and_reference_swapped", "grpo.py",
           "loss, metrics = grpo_loss(logprobs, mb[\"old_logprobs\"], mb[\"ref_logprobs\"],",
           "loss, metrics = grpo_loss(logprobs, mb[\"ref_logprobs\"], mb[\"old_logprobs\"],",
           [T + "test_after_update.py::test_grpo_second_update_of_a_reused_rollout"]),
    Mutant("dpo_main_live_reference_is_the_policy", "dpo.py",
           "= reference_logps(ref_cache, ref_model, idx, batch, args)",
           "= reference_logps(ref_cache, model, idx, batch, args)",
           [T + "test_after_update.py::test_dpo_policy_and_reference_at_step_two[live-sigmoid]"]),
    Mutant("common_reference_is_the_policy", "rlhf/models.py",
           "    return freeze(load_model(args.model, args))",
           "    return model",
           [T + "test_after_update.py::test_grpo_second_update_of_a_reused_rollout"]),
    # several prompts per micro-batch, row by row (test_rows.py)
    Mutant("grpo_main_prompts_interleaved", "grpo.py",
           "group = [i for i in idx for _ in range(G)]",
           "group = [i for _ in range(G) for i in idx]",
           [T + "test_rows.py::test_grpo_scores_each_completion_with_its_own_prompt_and_columns"]),
    Mutant("dpo_online_prompts_interleaved", "dpo.py",
           "prompts2 = [p for p in prompts for _ in (0, 1)]",
           "prompts2 = [p for _ in (0, 1) for p in prompts]",
           [T + "test_rows.py::test_online_dpo_judges_each_sample_with_its_own_prompt_and_columns"]),
    # a flag crossed with another path (test_crossings.py, test_after_update.py, test_rows.py)
    Mutant("grpo_epsilon_high_falls_back_to_the_default", "grpo.py",
           "epsilon_high = args.epsilon_high or args.epsilon",
           "epsilon_high = args.epsilon_high or 0.2",
           [T + "test_crossings.py::test_every_option_of_the_matrix_binds_on_its_batch", T + "test_crossings.py::test_grpo_loss_matrix"]),
    Mutant("dpo_precomputed_reference_ignores_the_loss_type", "dpo.py",
           "out.append(torch.stack(pair_logps(model, batch, args.loss_type), 1).cpu())",
           "out.append(torch.stack(pair_logps(model, batch, \"sigmoid\"), 1).cpu())",
           [T + "test_after_update.py::test_dpo_policy_and_reference_at_step_two[precomputed-ipo]"]),
    Mutant("eval_a_none_reward_loses", "eval.py",
           "fn_scores[rb][:, j]), nan=0.5)",
           "fn_scores[rb][:, j]), nan=0.0)",
           [T + "test_rows.py::test_eval_judges_each_response_under_its_own_row"]),
    # boundaries (test_boundaries.py)
    Mutant("checkpoints_ordered_as_text", "rlhf/checkpoints.py",
           "for s in sorted(steps)]",
           "for s in sorted(steps, key=str)]",
           [T + "test_boundaries.py::test_checkpoints_are_ordered_by_step_not_by_name",
            T + "test_boundaries.py::test_resume_after_pruning_across_a_digit_boundary"]),
    Mutant("tools_one_reply_per_row", "rlhf/tools.py",
           "mine, replies = replies[:len(cs)], replies[len(cs):]",
           "mine, replies = replies[:1], replies[1:]",
           [T + "test_boundaries.py::test_several_calls_in_one_turn_each_reach_their_own_row"]),
    Mutant("tools_a_call_without_arguments_is_malformed", "rlhf/tools.py",
           "    args = {} if args is None else args",
           "    args = args",
           [T + "test_boundaries.py::test_the_forms_of_a_tool_call_models_write"]),
    # ---------------------------------------------------------------- eval.py's statistics (test_eval_stats.py)
    Mutant("eval_tie_excludes_the_margin", "eval.py",
           "np.abs(prob_a - 0.5) <= tie_margin",
           "np.abs(prob_a - 0.5) < tie_margin",
           [T + "test_eval_stats.py::test_a_judge_with_no_preference_is_a_tie_at_exactly_the_margin"]),
    Mutant("eval_bt_prior_doubled", "eval.py",
           "BT_PRIOR_GAMES = 1.0",
           "BT_PRIOR_GAMES = 2.0",
           [T + "test_eval_stats.py::test_two_player_elo_is_the_closed_form[7-3]"]),
    Mutant("eval_runs_reuse_the_prompt_stream", "eval.py",
           "rng = np.random.default_rng([seed, 1])",
           "rng = np.random.default_rng(seed)",
           [T + "test_eval_stats.py::test_the_two_levels_draw_from_independent_streams"]),
    Mutant("eval_main_intervals_swapped", "eval.py",
           "[level[a][0], level[b][0]], [level[a][1], level[b][1]]",
           "[level[a][1], level[b][1]], [level[a][0], level[b][0]]",
           [T + "test_eval_stats.py::test_eval_main_reports_the_statistics_of_its_own_judgments"]),
    Mutant("eval_main_elo_without_prior", "eval.py",
           "elo = bradley_terry_elo(win_matrix(point, n, k))",
           "elo = bradley_terry_elo(win_matrix(point, n, k), prior_games=0.0)",
           [T + "test_eval_stats.py::test_eval_main_reports_the_statistics_of_its_own_judgments"]),
    Mutant("eval_main_bootstrap_ignores_the_seed", "eval.py",
           "for m in order], args.num_bootstrap, args.seed)",
           "for m in order], args.num_bootstrap, 0)",
           [T + "test_eval_stats.py::test_eval_main_reports_the_statistics_of_its_own_judgments"]),
    # ---------------------------------------------------------------- world.py (the embedded world's data)
    Mutant("world_slip_invents_a_word", "worlds/world.py",
           "        field = 3 - field  # 1 <-> 2",
           "        field = field  # 1 <-> 2",
           [T + "test_world.py::test_contrast_pairs_are_a_careful_summary_against_one_copy_error_or_omission"]),
    # ---------------------------------------------------------------- world_ifeval.py (the verifiers' guards)
    Mutant("ifeval_echo_allowed", "worlds/world_ifeval.py",
           "    if not text.strip() or degenerate(text) or echoes(text, prompt) or addressed(text, system):",
           "    if not text.strip() or degenerate(text) or addressed(text, system):",
           [T + "test_world_ifeval.py::test_gaming_answers_score_zero[include_word]"]),
    Mutant("ifeval_addressed_allowed", "worlds/world_ifeval.py",
           "    if not text.strip() or degenerate(text) or echoes(text, prompt) or addressed(text, system):",
           "    if not text.strip() or degenerate(text) or echoes(text, prompt):",
           [T + "test_world_ifeval.py::test_answers_addressed_to_the_model_score_zero"]),
    Mutant("ifeval_template_system_unseen", "worlds/world_ifeval.py",
           "    return \" \".join(turns if prompt and prompt[0][\"role\"] == \"system\" else [SYSTEM] + turns)",
           "    return \" \".join(turns)",
           [T + "test_world_ifeval.py::test_answers_addressed_to_the_model_score_zero"]),
    Mutant("ifeval_degenerate_run_ignored", "worlds/world_ifeval.py",
           "    if any(len(set(ws[i:i + MAX_RUN])) == 1 for i in range(len(ws) - MAX_RUN + 1)):",
           "    if any(len(set(ws[i:i + MAX_RUN])) == 0 for i in range(len(ws) - MAX_RUN + 1)):",
           [T + "test_world_ifeval.py::test_response_checks"]),
    Mutant("ifeval_topic_not_required", "worlds/world_ifeval.py",
           "    return families.get(\"forbid_word\", \"\").lower() == keyword.lower() or mentions(text, keyword)",
           "    return True",
           [T + "test_world_ifeval.py::test_response_checks"]),
    Mutant("ifeval_forbid_word_prefix", "worlds/world_ifeval.py",
           "        return not any(w.lower() in (arg.lower(), arg.lower() + \"s\", arg.lower() + \"es\") for w in ws)",
           "        return not mentions(text, arg)",
           [T + "test_world_ifeval.py::test_forbid_word_never_forbids_the_topic"]),
    Mutant("ifeval_max_words_off_by_one", "worlds/world_ifeval.py",
           "        return len(ws) <= int(arg)",
           "        return len(ws) <= int(arg) + 1",
           [T + "test_world_ifeval.py::test_response_checks"]),
]


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]


def check_entries(mutants):
    """Every entry's original text must occur exactly once in its file: a stale entry is an error."""
    problems, names = [], set()
    for m in mutants:
        if m.name in names:
            problems.append(f"{m.name}: the name is used twice")
        names.add(m.name)
        path = os.path.join(ROOT, m.file)
        if not os.path.isfile(path):
            problems.append(f"{m.name}: {m.file} does not exist")
            continue
        count = open(path).read().count(m.original)
        if count != 1:
            problems.append(f"{m.name}: the original text occurs {count} times in {m.file} (expected exactly once): "
                            f"{m.original!r}")
        if m.original == m.replacement or not m.tests:
            problems.append(f"{m.name}: no change, or no tests that must fail")
    return problems


def run_pytest(copy, tests, timeout):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        proc = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="Comma-separated mutant names to run (default: all).")
    parser.add_argument("--list", action="store_true", help="List the mutants and their tests; run nothing.")
    parser.add_argument("--no_baseline", action="store_true", help="Skip running the tests on the unmutated copy first.")
    parser.add_argument("--timeout", type=int, default=900, help="Seconds per pytest process (a timeout counts as killed).")
    args = parser.parse_args()

    mutants = MUTANTS
    if args.only:
        wanted = [n for n in args.only.split(",") if n]
        unknown = [n for n in wanted if n not in {m.name for m in MUTANTS}]
        if unknown:
            sys.exit(f"mutants.py: no mutant named {', '.join(unknown)} (python tests/mutants.py --list)")
        mutants = [m for m in MUTANTS if m.name in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.name:45s} {m.file:15s} {' '.join(m.tests)}" + (f"   [{m.note}]" if m.note else ""))
        print(f"{len(mutants)} mutants")
        return
    problems = check_entries(mutants)
    if problems:
        print("mutants.py: STALE OR BROKEN ENTRIES -- refusing to run (edit tests/mutants.py):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        sys.exit(2)

    start = time.time()
    copy = tempfile.mkdtemp(prefix="mutants-")
    try:
        for f in tracked_files():
            os.makedirs(os.path.dirname(os.path.join(copy, f)) or copy, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(copy, f))
        if os.path.isdir(os.path.join(ROOT, "models")):  # the real model (make real-model), not tracked
            os.symlink(os.path.join(ROOT, "models"), os.path.join(copy, "models"))
        if not args.no_baseline:
            tests = sorted({t for m in mutants for t in m.tests})
            t0 = time.time()
            rc, out = run_pytest(copy, tests, args.timeout * 2)
            if rc != 0:
                print(out)
                sys.exit(f"mutants.py: the listed tests fail (rc {rc}) on the unmutated code; fix them first.")
            print(f"baseline: {len(tests)} tests pass on the unmutated copy ({time.time() - t0:.0f} s)", flush=True)
        survivors, errors = [], []
        for i, m in enumerate(mutants, 1):
            path = os.path.join(copy, m.file)
            original = open(path).read()
            with open(path, "w") as f:
                f.write(original.replace(m.original, m.replacement, 1))
            t0 = time.time()
            rc, out = run_pytest(copy, m.tests, args.timeout)
            with open(path, "w") as f:
                f.write(original)
            if rc == 0:
                verdict = "SURVIVED"
                survivors.append(m)
            elif rc in (1, "timeout"):
                verdict = "killed" if rc == 1 else "killed (timeout)"
            elif rc == 2:
                verdict = "killed (collection error)"
            else:  # 4: a test id not found, 5: nothing collected -- the entry's tests are stale
                verdict = f"ERROR (pytest rc {rc})"
                errors.append(m)
                print(out)
            print(f"[{i}/{len(mutants)}] {m.name:45s} {verdict:28s} {time.time() - t0:5.1f} s", flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    killed = len(mutants) - len(survivors) - len(errors)
    print(f"\nmutants: {killed}/{len(mutants)} killed in {time.time() - start:.0f} s")
    for m in survivors:
        print(f"  SURVIVED {m.name}: {m.file}: {m.original!r} -> {m.replacement!r} (tests: {' '.join(m.tests)})")
    for m in errors:
        print(f"  ERROR    {m.name}: its tests could not run: {' '.join(m.tests)}")
    sys.exit(1 if survivors or errors else 0)


if __name__ == "__main__":
    main()
