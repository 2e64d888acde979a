"""What every script needs to run: arguments, loading, the 8-bit optimizer, data and
tokenisation, reward functions, logging and checkpoints. No algorithm lives here: losses,
advantages, KL and clipping stay in sft.py / reward.py / ppo.py / dpo.py / grpo.py.

The other shared modules, by reader: sampling.py (log-probs, generation, reward-model scores:
read it when you fork an algorithm), parallel.py (torchrun) and memory.py (the memory plan
and its measurement), which nobody needs to read to fork a script.
"""

import contextlib
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import sys
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

import parallel
import sampling
import world
import world_arith

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU-kernel import notice is noise here


def _quiet_transformers():
    """transformers' load reports and "Loading weights" bars would interleave with the scripts'
    own lines; its errors still show."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


_quiet_transformers()

EMBEDDED = "embedded"  # --dataset value (and the default) that selects the embedded world
ARITH = world_arith.SPEC  # --dataset embedded:arith[:LEVELS] selects the arithmetic world (world_arith.py)
CHAT_TEMPLATE_KWARGS = {}  # --chat_template_kwargs, set by parse_args, passed wherever a chat template renders


# ============================================================================ arguments
@dataclass
class ModelArgs:
    """The flags of every script that loads a model (eval.py's base); TrainArgs adds training's."""

    # model and data
    model: str = field(default="runs/sft", metadata={"help": "Hub id or local folder of the model to start from."})
    dataset: str = field(default=EMBEDDED, metadata={"help": "'embedded' (the synthetic TL;DR world), 'embedded:arith' (the arithmetic world; embedded:arith:2 chains, embedded:arith:1,2 both), a Hub dataset name, or a local .jsonl/.json/.parquet file or folder."})
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
    eval_dataset: str = field(default="", metadata={"help": "Held-out data in --dataset's format (a file, or a Hub name: its 'test' split), evaluated every --eval_steps and at the end (eval_* metrics)."})
    eval_steps: int = field(default=0, metadata={"help": "Evaluate on --eval_dataset every this many steps (0: at the end only)."})
    # optimisation
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps; more than one pass over the data cycles through it again."})
    num_train_epochs: float = field(default=0.0, metadata={"help": "Passes over --dataset; sets --max_steps from the dataset size (0: --max_steps decides)."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "Any transformers scheduler name: constant_with_warmup, linear, cosine, ..."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    batch_size: int = field(default=8, metadata={"help": "Examples per micro-batch (TRL: per_device_train_batch_size)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    optim: str = field(default="adamw_8bit", metadata={"help": "adamw_8bit (bitsandbytes) | adamw (torch)."})
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
class SamplingArgs(TrainArgs):
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


def sampling_kwargs(args):
    """The sampling knobs of a SamplingArgs, as keyword arguments of sampling.generate."""
    return {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}


def script_name():
    """The running script's name without .py: a fork (my_grpo.py) gets its own runs/my_grpo."""
    return os.path.splitext(os.path.basename(sys.argv[0]))[0]


def parse_args(cls, default_output_dir=None):
    """Parse the command line into the script's Args dataclass; fill the output folder (runs/<script>,
    or default_output_dir(args)) and check it before anything loads."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(cls)
    for action in parser._actions:  # an empty default reads as nothing, not "(default: )"
        if action.default == "" and action.help:
            action.help += "%(default)s"
    args, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        fail(unknown_flag_message(cls, unknown))
    args.output_dir = args.output_dir or (default_output_dir and default_output_dir(args)) or os.path.join("runs", script_name())
    check_ranges(args)
    check_choice("--lr_scheduler_type", args.lr_scheduler_type, scheduler_types())
    check_choice("--optim", args.optim, ["adamw_8bit", "adamw"])
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
    check_choice("--optim", args.optim, ["adamw_8bit", "adamw"])
    check_choice("--report_to", args.report_to, ["none", "tensorboard", "wandb"])
    if args.report_to != "none":  # before anything loads, not after the models did
        module = "tensorboard" if args.report_to == "tensorboard" else "wandb"
        if importlib.util.find_spec(module) is None:
            fail(f"--report_to {args.report_to} needs the {module} package: pip install {module} (or drop --report_to).")
    if args.num_train_epochs < 0 or args.save_total_limit < 0 or args.eval_steps < 0:
        fail("--num_train_epochs, --save_total_limit and --eval_steps must be >= 0.")
    if args.num_train_epochs and passed("max_steps"):
        fail("pass --num_train_epochs or --max_steps, not both (--num_train_epochs sets the number of steps).")
    if args.eval_steps and not (args.eval_dataset or getattr(args, "test_size", 0)):  # reward.py holds out --test_size
        fail(f"--eval_steps {args.eval_steps} needs --eval_dataset (held-out data in --dataset's format).")
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
    check_output_dir(args)
    return args


def is_embedded_policy(model):
    """Whether --model is one of the embedded worlds' tiny policies: sft.py's from-scratch model
    (no --model), a folder whose config says `from_scratch` (scratch.build_model writes it: the
    arithmetic world's runs/sft_arith and everything trained from it), or a folder whose tokenizer
    is the TL;DR world's word-level one (runs/sft of earlier versions). Anything else, a Hub id or
    a folder with another tokenizer or none (a bare config.json), is a pretrained model."""
    if model == "":
        return True
    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            if json.load(f).get("from_scratch"):
                return True
    path = os.path.join(model, "tokenizer.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        vocab = json.load(f).get("model", {}).get("vocab")
    return isinstance(vocab, dict) and set(vocab) == set(world.vocabulary())


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


def passed(name):
    """Whether --name (or --name=..., --name-with-dashes) is on the command line."""
    return any(a.startswith("--") and a[2:].split("=")[0].replace("-", "_") == name for a in sys.argv[1:])


# TRL (transformers.TrainingArguments) flags this project spells differently: ours, and how they differ
TRL_NAMES = {
    "per_device_train_batch_size": ("batch_size", ""), "per_device_eval_batch_size": ("eval_batch_size", ""),
    "model_name_or_path": ("model", ""), "dataset_name": ("dataset", ""), "dataset_train_split": ("dataset_split", ""),
    "bf16": ("dtype", "pass --dtype bfloat16"), "fp16": ("dtype", "pass --dtype float16"),
    "warmup_ratio": ("warmup_steps", "a number of steps, not a fraction of them"),
    "max_length": ("max_prompt_length", "prompts and completions are cut separately: also see --max_completion_length"),
    "save_strategy": ("save_steps", "0: final save only"), "logging_dir": ("output_dir", "metrics.jsonl and trackers write there"),
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


def fail(message):
    """Stop the run with a message a person can act on (no traceback for user errors)."""
    sys.exit(f"error: {message}")


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


# ============================================================================ models
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_dtype(name):
    """bf16 on CUDA and fp32 on CPU unless told otherwise."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def attn_implementation(name):
    if name != "auto":
        return name
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None  # transformers' choice: sdpa where the architecture supports it, else eager (Gemma-2)


def load_tokenizer(name, trust_remote_code=False):
    """AutoTokenizer from a Hub id or folder; a missing pad token falls back to EOS.

    Masks in this project come from lengths, never from token ids, so pad == EOS is safe.
    """
    from transformers import AutoTokenizer

    check_model_source(name)
    if os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, f))
                                       for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        fail(f"{name} holds no tokenizer (no tokenizer.json / tokenizer_config.json): save one there with "
             "tokenizer.save_pretrained.")
    if _saved_as_generic_tokenizer(name):
        # transformers 5's AutoTokenizer would pick the model type's class (Qwen2Tokenizer for the
        # world's tiny Qwen2) and rebuild its pre-tokenizer and decoder, breaking a custom
        # tokenizer.json such as the world's word-level one; load it exactly as it was saved.
        from transformers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {name} has no EOS token; set one with tokenizer.eos_token = ... and save it.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    _TOKENIZER_SIZES[name] = len(tokenizer)
    return tokenizer


