"""What every script needs to run: arguments and their defaults, the 8-bit optimizer and its step
(clipping, the NaN guard, stochastic rounding of bf16 weights), the embedded world's gold
evaluation and the NaN guards. No algorithm lives here: losses, advantages, KL and clipping stay
in sft.py / reward.py / ppo.py / dpo.py / grpo.py.

common.py stands above the modules it composes and none of them imports it. It re-exports the
ground floor (rlhf/basics.py: errors, devices, dtypes, seeds, world names), loading
(rlhf/models.py) and TRL's reward-function contract (rlhf/reward_contract.py), so that a script
writes common.fail, common.load_model, common.call_reward_fns. The other shared modules, by reader:
- rollouts.py: the one sampling contract (plain decoding, vLLM, the tool loop), chosen before the loop;
- sampling.py: log-probs, generation, reward-model scores (read it when you fork an algorithm);
- data.py: datasets in TRL's formats, chat templates, tokenisation, the batch order;
- tracking.py: metrics.jsonl, the console, trackers, --log_completions;
- checkpoints.py: the output folder, checkpoints, the final save and resume;
- lora.py: LoRA / QLoRA adapters and the adapters-off reference;
- sandbox.py: generated code run against unit tests in a limited process (the execution verifiers);
- parallel.py (torchrun) and memory.py (the memory plan and its measurement), which nobody
  needs to read to fork a script.
"""

import argparse
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from rlhf import checkpoints
from rlhf import data
from rlhf import parallel
from rlhf import real_model
from rlhf import rollouts
from rlhf import sampling
from rlhf import tracking
from worlds import world
from rlhf.basics import (  # noqa: F401 -- the ground floor, re-exported: the scripts write common.fail, common.device, ...
    ARITH, ARITH_TOOLS, CHAT_TEMPLATE_KWARGS, CODE, EMBEDDED, IFEVAL, SR_BUCKET_NUMEL, arith_split, brief, check_hub_id,
    code_split, device, embedded_world, fail, finite_json, freeze, ifeval_split, nonfinite_tensor, passed, script_name,
    set_seed, torch_dtype)
from rlhf.models import (  # noqa: F401 -- loading, re-exported: the scripts write common.load_model
    attn_implementation, check_lm_head, check_model_source, check_score_head, default_optim, disable_dropout,
    enable_checkpointing, is_embedded_policy, load_model, load_reward_model, load_tokenizer, reference_of)
from rlhf.reward_contract import (  # noqa: F401 -- TRL's reward-function contract, re-exported: the scripts write common.call_reward_fns
    REWARD_KWARGS, call_reward_fns, check_reward_data, check_reward_datasets, check_reward_names, load_eval_reward_fns, load_reward_fn,
    load_reward_fns, parse_reward_weights, weighted_rewards)

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU-kernel import notice is noise here


