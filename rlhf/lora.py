"""LoRA and QLoRA through peft (Hu et al. 2021; Dettmers et al. 2023): adapters on a frozen (and
optionally 4- or 8-bit) base, the reference as that same base with the adapters off (no second
copy in memory), and the merged model a final save writes beside the adapters. Loading a model,
an adapter folder's base included, is models.load_model's job (models.py stands above this file).
"""

import contextlib
import json
import os
import warnings

from rlhf import basics


@contextlib.contextmanager
def quiet_peft():
    """peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` in PeftModel.__init__: a
    FutureWarning for every PeftModel built (adapters added, loaded, merged: every LoRA run, at its
    start and at its final save); the value it reads is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def adapter_base(name):
    """The model an adapter folder was trained on (adapter_config.json's base_model_name_or_path):
    a model folder or Hub id, or itself an adapter folder when adapters were trained on adapters."""
    with open(os.path.join(name, "adapter_config.json")) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base or not os.path.exists(base) and base.startswith((".", "/", "runs/")):
        basics.fail(f"{name} holds LoRA adapters of {base!r}, which is not here; run from the folder where "
                    "that run ran, or pass the merged model (<output_dir>/ of a run with --merge_adapters).")
    return base


def merge_adapter_folder(model, name, args, adapters=False):
    """`model` (the base of adapter folder `name`, loaded in --dtype by models.load_model; adapters on
    adapters are merged one stage after the other) with those adapters merged in; with `adapters`
    and --use_peft, fresh adapters on top to train. The result is named after `name`, so adapters
    trained on it record `name` as their base: exactly what they were trained on."""
    from peft import PeftModel

    with quiet_peft():
        model = PeftModel.from_pretrained(model, name).merge_and_unload()
    model.name_or_path = name
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
    base = _plain_model(args.model, type(inner), args, config)
    with tempfile.TemporaryDirectory() as tmp, quiet_peft():  # peft's own path: adapters saved, then loaded onto the base
        model.save_pretrained(tmp)
        return PeftModel.from_pretrained(base, tmp).merge_and_unload()


def _plain_model(name, cls, args, config):
    """`name` as an unquantised `cls` in --dtype with `config`: a model folder or Hub id, or an adapter
    folder (adapters on adapters: its base loaded the same way, its adapters merged in)."""
    from peft import PeftModel

    if os.path.isfile(os.path.join(name, "adapter_config.json")):
        with quiet_peft():
            return PeftModel.from_pretrained(_plain_model(adapter_base(name), cls, args, config), name).merge_and_unload()
    return cls.from_pretrained(name, config=config, dtype=basics.torch_dtype(args.dtype),
                               trust_remote_code=args.trust_remote_code, use_safetensors=True)


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
        with quiet_peft():
            return get_peft_model(model, config)
    except ValueError as e:  # e.g. a --lora_target_modules name this architecture does not have
        basics.fail(f"--lora_target_modules {targets}: {e}")


def is_peft(model):
    return model is not None and hasattr(model, "disable_adapter")


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