_TOKENIZER_SIZES = {}  # name -> len(tokenizer), so load_model can check the model's vocabulary covers it


def _unreadable_safetensors(folder):
    """The first *.safetensors file of a folder whose header does not cover the file (torn), or None."""
    from glob import glob

    from safetensors import safe_open

    for path in sorted(glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(path, "pt") as f:
                f.keys()
        except Exception:  # noqa: BLE001 -- the file is named in the caller's message
            return path
    return None


def _saved_as_generic_tokenizer(name):
    path = os.path.join(name, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")


def check_model_source(name):
    if name == "runs/sft" and not os.path.exists(os.path.join(name, "config.json")):
        fail("runs/sft holds no model yet: run `python sft.py` first, or pass --model.")
    looks_local = name.startswith((".", "/", "~", "runs/")) or name.count("/") > 1  # Hub ids are org/name
    if looks_local and not os.path.exists(name):
        fail(f"model folder {name} does not exist.")
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            fail(f"{name} holds no model (no config.json): pass a folder written by save_pretrained or by one of the scripts.")
    elif not os.path.exists(name):
        _check_hub_id(name, "model")


def _check_hub_id(name, kind):
    """A name that is no local path must be a Hub repo, cached or reachable: say so before anything loads."""
    from huggingface_hub import try_to_load_from_cache

    if kind == "model" and isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    from huggingface_hub import HfApi

    try:
        (HfApi().model_info if kind == "model" else HfApi().dataset_info)(name, timeout=10)
    except Exception as e:  # noqa: BLE001 -- offline, unknown repo, gated: one sentence either way
        fail(f"{name} is not a local {'folder' if kind == 'model' else 'file or folder'} and the Hugging Face Hub "
             f"cannot provide it ({type(e).__name__}: {str(e)[:150]}); check the path (relative to {os.getcwd()}), "
             "or download it while online.")


def load_model(name, args, cls=None, adapters=False, **kwargs):
    """`cls.from_pretrained` (AutoModelForCausalLM by default) with our dtype/attention rules,
    safetensors only, no remote code unless asked, on the training device. A causal LM whose
    forward transforms its logits in a way sampling.lm_logits does not reproduce is refused.

    `adapters=True` marks the model a script trains: with --use_peft its base is loaded (at 4 or
    8 bits with --load_in_4bit / --load_in_8bit), frozen, and wrapped by peft.get_peft_model
    with LoRA adapters on --lora_target_modules; a score head (reward models, critics:
    task_type SEQ_CLS) is trained in full next to them (peft's modules_to_save). Frozen models
    (`adapters=False`) load as before, in --dtype.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    check_model_source(name)
    cls = cls or AutoModelForCausalLM
    if os.path.isfile(os.path.join(name, "adapter_config.json")):  # an adapter folder (<output_dir>/adapter)
        return load_adapter_folder(name, args, cls, adapters, **kwargs)
    peft = adapters and args.use_peft
    if peft and (args.load_in_4bit or args.load_in_8bit):
        # QLoRA (Dettmers et al. 2023): NF4 weights, one fp32 absmax per block of 64, matmuls in --dtype
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=args.load_in_4bit, load_in_8bit=args.load_in_8bit, bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch_dtype(args.dtype))
        kwargs["device_map"] = {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}
    try:
        model = cls.from_pretrained(
            name, dtype=torch_dtype(args.dtype), attn_implementation=attn_implementation(args.attn_implementation),
            trust_remote_code=args.trust_remote_code, use_safetensors=True, **kwargs,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # torn safetensors, no weights, a config transformers rejects
        bad = _unreadable_safetensors(name)
        fail(f"{bad or name} cannot be loaded ({type(e).__name__}: {str(e)[:300]})"
             + ("; the file is torn or corrupt: save the model again." if bad else "."))
    vocab = model.get_input_embeddings().num_embeddings
    if _TOKENIZER_SIZES.get(name, 0) > vocab:
        fail(f"{name}: the tokenizer has {_TOKENIZER_SIZES[name]} tokens but the model's embedding only {vocab}; "
             "token ids beyond it would crash the forward pass: resize with model.resize_token_embeddings(len(tokenizer)) "
             "and save again.")
    if "device_map" not in kwargs:  # quantised weights are placed by from_pretrained and cannot be moved
        model = model.to(device())
    for module in model.modules():  # bitsandbytes 0.50 on the CPU repacks 4-bit weights at the first
        if hasattr(module, "support_avx512bf16_for_cpu"):  # no-grad eval forward (a rollout), and then
            module.support_avx512bf16_for_cpu = False  # cannot backpropagate through them: keep one layout
    if cls is AutoModelForCausalLM:
        sampling.check_logits(model)  # one forward of a few tokens
    if getattr(args, "gradient_checkpointing", False):
        enable_checkpointing(model)
    if peft:
        model = add_adapters(model, args)
    return model


def load_adapter_folder(name, args, cls, adapters=False, **kwargs):
    """A model saved as LoRA adapters (adapter_config.json + adapter_model.safetensors): its
    base (adapter_config.json's base_model_name_or_path, in --dtype) with the adapters merged in."""
    from peft import PeftModel

    with open(os.path.join(name, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    if not base or not os.path.exists(base) and base.startswith((".", "/", "runs/")):
        fail(f"{name} holds LoRA adapters of {base!r}, which is not here; run from the folder where "
             "that run ran, or pass the merged model (<output_dir>/ of a run with --merge_adapters).")
    model = load_model(base, args, cls, **kwargs)
    model = PeftModel.from_pretrained(model, name).merge_and_unload()
    return add_adapters(model, args) if adapters and args.use_peft else model


def merged_model(model, args):
    """The trained adapters merged into a fresh copy of the base in --dtype, on the CPU: W + (alpha/r) B A.
    A quantised base is reloaded unquantised rather than merged into its rounded weights, so the
    result loads anywhere as a plain transformers model (eval.py, vLLM, lm-eval)."""
    import copy
    import tempfile

    from peft import PeftModel

    inner = model.get_base_model()
    config = copy.deepcopy(inner.config)  # with what the run added, e.g. reward.py's reward_mean
    for name in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, name):
            delattr(config, name)
    base = type(inner).from_pretrained(args.model, config=config, dtype=torch_dtype(args.dtype),
                                       trust_remote_code=args.trust_remote_code, use_safetensors=True)
    with tempfile.TemporaryDirectory() as tmp:  # peft's own path: adapters saved, then loaded onto the base
        model.save_pretrained(tmp)
        return PeftModel.from_pretrained(base, tmp).merge_and_unload()


def add_adapters(model, args):
    """LoRA adapters (Hu et al. 2021) on a frozen base: W x + (lora_alpha / r) B A x, B = 0 at
    the start, so the adapted model starts exactly as the base.

    Not peft's prepare_model_for_kbit_training: it casts every unquantised weight (embeddings,
    head, norms) to fp32, and with them the hidden states, which for Qwen2.5-7B costs 2.2 GB of
    weights and doubles the activations; its other jobs are done here already (get_peft_model
    freezes the base; non-reentrant checkpointing needs no input gradients).
    """
    from peft import LoraConfig, TaskType, get_peft_model

    score_head = hasattr(model, "score")  # AutoModelForSequenceClassification: reward models, critics
    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        task_type=TaskType.SEQ_CLS if score_head else TaskType.CAUSAL_LM,
        modules_to_save=["score"] if score_head else None)  # the new head trains in full
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # e.g. a --lora_target_modules name this architecture does not have
        fail(f"--lora_target_modules {targets}: {e}")


def is_peft(model):
    return model is not None and hasattr(model, "disable_adapter")


def reference_of(model, args):
    """The frozen reference pi_ref: with --use_peft the policy itself, whose base is the
    reference when its adapters are off (`adapters_off`), so it costs no memory; otherwise a
    frozen copy of --model."""
    if is_peft(model):
        return model
    return freeze(load_model(args.model, args))


@contextlib.contextmanager
def adapters_off(model):
    """Run `model` as its base: a peft model with its adapters (and trained score head) switched
    off and dropout off; any other model unchanged."""
    if not is_peft(model):
        yield model
        return
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def enable_checkpointing(model):
    """Activation (gradient) checkpointing of every decoder layer, non-reentrant; transformers 5
    renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def disable_dropout(model):
    """Dropout off by setting it to zero (TRL's disable_dropout): every nn.Dropout gets p = 0, and
    so do the float `*dropout*` fields of the modules (HF attention keeps its own copy of
    `attention_dropout`, applied in training mode only) and of the config. The model can then
    stay in training mode, which HF's gradient checkpointing needs (its layers recompute only
    while training), and every forward pass is deterministic (PPO: ratio == 1 at the first update)."""
    configs = [model.config] if hasattr(model, "config") else []
    for m in list(model.modules()) + configs:
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(m, name, 0.0)
    return model


def freeze(model):
    """A frozen copy in eval mode: no grads, dropout off."""
    model.eval()
    model.requires_grad_(False)
    return model


# ============================================================================ optimizer
def make_optimizer(model, args):
    """AdamW over the trainable parameters: bitsandbytes 8-bit (default) or torch's.

    bf16 weights: a step that is smaller than half a bf16 ulp (lr 1e-6 on a weight of 1 is 1e-6,
    the ulp is 8e-3) rounds to nothing with round-to-nearest. `optimizer_step` therefore runs the
    optimizer on fp32 copies, one bucket of parameters at a time, and writes the result back
    with *stochastic rounding*: unbiased, so small updates survive in expectation. It costs no
    persistent memory (no master weights): only an fp32 copy of one bucket (`SR_BUCKET_NUMEL`)
    of weights and grads during the step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    if args.optim == "adamw_8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, **kw)
    else:
        optimizer = torch.optim.AdamW(params, **kw)
    optimizer.param_groups[0]["rounding_seed"] = getattr(args, "seed", 0)  # see rounding_generator
    return optimizer


def make_scheduler(optimizer, args):
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                         num_training_steps=args.max_steps)


SR_BUCKET_NUMEL = 2**26  # parameters per fp32 bucket in optimizer_step (256 MB of fp32 weights)


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
    if parallel.world_size() > 1 and any(parallel.is_sharded_param(p) for p in params):
        grad_norm = parallel.grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    check_finite("the gradient norm", grad_norm, step)  # same value on every rank: all stop together
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


# ============================================================================ data
def load_data(spec, split="train"):
    """A `datasets.Dataset` from a Hub name, a local .jsonl/.json/.parquet file, or a folder.

    JSONL is checked line by line first, so a malformed row names its file and line.
    """
    from datasets import load_dataset

    if os.path.isfile(spec):
        ext = os.path.splitext(spec)[1].lower()
        if ext in (".jsonl", ".json"):
            if ext == ".jsonl":
                check_jsonl(spec)
            return load_dataset("json", data_files=spec, split="train")
        if ext == ".parquet":
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(spec).metadata.num_rows
            except Exception as e:  # noqa: BLE001 -- not parquet at all
                fail(f"{spec} is not a readable parquet file ({type(e).__name__}: {e}).")
            if rows == 0:
                fail(f"{spec} has no rows.")
            return load_dataset("parquet", data_files=spec, split="train")
        fail(f"{spec}: unsupported file type {ext!r}; use .jsonl, .json or .parquet.")
    if spec.endswith((".jsonl", ".json", ".parquet")) and not os.path.exists(spec):
        fail(f"dataset file {spec} does not exist.")
    if os.path.isdir(spec):  # a folder of data files: each JSONL file is checked line by line too
        for root, _, names in os.walk(spec):
            for n in sorted(names):
                if n.endswith(".jsonl"):
                    check_jsonl(os.path.join(root, n))
    elif not os.path.exists(spec) and spec.count("/") <= 1 and not spec.startswith((".", "/", "~")):
        _check_hub_id(spec, "dataset")
    else:
        fail(f"dataset {spec} does not exist.")
    try:
        ds = load_dataset(spec, split=split)
    except ValueError as e:  # e.g. an unknown split
        fail(f"dataset {spec}: {str(e)[:300]}")
    if len(ds) == 0:
        fail(f"dataset {spec} (split {split}) has no rows.")
    return ds


def training_data(args, world_split):
    """The script's --dataset: on the embedded world its `world_split` split (sft, prefs or rl),
    otherwise load_data(--dataset, --dataset_split)."""
    if args.dataset == EMBEDDED:
        return embedded_world(args.seed)[world_split]
    if args.dataset.startswith(ARITH):
        return arith_split(args.dataset, world_split, args.seed)
    return load_data(args.dataset, args.dataset_split)


def set_max_steps(args, num_examples, examples_per_step):
    """--num_train_epochs E (TRL's): max_steps = ceil(E * examples / examples per optimizer step)."""
    if args.num_train_epochs:
        args.max_steps = max(1, math.ceil(args.num_train_epochs * num_examples / examples_per_step))
        print(f"{script_name()}: --num_train_epochs {args.num_train_epochs:g} over {num_examples} examples, "
              f"{examples_per_step} per step: {args.max_steps} steps")


def eval_data(args):
    """--eval_dataset (a file, or a Hub name's 'test' split), or None when not given."""
    return load_data(args.eval_dataset, "test") if args.eval_dataset else None


def check_jsonl(path):
    rows = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                fail(f"{path}, line {n}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); re-encode the file as UTF-8.")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno}).")
            if not isinstance(row, dict):
                fail(f"{path}, line {n}: each line must be a JSON object, got {type(row).__name__}.")
            rows += 1
    if rows == 0:
        fail(f"{path} is empty (no JSON rows, only blank lines or nothing).")


