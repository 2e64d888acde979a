"""Every flag is alive: each field of every script's Args (sft, reward, ppo, dpo, grpo, kto, distill, eval) and
each flag sweep.py reads is named here with the test in which its value changes something that
test asserts (a metric, a saved value, a loss, a refusal), or sits in ALLOWLIST with the reason
no such test exists. The checker fails on a field in neither (a new flag: name its test), on an
entry whose field is gone, and on an entry whose test does not exist or never names the flag.

A field a script redeclares only to change its default or help (sft.py's --learning_rate) is keyed
by the shared dataclass that declares it (TrainArgs.learning_rate): its value runs through the
same code. A test "names" the flag when its source (decorators included), or that of a helper or
fixture of its file it calls or takes, holds `--flag`, `--no_flag`, `flag=` or "flag", or when the
test's own name holds the field's name. The checker cannot tell whether the named test asserts the
effect: that was read when the entry was written (tests/test_flag_effects.py holds the tests
written for flags that had none)."""

import ast
import dataclasses
import importlib
import os
import re

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["sft", "reward", "ppo", "dpo", "grpo", "kto", "distill", "eval"]
SHARED = [common.ModelArgs, common.TrainArgs, common.VllmArgs, common.SamplingArgs]

FLAG_TESTS = {
    # ---------------------------------------------------------------- common.ModelArgs (every script, eval.py too)
    "ModelArgs.attn_implementation": "test_architectures.py::test_load_model_serves_an_architecture_without_sdpa",
    "ModelArgs.chat_template_kwargs": "test_trl_knobs.py::test_small_knobs",
    "ModelArgs.dataset": "test_trl_knobs.py::test_grpo_on_a_foreign_llama_with_samples_and_eval",
    "ModelArgs.dataset_split": "test_flag_effects.py::test_dataset_split_picks_the_split_of_a_folder",
    "ModelArgs.dtype": "test_flag_effects.py::test_dtype_and_trust_remote_code_reach_from_pretrained",
    "ModelArgs.model": "test_main_calls.py::test_sft_main_passes_the_loss_mask_and_the_step_token_count",
    "ModelArgs.output_dir": "test_flag_effects.py::test_logging_steps_save_steps_and_save_total_limit_through_sft",
    "ModelArgs.seed": "test_flag_effects.py::test_seed_sets_the_data_order_and_the_samples",
    "ModelArgs.trust_remote_code": "test_flag_effects.py::test_dtype_and_trust_remote_code_reach_from_pretrained",
    # ---------------------------------------------------------------- common.TrainArgs (the training scripts)
    "TrainArgs.batch_size": "test_sft.py::test_two_micro_batches_train_like_one_of_twice_the_size",
    "TrainArgs.estimate_memory": "test_memory.py::test_estimate_memory_command_line",
    "TrainArgs.eval_dataset": "test_grpo.py::test_eval_reward_fn_scores_the_eval_completions_apart",
    "TrainArgs.eval_steps": "test_grpo.py::test_eval_reward_fn_scores_the_eval_completions_apart",
    "TrainArgs.gradient_accumulation_steps": "test_sft.py::test_two_micro_batches_train_like_one_of_twice_the_size",
    "TrainArgs.gradient_checkpointing": "test_ppo.py::test_gradient_checkpointing_shrinks_ppo_activations",
    "TrainArgs.learning_rate": "test_flag_effects.py::test_learning_rate_schedule_and_warmup",
    "TrainArgs.load_in_4bit": "test_peft.py::test_4bit_trains_on_the_cpu_through_sft_dpo_and_grpo",
    "TrainArgs.load_in_8bit": "test_peft.py::test_8bit_base_computes_the_same_function_in_train_and_eval_mode",
    "TrainArgs.logging_steps": "test_flag_effects.py::test_logging_steps_save_steps_and_save_total_limit_through_sft",
    "TrainArgs.lora_alpha": "test_flag_effects.py::test_lora_flags_shape_the_adapters",
    "TrainArgs.lora_dropout": "test_flag_effects.py::test_lora_flags_shape_the_adapters",
    "TrainArgs.lora_r": "test_flag_effects.py::test_lora_flags_shape_the_adapters",
    "TrainArgs.lora_target_modules": "test_flag_effects.py::test_lora_flags_shape_the_adapters",
    "TrainArgs.lr_scheduler_type": "test_flag_effects.py::test_learning_rate_schedule_and_warmup",
    "TrainArgs.max_grad_norm": "test_flag_effects.py::test_max_grad_norm_clips_the_gradient_before_the_step",
    "TrainArgs.max_steps": "test_trl_knobs.py::test_grpo_on_a_foreign_llama_with_samples_and_eval",
    "TrainArgs.merge_adapters": "test_peft.py::test_resume_with_adapters_ends_where_the_uninterrupted_run_ends",
    "TrainArgs.num_train_epochs": "test_trl_knobs.py::test_small_knobs",
    "TrainArgs.optim": "test_common.py::test_adamw_8bit_tracks_torch_adamw",
    "TrainArgs.overwrite_output_dir": "test_guards.py::test_output_folder_is_protected_and_locked",
    "TrainArgs.parallel": "test_distributed.py::test_sft_two_ranks_match_one_rank_with_twice_the_batch",
    "TrainArgs.report_to": "test_trl_knobs.py::test_tracker_is_checked_before_anything_loads",
    "TrainArgs.resume": "test_resume.py::test_sft_resumes_exactly_after_sigkill",
    "TrainArgs.resume_allow_changes": "test_resume.py::test_resume_checks_itself",
    "TrainArgs.resume_from_checkpoint": "test_run_folder.py::test_resuming_an_older_checkpoint_abandons_the_newer_ones",
    "TrainArgs.save_steps": "test_flag_effects.py::test_logging_steps_save_steps_and_save_total_limit_through_sft",
    "TrainArgs.save_total_limit": "test_flag_effects.py::test_logging_steps_save_steps_and_save_total_limit_through_sft",
    "TrainArgs.use_peft": "test_peft.py::test_merged_model_equals_the_adapter_model",
    "TrainArgs.warmup_steps": "test_flag_effects.py::test_learning_rate_schedule_and_warmup",
    "TrainArgs.weight_decay": "test_common.py::test_adamw_8bit_tracks_torch_adamw",
    # ---------------------------------------------------------------- common.SamplingArgs (ppo, dpo --online, grpo)
    "SamplingArgs.log_completions": "test_trl_knobs.py::test_grpo_on_a_foreign_llama_with_samples_and_eval",
    "SamplingArgs.min_p": "test_trl_knobs.py::test_knobs_reach_generate",
    "SamplingArgs.repetition_penalty": "test_flag_effects.py::test_top_p_and_repetition_penalty_reach_generate",
    "SamplingArgs.top_k": "test_trl_knobs.py::test_knobs_reach_generate",
    "SamplingArgs.top_p": "test_flag_effects.py::test_top_p_and_repetition_penalty_reach_generate",
    # ---------------------------------------------------------------- common.VllmArgs: tests that run in .venv-vllm only
    # (make test skips them; make test-vllm runs them)
    "VllmArgs.use_vllm": "test_vllm.py::test_grpo_use_vllm_end_to_end_with_a_bf16_engine",
    "VllmArgs.vllm_dtype": "test_vllm.py::test_grpo_use_vllm_end_to_end_with_a_bf16_engine",
    "VllmArgs.vllm_enable_sleep_mode": "test_vllm.py::test_sleep_mode_is_refused_where_the_platform_has_none",
    # ---------------------------------------------------------------- sft.py
    "sft.hidden_size": "test_flag_effects.py::test_scratch_tokenizer_fits_chars_or_words",
    "sft.max_completion_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "sft.max_prompt_length": "test_guards.py::test_long_prompts_are_cut_counted_and_logged",
    "sft.num_layers": "test_flag_effects.py::test_scratch_tokenizer_fits_chars_or_words",
    "sft.scratch_tokenizer": "test_flag_effects.py::test_scratch_tokenizer_fits_chars_or_words",
    # ---------------------------------------------------------------- reward.py
    "reward.expand_layers": "test_flag_effects.py::test_expand_layers_adds_decoder_layers_to_the_reward_model",
    "reward.max_completion_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "reward.max_prompt_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "reward.test_size": "test_reward.py::test_reward_end_to_end_on_the_embedded_world",
    # ---------------------------------------------------------------- ppo.py
    "ppo.cliprange": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.cliprange_value": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.dual_clip_c": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.eval_reward_fn": "test_ppo.py::test_eval_reward_fn_scores_the_eval_completions_apart",
    "ppo.gamma": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.kl_coef": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.lam": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.max_completion_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "ppo.max_prompt_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "ppo.missing_eos_penalty": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.num_mini_batches": "test_ppo.py::test_ppo_end_to_end_with_a_reward_model",  # episode counts the rollout batch
    "ppo.num_ppo_epochs": "test_distributed.py::test_ppo_two_ranks_match_one_rank_with_twice_the_batch",
    "ppo.offload_frozen": "test_ppo.py::test_ppo_end_to_end_with_a_reward_model",
    "ppo.reward_fn": "test_ppo.py::test_a_completion_without_eos_scores_minus_the_penalty",
    "ppo.reward_model": "test_ppo.py::test_ppo_end_to_end_with_a_reward_model",
    "ppo.reward_weights": "test_reward_contract.py::test_rewards_equal_trls_calculate_rewards",
    "ppo.temperature": "test_ppo.py::test_a_completion_without_eos_scores_minus_the_penalty",
    "ppo.vf_coef": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    "ppo.whiten_rewards": "test_main_calls.py::test_ppo_main_passes_rewards_gae_targets_and_loss_weights",
    # ---------------------------------------------------------------- dpo.py
    "dpo.beta": "test_main_calls.py::test_dpo_main_passes_policy_and_reference_log_probs_in_order",
    "dpo.label_smoothing": "test_main_calls.py::test_dpo_main_passes_policy_and_reference_log_probs_in_order",
    "dpo.loss_type": "test_dpo.py::test_step_zero_loss_is_ln2_and_margins_are_zero",
    "dpo.max_completion_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "dpo.max_new_tokens": "test_flag_effects.py::test_online_dpo_samples_with_max_new_tokens_and_temperature",
    "dpo.max_prompt_length": "test_flag_effects.py::test_length_flags_cut_what_each_script_encodes",
    "dpo.online": "test_dpo.py::test_online_end_to_end_with_a_reward_function",
    "dpo.precompute_ref_logps": "test_dpo.py::test_offline_precompute_on_and_off_train_identically",
    "dpo.reward_fn": "test_dpo.py::test_online_end_to_end_with_a_reward_function",
    "dpo.reward_model": "test_dpo.py::test_online_judge_from_a_reward_model",
    "dpo.reward_weights": "test_reward_contract.py::test_rewards_equal_trls_calculate_rewards",
    "dpo.rpo_alpha": "test_main_calls.py::test_dpo_main_passes_policy_and_reference_log_probs_in_order",
    "dpo.temperature": "test_flag_effects.py::test_online_dpo_samples_with_max_new_tokens_and_temperature",
    # ---------------------------------------------------------------- kto.py
    "kto.beta": "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference",
    "kto.desirable_weight": "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference",
    "kto.undesirable_weight": "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference",
    "kto.precompute_ref_logps": "test_kto.py::test_kto_end_to_end_precompute_on_and_off",
    "kto.max_completion_length": "test_kto.py::test_kto_end_to_end_precompute_on_and_off",
    "kto.max_prompt_length": "test_main_calls.py::test_kto_main_passes_its_weights_and_the_reference",
    # ---------------------------------------------------------------- distill.py
    "distill.teacher": "test_distill.py::test_bad_input_stops_with_a_clear_message",
    "distill.lmbda": "test_distill.py::test_distill_main_on_the_embedded_world",
    "distill.beta": "test_distill.py::test_distill_main_on_the_embedded_world",
    "distill.temperature": "test_distill.py::test_distill_main_on_the_embedded_world",
    "distill.max_completion_length": "test_distill.py::test_distill_main_on_the_embedded_world",
    "distill.max_prompt_length": "test_distill.py::test_distill_main_on_the_embedded_world",
    # ---------------------------------------------------------------- grpo.py
    "grpo.advantage_estimator": "test_main_calls.py::test_grpo_main_advantage_estimator_reaches_the_loss",
    "grpo.beta": "test_grpo.py::test_grpo_any_model_with_user_reward_and_reward_model",  # --beta 0: no kl metric, no reference
    "grpo.dynamic_sampling": "test_grpo.py::test_dynamic_sampling_refills_tied_groups_and_logs_it",
    "grpo.dual_clip_c": "test_grpo.py::test_dual_clip_bounds_negative_advantages",
    "grpo.epsilon": "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations",
    "grpo.epsilon_high": "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations",
    "grpo.eval_reward_fn": "test_grpo.py::test_eval_reward_fn_scores_the_eval_completions_apart",
    "grpo.importance_sampling_level": "test_trl_knobs.py::test_gspo_bnpo_cispo_match_their_equations",
    "grpo.loss_type": "test_grpo.py::test_loss_matches_the_formula",
    "grpo.mask_truncated_completions": "test_flag_effects.py::test_mask_truncated_completions_zeroes_the_loss_mask_of_cut_completions",
    "grpo.max_completion_length": "test_grpo.py::test_grpo_on_the_embedded_world",
    "grpo.max_prompt_length": "test_grpo.py::test_grpo_on_the_embedded_world",
    "grpo.max_resample": "test_grpo.py::test_dynamic_sampling_refills_tied_groups_and_logs_it",
    "grpo.max_tool_calling_iterations": "test_tools.py::test_max_tool_calling_iterations",
    "grpo.num_generations": "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference",
    "grpo.num_iterations": "test_grpo.py::test_grpo_on_the_embedded_world",
    "grpo.reward_fn": "test_grpo.py::test_grpo_any_model_with_user_reward_and_reward_model",
    "grpo.reward_model": "test_grpo.py::test_grpo_any_model_with_user_reward_and_reward_model",
    "grpo.reward_weights": "test_grpo.py::test_grpo_any_model_with_user_reward_and_reward_model",
    "grpo.scale_rewards": "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference",
    "grpo.temperature": "test_main_calls.py::test_grpo_main_passes_the_batch_its_advantages_and_its_reference",
    "grpo.tools": "test_tools.py::test_grpo_with_tools_end_to_end",
    "grpo.vllm_importance_sampling_cap": "test_vllm.py::test_grpo_use_vllm_end_to_end_with_a_bf16_engine",  # .venv-vllm only
    "grpo.vllm_importance_sampling_mode": "test_vllm.py::test_grpo_use_vllm_end_to_end_with_a_bf16_engine",  # .venv-vllm only
    # ---------------------------------------------------------------- eval.py
    "eval.cache_dir": "test_eval.py::test_end_to_end",
    "eval.do_sample": "test_flag_effects.py::test_eval_generation_flags_change_the_responses",
    "eval.group_by": "test_eval_stats.py::test_group_by_reports_each_value_of_the_column",
    "eval.judge": "test_eval.py::test_end_to_end",
    "eval.judge_template": "test_eval.py::test_judge_template_fills_once_and_is_checked",
    "eval.judge_base_url": "test_eval.py::test_http_judge_against_a_local_server",
    "eval.judge_api_key_env": "test_eval.py::test_http_judge_against_a_local_server",
    "eval.judge_timeout": "test_eval.py::test_http_judge_against_a_local_server",
    "eval.judge_max_retries": "test_eval.py::test_http_judge_against_a_local_server",
    "sft.max_length": "test_sft.py::test_sft_max_length_packing_and_epochs_through_main",
    "sft.packing": "test_sft.py::test_sft_max_length_packing_and_epochs_through_main",
    "eval.max_completion_length": "test_flag_effects.py::test_eval_generation_flags_change_the_responses",
    "eval.num_bootstrap": "test_eval_stats.py::test_num_bootstrap_sets_the_number_of_resamples",
    "eval.num_prompts": "test_eval.py::test_end_to_end",
    "eval.num_samples": "test_scratch.py::test_sft_from_scratch_on_the_arithmetic_world_then_pass_at_k",
    "eval.pass_k": "test_scratch.py::test_sft_from_scratch_on_the_arithmetic_world_then_pass_at_k",
    "eval.policies": "test_eval.py::test_end_to_end_methods_of_several_runs",
    "eval.prompt_column": "test_flag_effects.py::test_prompt_and_reference_columns_are_read_by_name",
    "eval.reference_column": "test_flag_effects.py::test_prompt_and_reference_columns_are_read_by_name",
    "eval.reward_fn": "test_eval.py::test_elo_bootstrap_resamples_the_prompts_once_for_every_pair",
    "eval.reward_weights": "test_reward_contract.py::test_rewards_equal_trls_calculate_rewards",
    "eval.temperature": "test_flag_effects.py::test_eval_generation_flags_change_the_responses",
    "eval.tie_margin": "test_eval.py::test_random_llm_judge_gives_ties_not_wins",
    "eval.top_k": "test_flag_effects.py::test_eval_generation_flags_change_the_responses",
    "eval.top_p": "test_flag_effects.py::test_eval_generation_flags_change_the_responses",
    # ---------------------------------------------------------------- sweep.py (its own parser)
    "sweep.seeds": "test_sweep.py::test_zip_runs_every_seed_of_every_setting_and_resumes",
    "sweep.zip": "test_sweep.py::test_zip_runs_every_seed_of_every_setting_and_resumes",
    "sweep.output_dir": "test_sweep.py::test_zip_runs_every_seed_of_every_setting_and_resumes",
}