def _quiet_transformers():
    """transformers' load reports and "Loading weights" bars would interleave with the scripts'
    own lines; its errors still show."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


_quiet_transformers()



# ============================================================================ arguments
@dataclass
class ModelArgs:
    """The flags of every script that loads a model (eval.py's base); TrainArgs adds training's."""

    # model and data
    model: str = field(default="runs/sft", metadata={"help": "Hub id or local folder of the model to start from."})
    dataset: str = field(default=EMBEDDED, metadata={"help": "'embedded' (the synthetic TL;DR world), 'embedded:arith' (the arithmetic world; embedded:arith:2 chains, embedded:arith:1,2 both, embedded:arith_tools with a calculator tool), 'embedded:code' (the code world), 'embedded:ifeval' (instruction following with verifiers, for a chat model), 'reasoning_gym:TASK[:key=value,...]' (a Reasoning Gym task) or 'humaneval' (HumanEval's 164 problems; both: pip install -r requirements-tasks.txt, docs/usage.md), a Hub dataset name, or a local .jsonl/.json/.parquet file or folder."})
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset to train on (Hub datasets and folders)."})
    output_dir: str = field(default="", metadata={"help": "Where metrics.jsonl, checkpoints, summary.json and the final model go (default: runs/<script>)."})
    seed: int = field(default=0, metadata={"help": "Random seed for data order, initialisation and sampling."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code from the Hub (off: only transformers' own code runs)."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float16 | float32."})
    attn_implementation: str = field(default="auto", metadata={"help": "auto (flash_attention_2 if importable on CUDA, else sdpa where the architecture supports it, else eager) | sdpa | eager | flash_attention_2."})
    chat_template_kwargs: str = field(default="", metadata={"help": "JSON object of extra arguments for the chat template wherever prompts are rendered, e.g. '{\"enable_thinking\": false}' (Qwen3)."})
    eval_batch_size: int = field(default=64, metadata={"help": "Prompts per generation batch when scoring the test split."})


@dataclass
class TrainArgs(ModelArgs):
    """The command-line contract shared by every training script (TRL's names where TRL has one)."""

    # evaluation
    eval_dataset: str = field(default="", metadata={"help": "Held-out data in --dataset's format (a file, or a Hub name: its 'test' split; or an embedded world's name, e.g. 'embedded': its test prompts), evaluated every --eval_steps and at the end (eval_* metrics)."})
    eval_steps: int = field(default=0, metadata={"help": "Evaluate on --eval_dataset every this many steps (0: at the end only)."})
    # optimisation
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps; more than one pass over the data cycles through it again."})
    num_train_epochs: float = field(default=0.0, metadata={"help": "Passes over --dataset; sets --max_steps from the dataset size (0: --max_steps decides)."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "Any transformers scheduler name: constant_with_warmup, linear, cosine, ..."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    batch_size: int = field(default=8, metadata={"help": "Examples per micro-batch (TRL: per_device_train_batch_size)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    optim: str = field(default="auto", metadata={"help": "auto: adamw_8bit on CUDA (its moments take 2 bytes a parameter, not 8) and for the embedded worlds' tiny policies, adamw for a pretrained model on a CPU (where 8-bit saves no GPU memory and doubles the step time) and under --parallel fsdp2 | adamw_8bit (bitsandbytes) | adamw (torch)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward: less memory, about a third more time."})
    # LoRA and QLoRA (peft, bitsandbytes)
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (and a score head) on a frozen base; the reference is the base with the adapters off."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale numerator: the update is (lora_alpha / lora_r) B A x."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the adapters' input."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Comma-separated module names that get adapters (e.g. q_proj,v_proj); all-linear: every linear layer of the decoder."})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: load the base's linear layers in 4-bit NF4 (bitsandbytes), computing in --dtype; needs --use_peft."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base's linear layers in 8 bits (bitsandbytes LLM.int8); needs --use_peft."})
    merge_adapters: bool = field(default=True, metadata={"help": "With --use_peft: the final save also writes the adapters merged into the base to <output_dir>/ (the adapters go to <output_dir>/adapter/)."})
    # logging and saving
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every this many steps."})
    save_steps: int = field(default=0, metadata={"help": "Save <output_dir>/checkpoint-<step>/ every this many steps (0: final save only)."})
    save_total_limit: int = field(default=0, metadata={"help": "Keep only the newest this-many checkpoints, deleting older ones after each successful save (0: keep all)."})
    report_to: str = field(default="none", metadata={"help": "none | tensorboard (pip install tensorboard) | wandb (pip install wandb); imported only when asked."})
    estimate_memory: bool = field(default=False, metadata={"help": "Print the memory plan per component for these settings (reads only the model's config.json) and exit."})
    # resume and parallelism
    resume: bool = field(default=False, metadata={"help": "Continue from the newest <output_dir>/checkpoint-<step>/ (starts fresh, saying so, if there is none)."})
    resume_from_checkpoint: str = field(default="", metadata={"help": "Continue from this checkpoint folder."})
    resume_allow_changes: bool = field(default=False, metadata={"help": "Resume even if data, batch sizes, seed, model, rewards, optimizer or algorithm flags differ from the checkpoint's args.json (the run then no longer ends where an uninterrupted one would)."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Start afresh in an --output_dir that holds another run's model or checkpoints (they are deleted); without it (or --resume) such a folder is refused."})
    parallel: str = field(default="ddp", metadata={"help": "Under torchrun: ddp (weights replicated, gradients averaged) | fsdp2 (decoder layers sharded with fully_shard)."})


@dataclass
class VllmArgs:
    """The flags of --use_vllm (vllm_rollouts.py; docs/vllm.md), TRL's names, for
    every script that samples (SamplingArgs' and eval.py's)."""

    use_vllm: bool = field(default=False, metadata={"help": "Sample with a vLLM engine inside this process (TRL's colocate mode), its weights synced before every rollout; needs .venv-vllm (make vllm-env)."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "With --use_vllm: the share of the GPU's memory the engine may take (TRL's default; vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE instead)."})
    vllm_dtype: str = field(default="", metadata={"help": "With --use_vllm: the engine's dtype (float32, bfloat16, float16); default: the policy's."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "With --use_vllm: the engine frees its weights and KV cache after every rollout and gets them back before the next (vLLM's sleep mode, level 2; CUDA GPUs only)."})


@dataclass
class SamplingArgs(VllmArgs, TrainArgs):
    """TrainArgs plus the sampling knobs and sample logging of the scripts that generate
    (grpo.py, ppo.py, dpo.py --online), with TRL's names and meanings."""

    # generation
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p (1: off). Log-probs stay those of the tempered, unfiltered policy, as in TRL."})
    top_k: int = field(default=0, metadata={"help": "Sample from the k most probable tokens only (0: off)."})
    min_p: float = field(default=0.0, metadata={"help": "Drop tokens less probable than min_p times the most probable one (Nguyen et al. 2024; 0: off)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Divide positive (multiply negative) logits of tokens already in the prompt or completion by this (HF's; 1: off)."})
    # logging
    log_completions: bool = field(default=False, metadata={"help": "Every --logging_steps, print a table of a few prompts, their sampled completions and rewards, and append them to <output_dir>/completions.jsonl."})
    num_completions_to_print: int = field(default=4, metadata={"help": "Rows of that table (all of them go to completions.jsonl)."})


# the help of a --no_X flag (a bool field that defaults to True), where "Turn --X off" says too little
NO_FLAG_HELP = {
    "merge_adapters": "With --use_peft: the final save writes only the adapters (<output_dir>/adapter/), not the "
                      "merged model, saving the time and disk of a full copy of the base.",
    "precompute_ref_logps": "Offline: keep a frozen reference model loaded and run it every step, instead of computing "
                            "the reference log-probs once before training.",
}


def parse_args(cls, default_output_dir=None):
    """Parse the command line into the script's Args dataclass; fill the output folder (runs/<script>,
    or default_output_dir(args)) and check it before anything loads."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls)
    for action in parser._actions:  # an empty default reads as nothing, not "(default: )"
        if action.default == "" and action.help and action.help != argparse.SUPPRESS:
            action.help += "%(default)s"
        if any(o == f"--no_{action.dest}" for o in action.option_strings):  # HF copies the flag's own help to --no_X
            action.help = NO_FLAG_HELP.get(action.dest, f"Turn --{action.dest} off (on by default).")
    args, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        fail(unknown_flag_message(cls, unknown))
    args.output_dir = args.output_dir or (default_output_dir and default_output_dir(args)) or os.path.join("runs", script_name())
    if getattr(args, "model", "").endswith(".gguf"):  # llama.cpp / ollama files: a plain folder from here on
        args.model = real_model.gguf_folder(args.model)
    check_ranges(args)
    check_choice("--dtype", args.dtype, ["auto", "bfloat16", "float16", "float32"])
    check_choice("--attn_implementation", args.attn_implementation, ["auto", "sdpa", "eager", "flash_attention_2"])
    try:
        kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    except json.JSONDecodeError as e:
        fail(f"--chat_template_kwargs {args.chat_template_kwargs!r} is not valid JSON ({e.msg}); e.g. '{{\"enable_thinking\": false}}'.")
    if not isinstance(kwargs, dict):
        fail(f"--chat_template_kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}', got {args.chat_template_kwargs!r}.")
    CHAT_TEMPLATE_KWARGS.clear()
    CHAT_TEMPLATE_KWARGS.update(kwargs)
    if not isinstance(args, TrainArgs):
        return args
    check_choice("--lr_scheduler_type", args.lr_scheduler_type, scheduler_types())
    check_choice("--optim", args.optim, ["auto", "adamw_8bit", "adamw"])
    if args.optim == "auto":
        args.optim = default_optim(args)
        why = ("8-bit AdamW: its states take a quarter of the GPU memory" if args.optim == "adamw_8bit" and torch.cuda.is_available()
               else "8-bit AdamW: the embedded world's results were measured with it" if args.optim == "adamw_8bit"
               else "torch AdamW: " + ("FSDP2 shards its states" if torch.cuda.is_available() else "no CUDA, where 8-bit only costs time"))
        if parallel.is_main():
            print(f"{script_name()}: --optim {args.optim} ({why}; pass --optim to choose)")
    check_choice("--report_to", args.report_to, ["none", "tensorboard", "wandb"])
    if args.report_to != "none":  # before anything loads, not after the models did
        module = "tensorboard" if args.report_to == "tensorboard" else "wandb"
        if importlib.util.find_spec(module) is None:
            fail(f"--report_to {args.report_to} needs the {module} package: pip install {module} (or drop --report_to).")
    if args.num_train_epochs < 0 or args.save_total_limit < 0 or args.eval_steps < 0:
        fail("--num_train_epochs, --save_total_limit and --eval_steps must be >= 0.")
    if passed("num_train_epochs") and passed("max_steps"):
        fail("pass --num_train_epochs or --max_steps, not both (--num_train_epochs sets the number of steps).")
    if passed("max_steps"):  # a script whose default is epochs (sft.py, reward.py) trains the steps asked for
        args.num_train_epochs = 0.0
    if args.eval_steps and not (args.eval_dataset or getattr(args, "test_size", 0)):  # reward.py holds out --test_size
        fail(f"--eval_steps {args.eval_steps} needs --eval_dataset (held-out data in --dataset's format).")
    if getattr(args, "eval_reward_fn", "") and not args.eval_dataset:  # grpo.py, ppo.py
        fail(f"--eval_reward_fn {args.eval_reward_fn} scores the --eval_dataset completions: add --eval_dataset "
             "(e.g. --eval_dataset embedded, the embedded world's test prompts).")
    if isinstance(args, SamplingArgs) and not (0 < args.top_p <= 1 and args.top_k >= 0 and 0 <= args.min_p < 1
                                               and args.repetition_penalty > 0 and args.num_completions_to_print >= 0):
        fail("--top_p must be in (0, 1], --top_k >= 0, --min_p in [0, 1), --repetition_penalty > 0, "
             "--num_completions_to_print >= 0.")
    check_choice("--parallel", args.parallel, ["ddp", "fsdp2"])
    if args.parallel == "fsdp2" and args.optim == "adamw_8bit":
        fail("--parallel fsdp2 needs --optim adamw: bitsandbytes' 8-bit AdamW cannot step FSDP2's sharded "
             "(DTensor) parameters. Or keep adamw_8bit with --parallel ddp.")
    if args.resume_from_checkpoint and not os.path.isfile(os.path.join(args.resume_from_checkpoint, "trainer_state.pt")):
        fail(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no trainer_state.pt there; pass a "
             "<output_dir>/checkpoint-<step> folder written by --save_steps.")
    if (args.load_in_4bit or args.load_in_8bit) and not args.use_peft:
        fail("--load_in_4bit / --load_in_8bit freeze a quantised base that only adapters can train: add --use_peft.")
    if args.load_in_4bit and args.load_in_8bit:
        fail("pass one of --load_in_4bit and --load_in_8bit, not both.")
    if args.use_peft and args.parallel == "fsdp2":
        fail("--use_peft runs under torchrun with --parallel ddp only (FSDP2 would shard the peft wrapper's layers).")
    checkpoints.check_output_dir(args)
    return args


def apply_defaults(args, embedded):
    """The rule for defaults, in one place. Each script's Args defaults suit a pretrained model
    (TRL's values where TRL has them); `embedded` holds the values tuned for the embedded world's
    tiny policy, used when --model is that policy (`is_embedded_policy`). A flag given on the
    command line always wins. Prints which set applies; args.json records the values used."""
    if is_embedded_policy(args.model):
        for name, value in embedded.items():
            if not passed(name):
                setattr(args, name, value)
        which = "the embedded world"
    else:
        which = "a pretrained model"
    shown = ", ".join(f"{name} {getattr(args, name):g}" if isinstance(getattr(args, name), float)
                      else f"{name} {getattr(args, name)}" for name in embedded)
    if parallel.is_main():
        print(f"{script_name()}: defaults for {which}: {shown} (flags you pass win)")
    return args


def print_step(prompts, per_prompt, micro_sequences, trl, note=""):
    """One line at the start of a run: what one optimizer step holds (over every rank), and the
    TRL settings of the same step, so a step's cost is known before it runs."""
    if parallel.is_main():
        print(f"{script_name()}: one optimizer step = {prompts} prompts x {per_prompt} completions = {prompts * per_prompt} "
              f"sequences, in micro-batches of {micro_sequences}{f' ({note})' if note else ''}; in TRL: {trl}")


# TRL (transformers.TrainingArguments) flags this project spells differently: ours, and how they differ
TRL_NAMES = {
    "per_device_train_batch_size": ("batch_size", ""), "per_device_eval_batch_size": ("eval_batch_size", ""),
    "model_name_or_path": ("model", ""), "dataset_name": ("dataset", ""), "dataset_train_split": ("dataset_split", ""),
    "bf16": ("dtype", "pass --dtype bfloat16"), "fp16": ("dtype", "pass --dtype float16"),
    "warmup_ratio": ("warmup_steps", "a number of steps, not a fraction of them"),
    "max_length": ("max_prompt_length", "prompts and completions are cut separately: also see --max_completion_length"),
    "save_strategy": ("save_steps", "0: final save only"), "logging_dir": ("output_dir", "metrics.jsonl and trackers write there"),
    "eval_strategy": ("eval_steps", "0: evaluate at the end only"), "evaluation_strategy": ("eval_steps", "0: evaluate at the end only"),
    "logging_strategy": ("logging_steps", ""), "max_seq_length": ("max_length", "TRL's older name"),
    "reward_funcs": ("reward_fn", "comma-separated: built-in names, file.py:function"),
    "reward_model_path": ("reward_model", ""), "sft_model_path": ("model", ""),
    "precompute_ref_log_probs": ("precompute_ref_logps", ""), "response_length": ("max_completion_length", ""),
    "total_episodes": ("max_steps", "rollout batches, not episodes"), "vllm_mode": ("use_vllm", "colocate only: the engine runs in the training process"),
    "teacher_model_name_or_path": ("teacher", ""), "max_new_tokens": ("max_completion_length", "GKDConfig's name"),
    # TRL flags with no flag here, and why
    "assistant_only_loss": ("", "sft.py always trains on the assistant turns of `messages` rows only (TRL's assistant_only_loss=True), with no flag"),
    "completion_only_loss": ("", "sft.py always trains on the completion of prompt/completion rows only (TRL's completion_only_loss=True), with no flag"),
    "dataset_text_field": ("", "the scripts read TRL's dataset formats by their column names (text; prompt and completion; messages; prompt, chosen and rejected): rename your column"),
    "disable_dropout": ("", "dropout is always off (TRL's disable_dropout=True)"),
    "center_rewards_coefficient": ("", "reward.py stores the mean score of the chosen responses (reward_mean) and the RL scripts subtract it"),
    "generation_batch_size": ("", "each micro-batch of --batch_size prompts is sampled (--num_generations each) and trained on in the same step"),
    "steps_per_generation": ("", "one rollout serves --num_iterations optimizer steps"),
    "use_liger_kernel": ("", "the log-probs are computed with a chunked head already (rlhf/sampling.py), no fused kernel is needed"),
    "model_init_kwargs": ("", "pass --dtype and --attn_implementation"),
    "seq_kd": ("", "distill.py trains its off-policy micro-batches (1 - --lmbda of them) on the dataset's completions, never on teacher-sampled ones"),
    "teacher_model_init_kwargs": ("", "the teacher loads as --model does, with --dtype and --attn_implementation, never with remote code"),
    "push_to_hub": ("", "the scripts save folders that load with from_pretrained; upload one with `huggingface-cli upload`"),
}


def unknown_flag_message(cls, unknown):
    """One sentence for arguments the parser did not know, with this project's name for a TRL flag."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cls)}
    flag = next((a for a in unknown if a.startswith("--")), None)
    if flag is None:
        return (f"unexpected argument(s) {' '.join(unknown)}: every setting is a --flag value pair "
                "(a script that takes bare arguments wants them before the first --flag).")
    name = flag[2:].split("=")[0]
    ours, note = TRL_NAMES.get(name, ("", ""))
    if ours in fields:
        return (f"unknown flag {flag}: TRL's --{name} is --{ours} here ({fields[ours].metadata.get('help', '')}"
                + (f"; {note}" if note else "") + ").")
    if note and not ours:  # a TRL flag this project has no flag for
        return f"unknown flag {flag}: TRL's --{name} has no flag here: {note}."
    close = [f for f in fields if name.replace("-", "_") in f or f in name]
    return f"unknown flag {flag}" + (f" (did you mean --{close[0]}?)" if close else "") + "; see --help for the flags."


# valid ranges of the numeric flags, for those a script's Args has (checked before anything loads)
AT_LEAST = {"max_steps": 1, "batch_size": 1, "gradient_accumulation_steps": 1, "logging_steps": 1, "eval_batch_size": 1,
            "max_prompt_length": 1, "max_completion_length": 1, "max_new_tokens": 1, "warmup_steps": 0,
            "save_steps": 0, "eval_steps": 0, "weight_decay": 0, "max_grad_norm": 0, "num_prompts": 0}
POSITIVE = ("learning_rate", "temperature")


def check_ranges(args):
    import dataclasses
    import math

    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{name} must be a finite number, got {value}.")
    for name, low in AT_LEAST.items():
        if name in defaults and getattr(args, name) < low:
            fail(f"--{name} must be at least {low}, got {getattr(args, name)}.")
    # the seed keys torch's and the samplers' generators (64-bit) after arithmetic (sampling_kwargs): 32 bits leave room
    if "seed" in defaults and not 0 <= args.seed < 2**32:
        fail(f"--seed must be in 0..{2**32 - 1}, got {args.seed}.")
    for name in POSITIVE:  # a default of 0 means "chosen by the script" (dpo.py's --learning_rate)
        if name in defaults and not (getattr(args, name) > 0 or getattr(args, name) == defaults[name] == 0):
            fail(f"--{name} must be positive, got {getattr(args, name)}.")


def scheduler_types():
    """transformers' SchedulerType values that need no extra arguments (no metric, no min_lr)."""
    from transformers.trainer_utils import SchedulerType

    needs_more = {"reduce_lr_on_plateau", "greedy", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"}
    return [t.value for t in SchedulerType if t.value not in needs_more]


def check_choice(flag, value, choices):
    if value not in choices:
        fail(f"{flag} {value!r} is not one of: {', '.join(choices)}.")


# ============================================================================ optimizer
def make_optimizer(model, args):
    """AdamW over the trainable parameters: bitsandbytes 8-bit (the default on CUDA) or torch's fused
    one (TRL's `adamw_torch_fused`).

    bf16 weights: a step that is smaller than half a bf16 ulp (lr 1e-6 on a weight of 1 is 1e-6,
    the ulp is 8e-3) rounds to nothing with round-to-nearest. `optimizer_step` therefore runs the
    optimizer on fp32 copies, one bucket of parameters at a time, and writes the result back
    with *stochastic rounding*: unbiased, so small updates survive in expectation. It costs no
    persistent memory (no master weights): only an fp32 copy of one bucket (`SR_BUCKET_NUMEL`)
    of weights and grads during the step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    if (default_optim(args) if args.optim == "auto" else args.optim) == "adamw_8bit":  # "auto": an Args built in code
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, **kw)
    else:  # fused: one kernel a step over all tensors (transformers' default optim with torch >= 2.8), 5x faster on a
        # CPU; FSDP2's sharded parameters step with torch's default (its fused kernel refuses their step counters)
        optimizer = torch.optim.AdamW(params, fused=not any(parallel.is_sharded_param(p) for p in params), **kw)
    optimizer.param_groups[0]["rounding_seed"] = getattr(args, "seed", 0)  # see rounding_generator
    return optimizer


def make_scheduler(optimizer, args):
    from transformers import get_scheduler

    if args.warmup_steps >= args.max_steps and parallel.is_main():
        print(f"{script_name()}: note: --warmup_steps {args.warmup_steps} >= --max_steps {args.max_steps}: the learning rate "
              f"never reaches --learning_rate {args.learning_rate:g} (it ends at {args.learning_rate * args.max_steps / max(args.warmup_steps, 1):.3g}).")
    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                         num_training_steps=args.max_steps)


def stochastic_round_(target, source, generator=None):
    """Copy fp32 `source` into bf16 `target`, rounding up with probability equal to the
    fraction of the bf16 ulp that round-down would lose (Gupta et al. 2015). The noise comes
    from `generator` (default: the global RNG)."""
    bits = source.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device=bits.device)
    target.copy_(((bits + noise) & -65536).view(torch.float32))  # dropping 16 low bits is exact


def rounding_generator(optimizer, device):
    """The noise of this optimizer step's stochastic rounding: a generator seeded from the run's
    seed and the step (both kept in the optimizer's param groups, so they travel with its
    state_dict), never from the global RNG, which differs between ranks (seed + rank): every
    rank then rounds its replica of a weight the same way, and replicas stay bit-identical."""
    group = optimizer.param_groups[0]
    group["rounding_step"] = group.get("rounding_step", 0) + 1
    seed = group.get("rounding_seed", 0) * 1_000_003 + group["rounding_step"]
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def optimizer_step(optimizer, max_grad_norm=0.0, step=None):
    """Clip gradients, step, zero gradients; low-precision weights get stochastic rounding.

    Returns the gradient norm before clipping. Under torchrun, gradients are first averaged
    over ranks (see `distribute`). A NaN/inf gradient norm (a finite loss can still have one)
    stops the run at `step` before the optimizer touches the weights.
    """
    if parallel.world_size() > 1:  # under torchrun: average gradients over ranks first (see `distribute`)
        parallel.sync_gradients([p for g in optimizer.param_groups for p in g["params"]])
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    for p in params:  # a tied embedding's backward that did not reach the head (models.sparse_tied_embedding)
        if p.grad.is_sparse:
            p.grad = p.grad.to_dense()
    # torch's fused AdamW clips inside its kernel: it divides each gradient by grad_scale as it reads it
    # (the hook torch's GradScaler uses), one pass over the gradients fewer than clip_grad_norm_'s
    fused_clip = optimizer.defaults.get("fused") and max_grad_norm > 0 and all(p.dtype == torch.float32 for p in params)
    if fused_clip:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    elif parallel.world_size() > 1 and any(parallel.is_sharded_param(p) for p in params):
        grad_norm = parallel.grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    check_finite("the gradient norm", grad_norm, step)  # same value on every rank: all stop together
    if fused_clip:
        scale = (grad_norm + 1e-6) / max_grad_norm  # the inverse of clip_grad_norm_'s coefficient
        optimizer.grad_scale = scale if scale > 1 else None
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    low = [p for p in params if p.dtype == torch.bfloat16]
    if not low:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    grads = {p: p.grad for p in low}
    for p in low:
        p.grad = None
    optimizer.step()  # full-precision parameters (and none of the bf16 ones) step here
    optimizer.zero_grad(set_to_none=True)
    generator = rounding_generator(optimizer, low[0].device)  # the same noise on every rank
    bucket, numel = [], 0
    for i, p in enumerate(low):
        bucket.append(p)
        numel += p.numel()
        if numel < SR_BUCKET_NUMEL and i < len(low) - 1:
            continue
        half = [p.data for p in bucket]
        for p in bucket:  # the optimizer sees fp32 weights and grads for this bucket only
            p.data, p.grad = p.data.float(), grads.pop(p).float()
        optimizer.step()
        for p, h in zip(bucket, half):
            stochastic_round_(h, p.data, generator)
            p.data, p.grad = h, None
        bucket, numel = [], 0
    return grad_norm


# ============================================================================ the embedded world
def gold_eval(model, tokenizer, args, max_new_tokens=48, n=None):
    """Mean gold score of greedy completions on the world's held-out test split."""
    test = embedded_world()["test"]
    if n:
        test = test.select(range(n))
    prompts = [data.render_prompt(tokenizer, p) for p in test["prompt"]]
    texts, truncated, _ = sampling.sample_texts(model, tokenizer, prompts, max_new_tokens, args.eval_batch_size, do_sample=False)
    scores = [world.gold_score(p, t) for p, t in zip(test["post"], texts)]
    return {"gold_score": sum(scores) / len(scores), "test_truncated_frac": sum(truncated) / len(truncated),
            "test_mean_words": sum(len(t.split()) for t in texts) / len(texts), "samples": texts[:5]}


def end_run(model, tokenizer, args, summary, sampler=None, before=""):
    """The end of a run whose loss starts positive and falls (dpo.py, kto.py, distill.py): on the
    embedded world the test gold score, into `summary` and printed beside `before` (a format string
    of summary's keys, e.g. "before: {init_gold_score:.3f}"); whether the loss blew up
    (tracking.divergence); summary.json, then the output folder's lock goes; the sampler stopped
    last (vLLM's shutdown destroys the default process group, after which every rank would take
    itself for rank 0: two summary.json writers); where the run was saved."""
    script = script_name()
    if args.dataset == EMBEDDED:
        ev = gold_eval(model, tokenizer, args)
        summary.update(ev)
        print(f"{script}: test gold score {ev['gold_score']:.3f} ({before.format(**summary)}); e.g. {ev['samples'][0]!r}")
    summary.update(tracking.divergence(args.output_dir))  # a loss that blew up: said, and not a success
    checkpoints.finish_run(args, summary)  # summary.json, then the lock goes
    if sampler is not None:
        rollouts.stop(sampler)
    print(f"{script}: {checkpoints.saved_where(args)}")


# ============================================================================ guards
def check_finite(name, value, step):
    """Stop the run if a loss, reward or gradient norm holds NaN or inf, naming the step. Call it
    before the optimizer step: the weights never see the bad value, and checkpoints are kept."""
    t = torch.as_tensor(value).detach()
    if not torch.isfinite(t).all():
        what = "NaN" if torch.isnan(t).any() else "inf"
        fail(f"{name} is {what} at step {step}; stopped before updating the weights. The checkpoints saved so "
             "far are kept (none holds a NaN/inf weight): rerun with --resume to continue from the last one with "
             "a lower --learning_rate (the schedule keeps its step, scaled to the new peak) or --max_grad_norm, "
             "or check the data / reward function of that step.")