def dataset_name(spec):
    return "the embedded world" if spec == EMBEDDED else spec


def require_columns(ds, columns, spec, hint=""):
    """Stop with a message naming the missing column and the dataset."""
    for col in columns:
        if col not in ds.column_names:
            fail(f"{dataset_name(spec)} has no column {col!r} (columns: {', '.join(ds.column_names)}). {hint}".strip())
    if len(ds) == 0:
        fail(f"{dataset_name(spec)} is empty.")


def is_conversational(value):
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_text(ds, columns, spec):
    """Every value of these columns is a non-empty string or a list of {role, content} messages."""
    for col in columns:
        for i, v in enumerate(ds[col]):
            # a conversation's last message is the response (or the prompt's question): empty is an error too
            if is_conversational(v) and v and not str(v[-1]["content"]).strip():
                fail(f"{dataset_name(spec)}, row {i}, column {col!r}: the last {v[-1]['role']} message is empty; an empty "
                     "response would train on the end-of-turn token alone. Remove the row or fill it.")
            if not ((isinstance(v, str) and v.strip()) or (is_conversational(v) and v)):
                fail(f"{dataset_name(spec)}, row {i}, column {col!r}: expected non-empty text or a list of "
                     f"{{role, content}} messages, got {str(v)[:80]!r}.")