# Fields with no test that asserts an effect, each with the reason. Keep this short: a flag that
# changes a number belongs in FLAG_TESTS.
ALLOWLIST = {
    # display only: how many rows of the completions table are printed (completions.jsonl gets them all)
    "SamplingArgs.num_completions_to_print": "display",
    # batching of no-grad passes (scoring, evaluation, the reference precompute): the numbers do not depend on it
    "ModelArgs.eval_batch_size": "batching only",
    # handed to vLLM's CUDA engine; vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE instead, and no test machine has CUDA
    "VllmArgs.vllm_gpu_memory_utilization": "CUDA vLLM only",
    # GAP: --use_vllm only, and no test in tests/test_vllm.py turns it off and sees the loss change; make test-vllm
    # should gain one (the weights themselves: test_vllm.py::test_importance_sampling_weights_equal_trls)
    "grpo.vllm_importance_sampling_correction": "GAP: vLLM only, untested",
}


def script_fields():
    """{key: [scripts]} for every Args field (keyed as the module docstring says) and sweep.py's flags."""
    keys = {}
    for script in SCRIPTS:
        cls = importlib.import_module(script).Args
        for f in dataclasses.fields(cls):
            shared = [c for c in reversed(cls.__mro__) if c in SHARED and f.name in c.__dict__.get("__annotations__", {})]
            keys.setdefault(f"{shared[0].__name__}.{f.name}" if shared else f"{script}.{f.name}", []).append(script)
    source = open(os.path.join(ROOT, "sweep.py")).read()
    for flag in sorted(set(re.findall(r'flag == "--(\w+)"', source))):
        if flag != "seed":  # refused: the sweep sets it (--seeds)
            keys.setdefault(f"sweep.{flag}", []).append("sweep")
    return keys


