"""models.py: loading what the scripts train and read -- tokenizers, causal LMs, reward models
and references -- from a Hub id or a folder, with the project's rules: safetensors only, no remote
code unless asked, the dtype and attention implementation of --dtype / --attn_implementation,
LoRA adapters with --use_peft, and a one-sentence refusal of a folder that is not what it should
be (a reward model passed as a policy, a torn file, a tokenizer larger than the embedding).
"""

import importlib.util
import json
import os

import torch

from rlhf import lora
from rlhf import parallel
from rlhf import sampling
from rlhf.basics import brief, check_hub_id, device, fail, freeze, torch_dtype


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
        # tokenizer.json such as a word-level one (runs/sft of earlier versions); load it exactly as saved.
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


def check_lm_head(name):
    """A policy is a causal LM: refuse a folder saved as a sequence classifier (reward.py's output),
    whose language-model head transformers would make up (tied to the embeddings, or random)."""
    config = os.path.join(name, "config.json")
    if not os.path.isfile(config):
        return
    with open(config) as f:
        architectures = json.load(f).get("architectures") or []
    if architectures and all(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures):
        fail(f"{name} is a reward model ({architectures[0]}: a score head, no language-model head), so it cannot "
             "generate; pass a language model as --model (e.g. sft.py's output) and the reward model as --reward_model.")


def check_model_source(name):
    if name == "runs/sft" and not os.path.exists(os.path.join(name, "config.json")):
        fail("runs/sft holds no model yet: run `python sft.py` first, or pass another model (--model; eval.py: a policy).")
    looks_local = name.startswith((".", "/", "~", "runs/")) or name.count("/") > 1  # Hub ids are org/name
    if looks_local and not os.path.exists(name):
        fail(f"model folder {name} does not exist.")
    if os.path.isdir(name):  # a model folder, or an adapter folder (lora.adapter_base)
        if not any(os.path.isfile(os.path.join(name, f)) for f in ("config.json", "adapter_config.json")):
            fail(f"{name} holds no model (no config.json): pass a folder written by save_pretrained or by one of the scripts.")
    elif not os.path.exists(name):
        check_hub_id(name, "model")


def _int8_in_training_mode(module, inputs):
    """Forward pre-hook of a bitsandbytes Linear8bitLt on the CPU: its training-mode kernel
    (dequantised weights, exact activations) in every mode. It has no dropout, so the flag
    changes nothing else."""
    module.training = True


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
        base = load_model(lora.adapter_base(name), args, cls, **kwargs)
        return lora.merge_adapter_folder(base, name, args, adapters)
    peft = adapters and args.use_peft
    if peft and (args.load_in_4bit or args.load_in_8bit):
        # QLoRA (Dettmers et al. 2023): NF4 weights, one fp32 absmax per block of 64, matmuls in --dtype
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=args.load_in_4bit, load_in_8bit=args.load_in_8bit, bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch_dtype(args.dtype))
        kwargs["device_map"] = {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}
    if cls is AutoModelForCausalLM:
        check_lm_head(name)
    try:
        model, info = cls.from_pretrained(
            name, dtype=torch_dtype(args.dtype), attn_implementation=attn_implementation(args.attn_implementation),
            trust_remote_code=args.trust_remote_code, use_safetensors=True, output_loading_info=True, **kwargs,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # torn safetensors, no weights, a config transformers rejects
        bad = _unreadable_safetensors(name)
        fail(f"{bad or name} cannot be loaded ({type(e).__name__}: {brief(e)})"
             + ("; the file is torn or corrupt: save the model again." if bad else "."))
    if cls is AutoModelForCausalLM and info["missing_keys"]:  # transformers would start them at random
        missing = sorted(info["missing_keys"])
        fail(f"{name} has no weights for {', '.join(missing[:3])}{' ...' if missing[3:] else ''}, which a causal LM "
             "needs: they would start at random. Pass a language model (e.g. sft.py's output), not a reward model "
             "or a truncated save.")
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
        if type(module).__name__ == "Linear8bitLt" and model.device.type == "cpu":
            # its CPU kernels compute another function per mode: training mode dequantises the weights,
            # eval mode also rounds the activations to int8, so the reference and the sampler (eval)
            # would differ from the policy (training) by up to 5e-4 nats. One function: training's.
            module.register_forward_pre_hook(_int8_in_training_mode)
    if cls is AutoModelForCausalLM:
        sampling.check_logits(model)  # one forward of a few tokens
    if getattr(args, "gradient_checkpointing", False):
        enable_checkpointing(model)
    if peft:
        model = lora.add_adapters(model, args)
    elif adapters:
        sparse_tied_embedding(model)
    return model


def sparse_tied_embedding(model):
    """A trained model whose input embedding is its LM head's weight (tied: SmolLM2, the small
    Qwen2.5s, the embedded world's policies) gets a sparse gradient from the embedding's backward:
    the rows of the batch's tokens, which autograd adds to the head's dense gradient (into a copy
    of it: the head's arrives first). The dense one is a zeroed vocabulary-sized tensor, and a
    second one holds the sum: two fresh (V, d) allocations a backward where the sparse rows take
    one, 113 MB each for SmolLM2 (docs/benchmarks.md, section 2). A backward that reaches the
    embedding but not the head leaves a sparse gradient, which common.optimizer_step makes dense.
    One process only: the ranks' gradient averaging and FSDP2 take dense gradients."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (parallel.world_size() == 1 and isinstance(embedding, torch.nn.Embedding) and head is not None
            and head.weight is embedding.weight):
        embedding.sparse = True


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


def reference_of(model, args):
    """The frozen reference pi_ref: with --use_peft the policy itself, whose base is the
    reference when its adapters are off (`lora.adapters_off`), so it costs no memory; otherwise a
    frozen copy of --model."""
    if lora.is_peft(model):
        return model
    return freeze(load_model(args.model, args))



def default_optim(args):
    """--optim auto: bitsandbytes' 8-bit AdamW where it saves memory, CUDA (the seed's default there),
    and for the embedded worlds' tiny policies; torch's AdamW for a pretrained model on a CPU (the 8-bit
    kernels there only cost time: 27-35 s a step against 13 s for a 135M model's SFT) and under FSDP2
    (whose sharded parameters it cannot step)."""
    if getattr(args, "parallel", "ddp") == "fsdp2":
        return "adamw"
    # the embedded worlds' tiny policies keep 8-bit on a CPU too: every result and time in docs/ was
    # measured with it (their states are a few MB, so it costs them little)
    return "adamw_8bit" if torch.cuda.is_available() or is_embedded_policy(getattr(args, "model", "")) else "adamw"


def is_embedded_policy(model):
    """Whether --model is one of the embedded worlds' tiny policies: sft.py's from-scratch model
    (no --model) or a folder whose config says `from_scratch` (scratch.build_model writes it:
    runs/sft, runs/sft_arith and everything trained from them). Anything else, a Hub id or a
    folder without that key, is a pretrained model."""
    if model == "":
        return True
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return bool(json.load(f).get("from_scratch"))


# ============================================================================ reward models
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