def check_readable(tokenizer, texts, model, spec, rows=16):
    """Stop when most tokens of the first `rows` texts are the tokenizer's unknown token: the
    data is in words this tokenizer cannot read (typically --dataset without --model, which
    trains the embedded world's word-level policy on it)."""
    unk = tokenizer.unk_token_id
    ids = [i for t in texts[:rows] for i in tokenizer(t, add_special_tokens=False)["input_ids"]]
    if unk is None or not ids:
        return
    n_unk = sum(i == unk for i in ids)
    if n_unk > len(ids) / 2:
        fail(f"{n_unk} of the {len(ids)} tokens of the first rows of {dataset_name(spec)} are unknown ({tokenizer.unk_token}) "
             f"to the tokenizer of {model or 'the from-scratch model'} ({type(tokenizer).__name__}, {len(tokenizer)} tokens): "
             "it cannot read this text. --model is probably missing: pass the Hub id or folder of a model whose "
             "tokenizer reads it (the default runs/sft is the embedded world's word-level policy).")


def render_prompt(tokenizer, prompt):
    """Prompt text: plain strings as they are; conversations through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if not tokenizer.chat_template:
        fail("conversational data needs a tokenizer with a chat template; this one has none.")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **CHAT_TEMPLATE_KWARGS)


def render_completion(tokenizer, prompt, completion):
    """Completion text: plain strings as they are; assistant messages as the chat template
    writes them after the prompt (so the end-of-turn token is trained on)."""
    if isinstance(completion, str):
        return completion
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **CHAT_TEMPLATE_KWARGS)
    full = tokenizer.apply_chat_template(prompt + completion, tokenize=False, **CHAT_TEMPLATE_KWARGS)
    if not full.startswith(head):
        fail("the chat template does not render the prompt as a prefix of prompt + completion; "
             "pass prompt/completion as plain strings instead.")
    return full[len(head):]


def render_turns(tokenizer, prompt, completion):
    """The completion as [(text, trained), ...] segments after the rendered prompt (TRL's
    assistant_only_loss): a string is one trained segment; messages alternate trained assistant
    turns (as the chat template writes them, end-of-turn token included) and masked others
    (user/tool turns and the next generation prompt). Joined, the texts are render_completion's."""
    if isinstance(completion, str):
        return [(completion, True)]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    msgs = prompt + completion

    def upto(k, gen):  # the conversation's first k messages, rendered
        return tokenizer.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=gen, **CHAT_TEMPLATE_KWARGS)

    segments, done = [], upto(len(prompt), True)
    for k in range(len(prompt), len(msgs)):
        is_assistant = msgs[k]["role"] == "assistant"
        # after an assistant turn, the text up to the next generation prompt (if one follows) is masked
        nxt = upto(k + 1, not is_assistant and k + 1 < len(msgs) and msgs[k + 1]["role"] == "assistant")
        if not nxt.startswith(done):
            fail("the chat template does not render each turn as a prefix of the next; pass prompt/completion "
                 "as plain strings instead.")
        if len(nxt) > len(done):
            segments.append((nxt[len(done):], is_assistant))
        done = nxt
    return segments


def sft_pairs(ds, spec):
    """(prompt, completion) pairs from TRL's SFT formats: prompt+completion, or messages (the
    prompt is everything before the first assistant turn, the completion the rest: every
    assistant turn is trained, the turns between them masked; see render_turns)."""
    if "messages" in ds.column_names:
        check_text(ds, ["messages"], spec)
        pairs = []
        for i, msgs in enumerate(ds["messages"]):
            first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), 0) if is_conversational(msgs) else 0
            if not is_conversational(msgs) or msgs[-1]["role"] != "assistant" or first < 1:
                fail(f"{dataset_name(spec)}, row {i}, column 'messages': must end with an assistant turn, and have "
                     "at least one other turn before its first assistant turn.")
            if not str(msgs[-1]["content"]).strip():
                fail(f"{dataset_name(spec)}, row {i}, column 'messages': the last assistant message is empty; "
                     "an empty response would train on the end-of-turn token alone. Remove the row or fill it.")
            pairs.append((msgs[:first], msgs[first:]))
        return pairs
    if "text" in ds.column_names and "completion" not in ds.column_names:
        fail(f"{dataset_name(spec)} is in the language-modelling format (a 'text' column); this project trains on "
             "prompt+completion or messages, so split each row into 'prompt' and 'completion'.")
    require_columns(ds, ["prompt", "completion"], spec, "Expected prompt+completion or messages.")
    check_text(ds, ["prompt", "completion"], spec)
    return list(zip(ds["prompt"], ds["completion"]))


def preference_triples(ds, spec):
    """(prompt, chosen, rejected) from TRL's preference formats, standard or conversational;
    without a prompt column, the prompt is the shared conversation before the last turn."""
    require_columns(ds, ["chosen", "rejected"], spec, "Preference data needs prompt + chosen + rejected.")
    if "prompt" not in ds.column_names:
        triples = []
        for i, (c, r) in enumerate(zip(ds["chosen"], ds["rejected"])):
            if not (is_conversational(c) and is_conversational(r) and c[:-1] == r[:-1] and len(c) > 1):
                fail(f"{dataset_name(spec)}, row {i}: without a 'prompt' column, 'chosen' and 'rejected' must be "
                     "conversations that differ only in the last turn.")
            for col, v in (("chosen", c), ("rejected", r)):
                if not str(v[-1]["content"]).strip():
                    fail(f"{dataset_name(spec)}, row {i}, column {col!r}: the last {v[-1]['role']} message is empty; an empty "
                         "response would be the end-of-turn token alone. Remove the row or fill it.")
            triples.append((c[:-1], c[-1:], r[-1:]))
    else:
        check_text(ds, ["prompt", "chosen", "rejected"], spec)
        triples = list(zip(ds["prompt"], ds["chosen"], ds["rejected"]))
    # chosen == rejected: kept (no preference: zero gradient in DPO's and Bradley-Terry's loss), but counted
    same = [i for i, (_, c, r) in enumerate(triples) if c == r]
    if same:
        print(f"note: {len(same)} of {len(triples)} pairs of {dataset_name(spec)} have chosen == rejected (first: row "
              f"{same[0]}); they carry no preference and are kept, diluting the batch mean.")
    return triples


def batch_indices(n, batch_size, seed, step):
    """The example indices of micro-batch `step`: a fresh permutation every epoch, cycling
    forever. Stateless, so a resumed run sees exactly the data it would have seen."""
    out = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return out


def count_truncated(tokenizer, texts, max_length, completions=False):
    """How many texts encode_prompts (or encode_completions) will cut at max_length tokens."""
    if not max_length:
        return 0
    encode = encode_completions if completions else encode_prompts
    return sum(int((encode(tokenizer, texts[i:i + 1024])[1].sum(1) > max_length).sum())
               for i in range(0, len(texts), 1024))


def truncation_counts(tokenizer, prompts, responses, args, name):
    """prompts_truncated / completions_truncated for summary.json, counted up front and printed:
    prompts longer than --max_prompt_length keep their last tokens, responses (dataset completions,
    None for sampled ones, which the scripts count as they sample) keep their first
    --max_completion_length tokens."""
    counts = {"prompts_truncated": count_truncated(tokenizer, prompts, args.max_prompt_length),
              "completions_truncated": count_truncated(tokenizer, responses, args.max_completion_length, True) if responses else 0}
    if any(counts.values()):
        print(f"{name}: {counts['prompts_truncated']} of {len(prompts)} prompts are longer than --max_prompt_length "
              f"{args.max_prompt_length} and keep their last tokens"
              + (f"; {counts['completions_truncated']} of {len(responses)} responses are longer than --max_completion_length "
                 f"{args.max_completion_length} and are cut (their EOS is not seen)" if responses else ""))
    return counts