def functions_of(path):
    """{name: source} of a test file's top-level functions, decorators included; and every
    top-level function's source (helpers and fixtures), by name."""
    src = open(path).read()
    lines = src.splitlines()
    return {node.name: "\n".join(lines[min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1:node.end_lineno])
            for node in ast.parse(src).body if isinstance(node, ast.FunctionDef)}


def names_flag(test, functions, name):
    """Whether the test (or a helper or fixture of its file that it mentions) names the flag."""
    pattern = re.compile(rf'--(no_)?{name}\b|\b{name}=|["\']{name}["\']')
    source = functions[test]
    helpers = [f for f in functions if f != test and re.search(rf"\b{f}\b", source)]
    return name in test or any(pattern.search(functions[f]) for f in [test, *helpers])


def test_every_flag_has_a_test_that_sees_it_change_something():
    keys = script_fields()
    problems = []
    missing = sorted(set(keys) - set(FLAG_TESTS) - set(ALLOWLIST))
    for key in missing:
        problems.append(f"{key} ({', '.join(keys[key])}.py): no test named. Write a test whose assertions depend on the "
                        f"flag's value and add '{key}': 'test_x.py::test_name' to FLAG_TESTS (tests/test_flags_alive.py), "
                        "or, for a display-only flag, an ALLOWLIST entry with its reason.")
    for key in sorted((set(FLAG_TESTS) | set(ALLOWLIST)) - set(keys)):
        problems.append(f"{key}: no such field or flag any more; drop its entry.")
    for key in sorted(set(FLAG_TESTS) & set(ALLOWLIST)):
        problems.append(f"{key}: both in FLAG_TESTS and ALLOWLIST.")
    cache = {}
    for key, node in sorted(FLAG_TESTS.items()):
        if key not in keys:
            continue
        file, test = node.split("::")
        path = os.path.join(ROOT, "tests", file)
        if not os.path.isfile(path):
            problems.append(f"{key}: tests/{file} does not exist.")
            continue
        if path not in cache:
            cache[path] = functions_of(path)
        functions = cache[path]
        if test not in functions:
            problems.append(f"{key}: tests/{file} has no {test}.")
        elif not names_flag(test, functions, key.split(".", 1)[1]):
            problems.append(f"{key}: tests/{file}::{test} never names --{key.split('.', 1)[1]}.")
    assert not problems, f"{len(problems)} flag(s) without a test:\n" + "\n".join(problems)


def test_the_checker_finds_a_new_flag(monkeypatch):
    """The checker itself can fail: a field added to an Args is reported by name."""
    import sft

    @dataclasses.dataclass
    class Args(sft.Args):
        brand_new_knob: float = 0.5

    monkeypatch.setattr(sft, "Args", Args)
    try:
        test_every_flag_has_a_test_that_sees_it_change_something()
    except AssertionError as e:
        assert "sft.brand_new_knob (sft.py): no test named" in str(e) and str(e).startswith("1 flag(s)")
    else:
        raise AssertionError("the new field went unnoticed")