# ============================================================================ tokenization
def encode_prompts(tokenizer, texts, max_length=None):
    """Left-padded prompt ids (B, P) and mask; too-long prompts keep their end."""
    seqs = [tokenizer(t, add_special_tokens=not _has_bos(tokenizer, t))["input_ids"] for t in texts]
    if max_length:
        seqs = [s[-max_length:] for s in seqs]
    return _pad(seqs, tokenizer.pad_token_id, left=True)


def encode_completions(tokenizer, texts, max_length=None, stop_ids=None):
    """Right-padded completion ids (B, C) and mask, each ending with a stop token: EOS is added
    unless the text already ends with one of `stop_ids` (sampling.stop_token_ids; default: EOS
    alone), e.g. a chat template's end-of-turn. The mask, not the ids, says where a completion
    ends (cut at max_length, the stop token is lost)."""
    eos = tokenizer.eos_token_id
    stops = set(stop_ids or [eos])
    seqs = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        if not ids or ids[-1] not in stops:
            ids = ids + [eos]
        seqs.append(ids[:max_length] if max_length else ids)
    return _pad(seqs, tokenizer.pad_token_id, left=False)


def encode_turns(tokenizer, turns, max_length=None, stop_ids=None):
    """encode_completions for completions given as render_turns segments: right-padded ids
    (B, C), mask, and the loss mask (B, C): 1 on the tokens of trained segments and on EOS
    (added unless the text already ends with one of `stop_ids`, as in encode_completions)."""
    eos = tokenizer.eos_token_id
    stops = set(stop_ids or [eos])
    seqs, trained = [], []
    for segments in turns:
        ids, train = [], []
        for text, is_trained in segments:  # each segment encoded alone, as prompt and completion are
            t = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, train = ids + t, train + [int(is_trained)] * len(t)
        if not ids or ids[-1] not in stops:
            ids, train = ids + [eos], train + [1]
        seqs.append(ids[:max_length] if max_length else ids)
        trained.append(train[:max_length] if max_length else train)
    ids, mask = _pad(seqs, tokenizer.pad_token_id, left=False)
    return ids, mask, _pad(trained, 0, left=False)[0] * mask


def _has_bos(tokenizer, text):
    return tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)


def _pad(seqs, pad_id, left):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


# ============================================================================ rewards
def load_reward_fn(spec):
    """`file.py:function` -> the function, called as fn(prompts, completions, **columns) -> floats
    (TRL's reward-function signature); `gold` -> the embedded world's gold judge; `arith_strict`,
    `arith_lenient` -> the arithmetic world's verifiers."""
    if spec == "gold":
        return world.gold_reward
    if spec in world_arith.VERIFIERS:
        return world_arith.VERIFIERS[spec]
    path, _, name = spec.rpartition(":")
    if not path or not name:
        fail(f"--reward_fn {spec!r}: expected file.py:function (or gold, {', '.join(world_arith.VERIFIERS)}).")
    if not os.path.isfile(path):
        fail(f"--reward_fn {spec!r}: file {path} does not exist.")
    module_spec = importlib.util.spec_from_file_location(f"reward_fn_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        fail(f"--reward_fn {spec!r}: {path} defines no function {name!r}.")
    return getattr(module, name)


def call_reward_fn(fn, prompts, completions, columns=None):
    """Call a reward function on a batch and check what it returns: one finite float per
    completion. If it raises, find the prompt that makes it raise and stop with both."""
    columns = columns or {}
    name = getattr(fn, "__name__", str(fn))
    try:
        rewards = fn(prompts, completions, **columns)
    except (Exception, SystemExit) as batch_error:  # noqa: BLE001 -- re-raised below with the culprit prompt (sys.exit too)
        for i in range(len(prompts)):
            try:
                fn(prompts[i:i + 1], completions[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
            except (Exception, SystemExit) as e:  # noqa: BLE001
                fail(f"reward function {name} raised {type(e).__name__}: {e}\n  on prompt {i}: {str(prompts[i])[:300]!r}"
                     f"\n  completion: {str(completions[i])[:300]!r}")
        fail(f"reward function {name} raised {type(batch_error).__name__}: {batch_error} on a batch of "
             f"{len(prompts)} prompts (each prompt alone works); first prompt: {str(prompts[0])[:300]!r}")
    rewards = list(rewards) if rewards is not None else []
    if len(rewards) != len(completions):
        fail(f"reward function {name} returned {len(rewards)} values for {len(completions)} completions.")
    out = []
    for i, r in enumerate(rewards):
        # any real number: Python, numpy (np.float32, ...) or a 0-d tensor; not a bool, string or None
        try:
            value = float(r) if not isinstance(r, (bool, str, bytes)) and r is not None and not isinstance(r, complex) else None
        except (TypeError, ValueError, RuntimeError):  # a list, a tensor of several values, ...
            value = None
        if value is None or value != value or abs(value) == float("inf"):
            fail(f"reward function {name} returned {r!r} for prompt {i}: {str(prompts[i])[:300]!r}; "
                 "rewards must be finite real numbers.")
        out.append(value)
    return torch.tensor(out)


def load_reward_model(path, args):
    """A reward model saved by reward.py (AutoModelForSequenceClassification, num_labels=1),
    frozen, with its own tokenizer (it may differ from the policy's)."""
    from transformers import AutoModelForSequenceClassification

    if not os.path.exists(os.path.join(path, "config.json")):
        fail(f"no reward model in {path}: run `python reward.py` first, or pass another path.")
    check_score_head(path)
    tokenizer = load_tokenizer(path, args.trust_remote_code)
    model = load_model(path, args, cls=AutoModelForSequenceClassification, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    return freeze(model), tokenizer


def check_score_head(path):
    """A reward model is a sequence classifier whose scalar head was trained and saved: refuse a
    folder whose safetensors weights hold no `score`/`classifier` head (e.g. a causal LM), which
    transformers would load with a freshly initialised head, scoring at random."""
    from glob import glob

    from safetensors import safe_open

    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        return  # a Hub id, or a folder without safetensors: load_model says what is missing
    names = set()
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                names.update(st.keys())
        except Exception as e:  # noqa: BLE001 -- torn or corrupt file
            fail(f"{f} cannot be read ({type(e).__name__}: {e}); save the model again.")
    if not any(n.split(".")[-2:-1] in (["score"], ["classifier"]) for n in names):
        fail(f"{path} is not a reward model: its weights have no sequence-classification head (score.weight), so "
             "its scores would come from a random head. reward.py writes one (AutoModelForSequenceClassification, "
             "num_labels=1): run `python reward.py --model ...` and pass its --output_dir.")


# ============================================================================ the embedded world
_WORLD_CACHE = {}


def embedded_world(seed=0):
    """The world's datasets (built once per process; deterministic in the seed)."""
    if seed not in _WORLD_CACHE:
        _WORLD_CACHE[seed] = world.build_world(seed)
    return _WORLD_CACHE[seed]


def arith_split(spec, split, seed=0):
    """A split of the arithmetic world named by --dataset embedded:arith[:LEVELS] (built once per process)."""
    try:
        levels = world_arith.parse_spec(spec)
    except ValueError as e:
        fail(str(e))
    if levels is None:
        fail(f"--dataset {spec}: the arithmetic world is {ARITH}, {ARITH}:2 (chains) or {ARITH}:1,2 (both levels).")
    if split not in ("sft", "rl", "test"):
        fail(f"--dataset {spec}: the arithmetic world has no {split!r} split (only sft, rl, test): it is a world "
             "for SFT and RL with verifiers, not for preference pairs.")
    if (spec, seed) not in _WORLD_CACHE:
        _WORLD_CACHE[spec, seed] = world_arith.build_world(seed, levels)
    return _WORLD_CACHE[spec, seed][split]


def gold_eval(model, tokenizer, args, max_new_tokens=48, n=None):
    """Mean gold score of greedy completions on the world's held-out test split."""
    test = embedded_world()["test"]
    if n:
        test = test.select(range(n))
    prompts = [render_prompt(tokenizer, p) for p in test["prompt"]]
    texts, truncated = sampling.sample_texts(model, tokenizer, prompts, max_new_tokens, args.eval_batch_size, do_sample=False)
    scores = [world.gold_score(p, t) for p, t in zip(test["post"], texts)]
    return {"gold_score": sum(scores) / len(scores), "test_truncated_frac": sum(truncated) / len(truncated),
            "test_mean_words": sum(len(t.split()) for t in texts) / len(texts), "samples": texts[:5]}


# ============================================================================ logging
class MetricsLogger:
    """metrics.jsonl (one JSON object per logged step, each with `step`), the console, and an
    optional tracker (tensorboard / wandb, imported only when --report_to asks for it).

    Every step, `update(metrics, num_tokens)` adds that step's metrics to the logging window;
    every --logging_steps, `log(step, metrics)` writes the window's mean (key by key, as TRL
    logs) plus `metrics` (values of that moment, e.g. the learning rate) and `num_tokens`, the
    tokens (prompt + completion) trained on since the start of the run, cumulative as in TRL.
    """

    def __init__(self, args, start_step=0):
        os.makedirs(args.output_dir, exist_ok=True)
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        self.tracker = None
        self.window, self.num_tokens, self.num_tokens_before = [], 0, 0
        if not parallel.is_main():  # under torchrun only rank 0 writes; the others only join the reduction in log()
            return
        claim_output_dir(args)
        kept = []
        if start_step and os.path.exists(self.path):  # resuming: keep the lines up to the checkpoint
            with open(self.path) as f:
                lines = f.readlines()
            for n, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if n == len(lines):  # torn by a kill or a full disk during the write: a step after the checkpoint
                        print(f"resume: dropped the torn last line of {self.path}.")
                        break
                    fail(f"{self.path}, line {n}: not valid JSON; delete that line and resume again.")
                if row["step"] <= start_step:
                    kept.append(line)
        self.num_tokens_before = max([json.loads(line).get("num_tokens", 0) for line in kept] or [0])
        with open(self.path, "w") as f:
            f.writelines(kept)
        if args.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tracker = SummaryWriter(args.output_dir)
        elif args.report_to == "wandb":
            import wandb

            self.tracker = wandb.init(config=vars(args), dir=args.output_dir)

    def update(self, metrics, num_tokens=0):
        """One step's metrics into the logging window; `num_tokens` this rank trained on in it."""
        self.window.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) or torch.is_tensor(v)})
        self.num_tokens += int(num_tokens)

    def log(self, step, metrics=None, pbar=None):
        """Write the window's mean plus `metrics`, then start a new window. Under torchrun,
        numbers are averaged over ranks first (num_tokens summed): call it on every rank."""
        metrics = {**window_mean(self.window), **(metrics or {})}
        if self.num_tokens or self.num_tokens_before:
            metrics["num_tokens"] = self.num_tokens
        self.window = []
        self._write(step, metrics, pbar)

    def log_eval(self, step, metrics):
        """Held-out metrics (eval_*): their own line in metrics.jsonl, printed to the console."""
        metrics = self._write(step, metrics)
        if metrics is not None:
            tqdm.write(f"{script_name()}: step {step}: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))

    def _write(self, step, metrics, pbar=None):
        metrics = {k: (float(v) if torch.is_tensor(v) else v) for k, v in metrics.items()}
        if parallel.world_size() > 1:
            metrics = parallel.mean_over_ranks(metrics)  # ranks may hold different keys
            if "num_tokens" in metrics:  # a sum over ranks, not a mean
                metrics["num_tokens"] = round(metrics["num_tokens"] * parallel.world_size())
            if not parallel.is_main():
                return None
        if "num_tokens" in metrics:
            metrics["num_tokens"] += self.num_tokens_before
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if pbar is not None:
            pbar.set_postfix({k: f"{v:.3g}" for k, v in list(metrics.items())[:4] if isinstance(v, float)}, refresh=False)
        if self.tracker is not None and hasattr(self.tracker, "add_scalar"):
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tracker.add_scalar(k, v, step)
        elif self.tracker is not None:
            self.tracker.log(metrics, step=step)
        return metrics

    def close(self):
        if self.tracker is not None:
            self.tracker.close() if hasattr(self.tracker, "add_scalar") else self.tracker.finish()


def window_mean(rows):
    """Key-by-key mean of metric dicts, each key over the rows that have it."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def log_completions(args, step, prompts, completions, rewards):
    """--log_completions: a table of the first --num_completions_to_print (prompt, completion,
    rewards) on the console; every row appended to <output_dir>/completions.jsonl. `rewards` is
    {name: one value per completion}; prompts are the dataset's (text or messages)."""
    if not parallel.is_main():
        return
    rows = [{"step": step, "prompt": p, "completion": c, **{k: float(v[i]) for k, v in rewards.items()}}
            for i, (p, c) in enumerate(zip(prompts, completions))]
    with open(os.path.join(args.output_dir, "completions.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)

    def cell(x, width, tail=False):  # one line; a prompt shows its end, a completion its start
        text = " ".join((x[-1]["content"] if is_conversational(x) else str(x)).split())
        if len(text) > width:
            text = "..." + text[3 - width:] if tail else text[:width - 3] + "..."
        return text.ljust(width)

    names = list(rewards)
    header = f"{'prompt (end)':<40} | {'completion':<50} | " + " | ".join(f"{n[:12]:>12}" for n in names)
    lines = [f"{script_name()}: completions at step {step}", header, "-" * len(header)]
    for r in rows[:args.num_completions_to_print]:
        lines.append(f"{cell(r['prompt'], 40, tail=True)} | {cell(r['completion'], 50)} | "
                     + " | ".join(f"{r[n]:>12.4g}" for n in names))
    tqdm.write("\n".join(lines))


_LOCK = None  # the open <output_dir>/.lock of this process, held until it exits


def claim_output_dir(args):
    """Lock --output_dir for this run (a second live run there is refused; the OS releases the lock
    when the process exits, also after a crash), then clear what a previous run leaves behind: its
    summary.json (written after the model, so one is never stale), and with --overwrite_output_dir
    (not resuming) its checkpoints and final model, so that a later --resume never continues
    another run and a crash never leaves the old model looking current."""
    import fcntl

    global _LOCK
    os.makedirs(args.output_dir, exist_ok=True)
    lock = open(os.path.join(args.output_dir, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"another run is writing to {args.output_dir} (it holds {args.output_dir}/.lock); wait for it to end "
             "or pass another --output_dir.")
    lock.seek(0), lock.truncate(), lock.write(f"{os.getpid()}\n"), lock.flush()
    _LOCK = lock
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(args.output_dir, "summary.json"))
    if args.overwrite_output_dir and not (args.resume or args.resume_from_checkpoint):
        old = [n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-") or n == "final.tmp"
               or n == "config.json" or n.endswith((".safetensors", ".safetensors.index.json"))]  # its final model
        for name in old:
            path = os.path.join(args.output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if old:
            print(f"--overwrite_output_dir: removed the previous run's {', '.join(sorted(old))} from {args.output_dir}.")


def check_output_dir(args):
    """Before anything loads: --output_dir must not be the model it starts from, and a folder that
    holds another run's model or checkpoints needs --resume or --overwrite_output_dir."""
    model = getattr(args, "model", "")
    if model and os.path.exists(model) and os.path.realpath(model) == os.path.realpath(args.output_dir):
        fail(f"--output_dir {args.output_dir} is the --model folder: the run would overwrite the model it starts "
             "from; pass another --output_dir.")
    if (args.resume or args.resume_from_checkpoint or args.overwrite_output_dir or args.estimate_memory
            or not os.path.isdir(args.output_dir)):
        return
    held = sorted(n for n in os.listdir(args.output_dir)
                  if n == "config.json" or (n.startswith("checkpoint-") and not n.endswith((".tmp", ".old"))))
    if held:
        what = " and ".join(w for w, ok in [("model", "config.json" in held), ("checkpoints", any(n.startswith("checkpoint-") for n in held))] if ok)
        fail(f"--output_dir {args.output_dir} holds another run's {what} ({', '.join(held[:4])}); pass --resume to continue that run, --overwrite_output_dir "
             "to replace it, or another --output_dir.")


def progress(args, start=0, desc=None):
    return tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, desc=desc,
                dynamic_ncols=True, disable=os.environ.get("TQDM_DISABLE") == "1" or not parallel.is_main())


def mean_metrics(rows):
    """Average a list of metric dicts (e.g. over minibatches) key by key."""
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in rows[0]}


# ============================================================================ checkpoints
def save_checkpoint(model, tokenizer, args, folder, state=None):
    """save_pretrained of model and tokenizer plus args.json (and `state`, e.g. optimizer and
    step, as trainer_state.pt), written to a temporary folder and renamed into place, so a crash
    never leaves half a checkpoint. Under torchrun: call on every rank; rank 0 writes."""
    state_dict = parallel.full_state_dict(model) if parallel.is_sharded(model) else None  # FSDP2: gather (collective)
    if parallel.is_main():
        # never write a NaN/inf weight: --resume would pick it up as the newest good checkpoint
        models = {"": state_dict if state_dict is not None else model.state_dict(),
                  **{f"{k}.": v for k, v in (state or {}).items()
                     if isinstance(v, dict) and v and all(torch.is_tensor(t) for t in v.values())}}  # e.g. critic
        for prefix, tensors in models.items():
            if (bad := nonfinite_tensor(tensors)) is not None:
                fail(f"the weight {prefix}{bad} holds NaN/inf; not saving {folder}. The checkpoints saved so far are "
                     "kept: rerun with --resume to continue from the last one with a lower --learning_rate.")
        _save_folder(model, tokenizer, args, folder, state, state_dict)
        if getattr(args, "save_total_limit", 0):
            delete_old_checkpoints(args.output_dir, args.save_total_limit)
    parallel.barrier()


def delete_old_checkpoints(output_dir, limit):
    """--save_total_limit: keep the newest `limit` complete checkpoint-<step> folders, after a
    successful save (so a crash while saving never leaves fewer than `limit` whole ones)."""
    import re

    steps = sorted(int(m.group(1)) for n in os.listdir(output_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", n)))
    for step in steps[:-limit]:
        shutil.rmtree(os.path.join(output_dir, f"checkpoint-{step}"))


def _save_folder(model, tokenizer, args, folder, state, state_dict):
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if os.environ.get("RLHF_TEST_CRASH_WHILE_SAVING") == os.path.basename(folder.rstrip("/")):
        os.kill(os.getpid(), 9)  # test hook (tests/test_resume.py): SIGKILL with this checkpoint half-written
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=2)
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    old = folder.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_final(model, tokenizer, args):
    """The final model in <output_dir>/ (where metrics.jsonl and checkpoints also live): saved
    to a temporary folder, then moved in file by file with config.json last, so a crash never
    leaves a loadable half-model.

    With --use_peft: the adapters go to <output_dir>/adapter/ (small, to share or to resume
    from), and with --merge_adapters (the default) the merged model to <output_dir>/, so every
    consumer of a run's output (eval.py, the next stage's --model, vLLM, lm-eval) reads a plain
    transformers model there, as after full fine-tuning."""
    out = args.output_dir
    if is_peft(model):
        save_checkpoint(model, tokenizer, args, os.path.join(out, "adapter"))
        if not args.merge_adapters:
            return
        model = merged_model(model, args) if parallel.is_main() else model
    tmp = os.path.join(out, "final.tmp")
    save_checkpoint(model, tokenizer, args, tmp)
    if not parallel.is_main():
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, "config.json"))
    names = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
    for name in names:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.rmdir(tmp)


def write_json(path, obj):
    """Write JSON atomically (temporary file, then rename); under torchrun, rank 0 only."""
    if not parallel.is_main():
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def load_weights(model, folder):
    """Copy a checkpoint's safetensors weights into `model` in place (FSDP2 shards included).
    Tied weights (e.g. a head sharing the embedding) may be absent from the files."""
    from glob import glob

    from safetensors.torch import load_file

    loaded = {}
    for path in sorted(glob(os.path.join(folder, "*.safetensors"))):
        try:
            loaded.update(load_file(path))
        except Exception as e:  # noqa: BLE001 -- a torn or corrupt file: name it, offer the earlier checkpoint
            fail(f"{path} cannot be read ({type(e).__name__}: {e}).{_earlier_checkpoints(folder)}")
    if not loaded:
        fail(f"{folder} holds no *.safetensors weights; pass a checkpoint folder written by --save_steps.")
    if (bad := nonfinite_tensor(loaded)) is not None:
        fail(f"{folder}: the weight {bad} holds NaN/inf; refusing to resume from it.{_earlier_checkpoints(folder)}")
    if is_peft(model):  # adapters (and a trained score head), saved under peft's names
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, loaded)
        if result.unexpected_keys or not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            fail(f"{folder} does not hold this run's adapters; resume with the same --model, --use_peft and "
                 "--lora_* flags as the run that wrote it.")
        return
    copy_weights(model, loaded, folder)


def copy_weights(model, loaded, source):
    """Copy a {name: full tensor} state dict into `model` in place (FSDP2 shards included)."""
    from torch.distributed.tensor import distribute_tensor

    params = model.state_dict()
    unexpected = sorted(set(loaded) - set(params))
    if unexpected:
        fail(f"{source} does not match this model (unexpected weights {', '.join(unexpected[:3])}); "
             "resume with the same --model and sizes as the run that wrote it.")
    with torch.no_grad():
        for name, src in loaded.items():
            dst = params[name]
            if parallel.is_sharded_param(dst):
                src = distribute_tensor(src.to(dst.device, dst.dtype), dst.device_mesh, dst.placements)
            dst.copy_(src)


def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def training_state(step, optimizer, scheduler, **stateful):
    """Everything besides the weights that a resumed run needs, for save_checkpoint's `state`:
    the step (which is also the position in the data: batch_indices is stateless), the
    optimizer (8-bit states included; FSDP2 shards gathered), the scheduler, every rank's RNG
    states, and the state_dict() of any further `stateful` object (e.g. value_optimizer=...).
    A collective under torchrun: call it on every rank."""
    rngs = [rng_state()]
    if parallel.world_size() > 1:
        rngs = [None] * parallel.world_size()
        torch.distributed.all_gather_object(rngs, rng_state())
    optim = optimizer.state_dict()  # its per-parameter dicts are the live state: copy, never edit them
    optim["state"] = {i: {k: v.full_tensor().cpu() if parallel.is_sharded_param(v) else v for k, v in s.items()}
                      for i, s in optim["state"].items()}
    # FSDP2 trains bf16 layers as fp32 shards, and the saved model is rounded to bf16: keep the
    # fp32 weights the run trains, so a resumed run continues from them
    params = [p for g in optimizer.param_groups for p in g["params"]]
    masters = [p.detach().full_tensor().cpu() if parallel.is_sharded_param(p) else None for p in params]
    return {"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rngs,
            **({"master_weights": masters} if any(m is not None for m in masters) else {}),
            **{name: adapter_state(obj) if is_peft(obj) else parallel.full_state_dict(obj)
               if isinstance(obj, torch.nn.Module) else obj.state_dict()
               for name, obj in stateful.items()}}  # a model's FSDP2 shards gathered


def adapter_state(model):
    """What a peft model trains (adapters, a score head), under peft's names: all a checkpoint needs."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def checkpoints(output_dir):
    """The complete <output_dir>/checkpoint-<step> folders (renamed into place only when whole), oldest first."""
    import re

    steps = [int(m.group(1)) for n in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
             if (m := re.fullmatch(r"checkpoint-(\d+)", n)) and os.path.isfile(os.path.join(output_dir, n, "trainer_state.pt"))]
    return [os.path.join(output_dir, f"checkpoint-{s}") for s in sorted(steps)]


def last_checkpoint(output_dir):
    """The newest complete <output_dir>/checkpoint-<step>, or None."""
    found = checkpoints(output_dir)
    return found[-1] if found else None


def _earlier_checkpoints(folder):
    """A sentence offering the checkpoints older than `folder`, for error messages."""
    import re

    folder = os.path.normpath(folder)
    m = re.search(r"checkpoint-(\d+)$", folder)
    older = [c for c in checkpoints(os.path.dirname(folder))
             if os.path.normpath(c) != folder and (m is None or int(c.rsplit("-", 1)[1]) < int(m.group(1)))]
    if not older:
        return " No earlier checkpoint is left; start again without --resume (with --overwrite_output_dir)."
    return (f" Resume from the previous one with --resume_from_checkpoint {older[-1]}"
            + (f" (earlier: {', '.join(older[:-1])})." if older[:-1] else "."))


# flags that may change when resuming: they change no example, sample or update of the steps to come
# (--learning_rate and --max_grad_norm are the advice of check_finite; see maybe_resume)
RESUME_FREE = {"output_dir", "resume", "resume_from_checkpoint", "overwrite_output_dir", "resume_allow_changes",
               "max_steps", "logging_steps", "save_steps", "eval_steps", "report_to", "eval_batch_size",
               "estimate_memory", "gradient_checkpointing", "attn_implementation", "parallel", "offload_frozen",
               "learning_rate", "max_grad_norm"}


def check_resume_args(args, folder, step):
    """Refuse a resume whose arguments differ from the checkpoint's args.json in a way that breaks
    "ends where an uninterrupted run ends" (data, batch sizes, seed, model, rewards, optimizer,
    algorithm), naming the flag and both values, unless --resume_allow_changes."""
    path = os.path.join(folder, "args.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path} cannot be read ({e}).{_earlier_checkpoints(folder)}")
    if args.max_steps < step:
        fail(f"--max_steps {args.max_steps} is below the step of {folder} ({step}): pass --max_steps >= {step}, "
             "or take the checkpoint as it is (eval.py reads it).")
    ours = vars(args)
    if set(saved) - set(ours) and not getattr(args, "resume_allow_changes", False):
        fail(f"{folder} was written by another script (its args.json has {', '.join(sorted(set(saved) - set(ours))[:3])}, "
             f"which {script_name()}.py has not); resume it with that script.")
    changed = [k for k in ours if k in saved and k not in RESUME_FREE and saved[k] != ours[k]]
    if changed and not getattr(args, "resume_allow_changes", False):
        k = changed[0]
        fail(f"--{k} {ours[k]!r} differs from the {saved[k]!r} that {folder} was trained with"
             + (f" (also: {', '.join('--' + c for c in changed[1:])})" if changed[1:] else "")
             + "; the resumed run would not end where the interrupted one would. Pass the same value, or add "
             "--resume_allow_changes to continue anyway.")
    for k in changed:
        print(f"resume: --{k} {ours[k]!r} replaces {saved[k]!r} (--resume_allow_changes).")
    if saved.get("max_steps", args.max_steps) != args.max_steps:
        print(f"resume: --max_steps {args.max_steps} replaces {saved['max_steps']}; a decaying --lr_scheduler_type "
              "stretches to the new length from the current step.")
    return saved


def maybe_resume(args, model, optimizer, scheduler, **stateful):
    """With --resume (newest checkpoint in --output_dir) or --resume_from_checkpoint PATH: load
    the weights, optimizer, scheduler, RNG states (and each `stateful` object's state) saved by
    save_checkpoint(..., training_state(...)) and return the step to continue from; else 0.
    Call after distribute() and make_optimizer/make_scheduler."""
    from torch.distributed.tensor import distribute_tensor

    folder = args.resume_from_checkpoint or (last_checkpoint(args.output_dir) if args.resume else "")
    if not folder:
        if args.resume:
            print(f"resume: no checkpoint in {args.output_dir} yet; starting from step 0.")
        return 0
    try:
        state = torch.load(os.path.join(folder, "trainer_state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torn/corrupt (a malicious pickle is refused by weights_only too)
        fail(f"{folder}/trainer_state.pt cannot be read ({type(e).__name__}: {str(e)[:200]}).{_earlier_checkpoints(folder)}")
    saved = check_resume_args(args, folder, state["step"])
    load_weights(model, folder)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, s in state["optimizer"]["state"].items():  # FSDP2: re-shard full states like their parameter
        for k, v in s.items():
            if parallel.is_sharded_param(params[i]) and torch.is_tensor(v) and v.shape == params[i].shape:
                s[k] = distribute_tensor(v.to(params[i].device), params[i].device_mesh, params[i].placements)
    optimizer.load_state_dict(state["optimizer"])
    # load_state_dict casts floating-point states to their parameter's dtype (fp32 moments of bf16
    # weights to bf16, which optimizer_step cannot step): give them back the dtype they were saved in
    for i, s in state["optimizer"]["state"].items():
        live = optimizer.state[params[i]]
        for k, v in s.items():
            if torch.is_tensor(v) and torch.is_tensor(live.get(k)) and live[k].dtype != v.dtype:
                live[k] = v.to(live[k].device)
    scheduler.load_state_dict(state["scheduler"])
    if saved.get("learning_rate", args.learning_rate) != args.learning_rate:
        # a new peak lr (e.g. after a NaN): the schedule keeps its step and shape, scaled to the new peak,
        # i.e. lr(t) = new_lr * schedule(t); without this the restored scheduler would keep the old peak
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] *= args.learning_rate / base
            group["initial_lr"] = args.learning_rate
        scheduler.base_lrs = [args.learning_rate] * len(scheduler.base_lrs)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        print(f"resume: --learning_rate {args.learning_rate:g} replaces {saved['learning_rate']:g}; the schedule "
              f"continues from step {state['step']}, scaled to the new peak.")
    for name, obj in stateful.items():
        if is_peft(obj):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.nn.Module):  # e.g. ppo.py's critic (FSDP2: re-sharded)
            copy_weights(obj, state[name], folder)
        else:
            obj.load_state_dict(state[name])
    for p, master in zip(params, state.get("master_weights", [])):  # FSDP2: the fp32 shards, unrounded
        if master is not None:
            with torch.no_grad():
                p.copy_(distribute_tensor(master.to(p.device, p.dtype), p.device_mesh, p.placements))
    if len(state["rng"]) == parallel.world_size():
        set_rng_state(state["rng"][parallel.rank()])
    else:  # a different number of ranks: sampling cannot replay exactly, the data order still does
        print(f"resume: {folder} was written by {len(state['rng'])} ranks, this run has {parallel.world_size()}; "
              "random states are re-seeded, so sampling will differ from an uninterrupted run.")
        set_seed(args.seed + parallel.rank() + state["step"])
    print(f"resume: continuing from {folder} at step {state['step']}.")
    return state["step"]


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


def nonfinite_tensor(tensors):
    """The name of the first tensor of a {name: tensor} dict that holds NaN or inf, else None."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None
