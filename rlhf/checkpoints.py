"""A run's output folder: protection (another run's model or checkpoints need --resume or
--overwrite_output_dir; a lock refuses a second live run), atomic checkpoints and final saves
(write aside, then swap; never a NaN weight), and a resume that restores weights, optimizer,
scheduler and RNG exactly and checks that the new arguments keep the run equivalent.
"""

import contextlib
import json
import os
import random
import shutil

import torch

from rlhf import basics
from rlhf import data
from rlhf import lora
from rlhf import parallel
from rlhf import throughput


_LOCK = None  # the open <output_dir>/.lock of this process, held until the run ends (finish_run) or exits


# ============================================================================ what a run folder holds
# Every protection, resume, the eval cache and sweep.py read a run folder through these names.
# A run's --output_dir holds: its final model (config.json + *.safetensors + tokenizer files),
# with --use_peft its adapters (adapter/), its checkpoints (checkpoint-<step>/, each a model plus
# trainer_state.pt and args.json), its logs (metrics.jsonl, completions.jsonl, memory.json,
# tracker files), summary.json (written last: the run finished), sweep.py's record of the
# settings it ran the folder with (sweep.json), and the transient files of an unfinished save.
RUN_FILES = {"config.json", "generation_config.json", "args.json", "summary.json", "metrics.jsonl", "completions.jsonl",
             "memory.json", "sweep.json", "trainer_state.pt", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
             "merges.txt", "tokenizer.model", "adapter_config.json", "adapter", "final.tmp", "wandb", "input_hashes.json"}
RUN_PATTERN = r"checkpoint-\d+(\.tmp|\.old|\.abandoned)?|.*\.safetensors(\.index\.json)?|events\.out\.tfevents\..*|.*\.json\.tmp"


def run_files(folder):
    """The names in `folder` that a run wrote there (what --overwrite_output_dir removes), sorted."""
    import re

    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n in RUN_FILES or re.fullmatch(RUN_PATTERN, n))


def run_outputs(folder):
    """What of a run's output `folder` holds that another run must not overwrite unasked: its
    model (config.json), its adapters (adapter/ or adapter_config.json), its checkpoints."""
    held = [n for n in run_files(folder) if n in ("config.json", "adapter_config.json")
            or n.startswith("checkpoint-") and not n.endswith((".tmp", ".old"))
            or n == "adapter" and os.path.isfile(os.path.join(folder, n, "adapter_config.json"))]
    return sorted(held)


def describe_outputs(held):
    """'model, adapters and checkpoints' for run_outputs' names."""
    kinds = [w for w, ok in [("model", "config.json" in held),
                             ("adapters", "adapter" in held or "adapter_config.json" in held),
                             ("checkpoints", any(n.startswith("checkpoint-") for n in held))] if ok]
    return ", ".join(kinds[:-1]) + (" and " if kinds[1:] else "") + kinds[-1]


def is_inside(path, folder):
    """Whether `path` is `folder` or lies anywhere below it, links resolved."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def writing(path, kept):
    """A write to `path` that fails for the filesystem's reasons (full disk, read-only, a missing
    folder) ends in one sentence naming the path and `kept`, what of the run is still intact."""
    try:
        yield
    except OSError as e:
        basics.fail(f"cannot write {path} ({e.strerror or e}); {kept}")


def _is_rank0():
    return os.environ.get("RANK", "0") == "0"  # before torch.distributed starts, torchrun's environment says


def _lock(output_dir):
    """Take <output_dir>/.lock (this process may hold it already: an earlier run in-process)."""
    import fcntl

    global _LOCK
    path = os.path.realpath(os.path.join(output_dir, ".lock"))
    if _LOCK is not None and not _LOCK.closed and os.path.realpath(_LOCK.name) == path:
        return _LOCK
    if _LOCK is not None:  # an earlier run in this process, elsewhere: it has ended
        _LOCK.close()
    while True:
        with writing(path, "nothing of the folder was changed; pass a writable --output_dir."):
            lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            basics.fail(f"another run is writing to {output_dir} (it holds {output_dir}/.lock); wait for it "
                        "to end or pass another --output_dir.")
        # a run that ended removed the file it held: then lock the file now at this path instead
        if os.path.exists(path) and os.path.samestat(os.fstat(lock.fileno()), os.stat(path)):
            break
        lock.close()
    lock.seek(0), lock.truncate(), lock.write(f"{os.getpid()}\n"), lock.flush()
    _LOCK = lock
    return lock


def claim_output_dir(args):
    """Lock --output_dir for this run (a second live run there is refused; the OS releases the lock
    when the process exits, also after a crash), then clear what a previous run leaves behind: its
    summary.json (written after the model, so one is never stale), and with --overwrite_output_dir
    (not resuming) everything of the previous run (run_files), so that a later --resume never
    continues another run, eval.py never reads its adapters, and a crash never leaves the old model
    looking current. All of it goes, or (a file that cannot be moved) none of it."""
    with writing(args.output_dir, "nothing was changed; pass a writable --output_dir."):
        os.makedirs(args.output_dir, exist_ok=True)
    _lock(args.output_dir)
    resuming = getattr(args, "resume", False) or getattr(args, "resume_from_checkpoint", "")
    if getattr(args, "overwrite_output_dir", False) and not resuming:
        remove_run(args.output_dir)
    summary = os.path.join(args.output_dir, "summary.json")
    with writing(summary, "nothing else was changed; pass a writable --output_dir."), contextlib.suppress(FileNotFoundError):
        os.remove(summary)


def remove_run(folder):
    """--overwrite_output_dir: move everything of the previous run into a hidden folder (one
    rename each, undone if one fails, so the run is removed whole or not at all), then delete
    that. A link (e.g. a checkpoint-* linked to a folder elsewhere) is removed, its target kept."""
    old = run_files(folder)
    if not old:
        return
    trash = os.path.join(folder, ".overwritten")
    shutil.rmtree(trash, ignore_errors=True)
    with writing(trash, f"nothing of the previous run in {folder} was removed."):
        os.mkdir(trash)
    moved = []
    for name in old:
        try:
            os.rename(os.path.join(folder, name), os.path.join(trash, name))
        except OSError as e:
            for done in reversed(moved):
                os.rename(os.path.join(trash, done), os.path.join(folder, done))
            os.rmdir(trash)
            basics.fail(f"--overwrite_output_dir cannot remove {os.path.join(folder, name)} ({e.strerror}); nothing of "
                        f"the previous run in {folder} was removed: remove it yourself or pass another --output_dir.")
        moved.append(name)
    links = [n for n in old if os.path.islink(os.path.join(trash, n))]
    shutil.rmtree(trash, ignore_errors=True)
    print(f"--overwrite_output_dir: removed the previous run's {', '.join(old)} from {folder}"
          + (f" (the links {', '.join(links)} only: what they point to is kept)" if links else "") + ".")


def release_output_dir():
    """Unlock and remove <output_dir>/.lock: the run has ended (a crash leaves it, and the next
    run finds it free)."""
    global _LOCK
    if _LOCK is None or _LOCK.closed:
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(_LOCK.name)
    _LOCK.close()
    _LOCK = None


def finish_run(args, summary):
    """The last act of a run: summary.json (which marks the folder finished), with the run's step
    time, throughput and MFU (throughput.run_summary), then the lock goes."""
    summary = {**summary, **throughput.run_summary()}
    write_json(os.path.join(args.output_dir, "summary.json"), summary,
               "the final model is saved, but without summary.json the folder does not look finished: free some space "
               "and write it again by rerunning with --resume.")
    if parallel.is_main():
        release_output_dir()
    if summary.get("diverged"):  # saved, but not a success (tracking.divergence)
        basics.fail(f"{summary['diverged']} The model is saved in {args.output_dir}; its summary.json says \"diverged\".")


def check_output_dir(args):
    """Before anything loads: --model must not lie inside --output_dir (any depth, any link) unless
    the run resumes there, a folder that holds another run's model, adapters or checkpoints needs
    --resume or --overwrite_output_dir, and the folder must be writable (or creatable) with room
    for the model. All checked now, not after the models have loaded; nothing is written yet."""
    resuming = args.resume or args.resume_from_checkpoint
    model = getattr(args, "model", "")
    if model and os.path.exists(model) and is_inside(model, args.output_dir) and not resuming:
        where = ("is the --model folder" if os.path.realpath(model) == os.path.realpath(args.output_dir)
                 else f"holds the --model folder {model}")
        basics.fail(f"--output_dir {args.output_dir} {where}: the run would overwrite (or with --overwrite_output_dir "
                    "delete) the model it starts from; pass another --output_dir (or --resume to continue that run).")
    if args.estimate_memory:
        return
    if os.path.islink(args.output_dir) and not os.path.exists(args.output_dir):  # makedirs cannot create it
        basics.fail(f"--output_dir {args.output_dir} is a link to {os.readlink(args.output_dir)}, which does not exist; "
                    "create that folder, remove the link, or pass another --output_dir.")
    if not (resuming or args.overwrite_output_dir) and (held := run_outputs(args.output_dir)):
        basics.fail(f"--output_dir {args.output_dir} holds another run's {describe_outputs(held)} ({', '.join(held[:4])}); "
                    "pass --resume to continue that run, --overwrite_output_dir to replace it, or another --output_dir.")
    if not _is_rank0():
        return
    existing = os.path.abspath(args.output_dir)  # the folder, or the nearest folder above it that exists
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "is not writable"
        basics.fail(f"cannot write {args.output_dir} ({existing} {why}); nothing was written: pass a --output_dir "
                    "on a writable disk.")
    saves_model = not getattr(args, "use_peft", False) or getattr(args, "merge_adapters", True)
    need = _model_bytes(model) if saves_model and not args.overwrite_output_dir else 0  # overwriting frees room
    free = shutil.disk_usage(existing).free
    if need > free:
        basics.fail(f"--output_dir {args.output_dir} has {free / 1e6:.1f} MB free, and saving a model the size of "
                    f"--model {args.model} needs {need / 1e6:.1f} MB; free some space or pass another --output_dir.")


def _model_bytes(model):
    """The bytes of a local model folder's weights (0 for a Hub id): the least a final save writes."""
    from glob import glob

    if not model or not os.path.isdir(model):
        return 0
    return sum(os.path.getsize(f) for f in glob(os.path.join(model, "*.safetensors")))


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
            if (bad := basics.nonfinite_tensor(tensors)) is not None:
                basics.fail(f"the weight {prefix}{bad} holds NaN/inf; not saving {folder}. The checkpoints saved so far are "
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
    from safetensors import SafetensorError  # what save_pretrained's safetensors writer raises on a full disk

    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if os.environ.get("RLHF_TEST_CRASH_WHILE_SAVING") == os.path.basename(folder.rstrip("/")):
            os.kill(os.getpid(), 9)  # test hook (tests/test_resume.py): SIGKILL with this checkpoint half-written
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        with open(os.path.join(tmp, "input_hashes.json"), "w") as f:  # what --resume checks the files against
            json.dump(run_input_hashes(args), f, indent=2)
        if state is not None:
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        share_like_the_others(tmp)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, a read-only folder (torch.save: RuntimeError)
        free = shutil.disk_usage(os.path.dirname(tmp) or ".").free  # before the half-written copy goes
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(e, "strerror", None) or (f"the disk is full: {free} bytes free" if free < 1 << 20 else basics.brief(e, 200))
        basics.fail(f"cannot write {folder} ({reason}); the half-written copy was removed and {kept(args.output_dir)}")
    old = folder.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def share_like_the_others(folder):
    """Give a saved folder's files the mode every other file of a run gets, 0666 less the umask
    (0644 under the usual 022): the weights come 0600 out of save_pretrained (written as a private
    temporary file, then renamed), so another user of the machine could read the run's
    metrics but not its model."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):
        if os.path.isfile(os.path.join(folder, name)):
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def kept(output_dir):
    """What of a run is intact after a failed write, for error messages."""
    found = [os.path.basename(c) for c in checkpoints(output_dir)]
    if found:
        return (f"the checkpoints saved so far are intact ({', '.join(found[-3:])}): free some space and rerun "
                "with --resume to continue from the last one.")
    return "no checkpoint had been saved: free some space (or pass another --output_dir) and run again."


def save_final(model, tokenizer, args):
    """The final model in <output_dir>/ (where metrics.jsonl and checkpoints also live): saved
    to a temporary folder, then moved in file by file with config.json last, so a crash never
    leaves a loadable half-model.

    With --use_peft: the adapters go to <output_dir>/adapter/ (small, to share or to resume
    from), and with --merge_adapters (the default) the merged model to <output_dir>/, so every
    consumer of a run's output (eval.py, the next stage's --model, vLLM, lm-eval) reads a plain
    transformers model there, as after full fine-tuning."""
    out = args.output_dir
    if lora.is_peft(model):
        save_checkpoint(model, tokenizer, args, os.path.join(out, "adapter"))
        if not args.merge_adapters:
            return
        model = lora.merged_model(model, args) if parallel.is_main() else model
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


def saved_where(args):
    """Where the final save put the model, for a run's last line: with --use_peft the adapters'
    folder too (<output_dir>/adapter/), and whether <output_dir>/ holds the merged model."""
    if not getattr(args, "use_peft", False):
        return f"saved to {args.output_dir}"
    adapter = os.path.join(args.output_dir, "adapter")
    if not args.merge_adapters:
        return f"saved the LoRA adapters to {adapter}/ (no merged model: --no_merge_adapters)"
    return f"saved the merged model to {args.output_dir} and the LoRA adapters to {adapter}/"


def write_json(path, obj, kept_note="what was written before it is intact."):
    """Write JSON atomically (temporary file, then rename); under torchrun, rank 0 only. A full or
    read-only disk ends in one sentence naming the file and `kept_note`."""
    if not parallel.is_main():
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(basics.finite_json(obj), f, indent=2, allow_nan=False)  # NaN / inf as null
        os.replace(path + ".tmp", path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        basics.fail(f"cannot write {path} ({e.strerror or e}); {kept_note}")


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
            basics.fail(f"{path} cannot be read ({type(e).__name__}: {e}).{_earlier_checkpoints(folder)}")
    if not loaded:
        basics.fail(f"{folder} holds no *.safetensors weights; pass a checkpoint folder written by --save_steps.")
    if (bad := basics.nonfinite_tensor(loaded)) is not None:
        basics.fail(f"{folder}: the weight {bad} holds NaN/inf; refusing to resume from it.{_earlier_checkpoints(folder)}")
    if lora.is_peft(model):  # adapters (and a trained score head), saved under peft's names
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, loaded)
        if result.unexpected_keys or not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            basics.fail(f"{folder} does not hold this run's adapters; resume with the same --model, --use_peft and "
                 "--lora_* flags as the run that wrote it.")
        return
    copy_weights(model, loaded, folder)


def copy_weights(model, loaded, source):
    """Copy a {name: full tensor} state dict into `model` in place (FSDP2 shards included)."""
    from torch.distributed.tensor import distribute_tensor

    params = model.state_dict()
    unexpected = sorted(set(loaded) - set(params))
    if unexpected:
        basics.fail(f"{source} does not match this model (unexpected weights {', '.join(unexpected[:3])}); "
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
            **{name: adapter_state(obj) if lora.is_peft(obj) else parallel.full_state_dict(obj)
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
               "learning_rate", "max_grad_norm", "log_completions", "num_completions_to_print"}


MODEL_FILES = (".safetensors", ".bin", ".json", ".model", ".jinja", ".txt")  # what from_pretrained reads of a folder
IMPORTS = "imports"  # input_hashes' key of the modules user files imported (basics.USER_IMPORTS)


def fingerprint(path, skip=()):
    """sha256 of a file's content; of a folder, of what a model or dataset load reads there: its
    model files (config, weights, tokenizer) and, in any subfolder, its data files, by name and
    content (hidden files, a run folder's checkpoints' weights and the folders `skip` (real paths:
    this run's output, whose logs grow) left out). None: neither."""
    import hashlib

    if os.path.isfile(path):
        return basics.file_sha256(path)
    if not os.path.isdir(path):
        return None
    digest = hashlib.sha256(b"folder\0")
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) not in skip)
        for name in sorted(names):
            file = os.path.join(root, name)
            top = root == path
            if name.startswith(".") or not os.path.isfile(file) or not name.endswith(data.DATA_FILES + (MODEL_FILES if top else ())):
                continue
            digest.update(os.path.relpath(file, path).encode() + b"\0" + basics.file_sha256(file).encode())
    return digest.hexdigest()


def _own_output(args):
    """The run's own output folder, as fingerprint's `skip`: a --model folder may hold it."""
    out = getattr(args, "output_dir", None)
    return (os.path.realpath(out),) if isinstance(out, str) and out else ()


def input_hashes(args):
    """{flag: {path: sha256}} of the files and folders the run's flags name (a --dataset file or
    folder, the --model and --reward_model folders, the file.py of a --reward_fn or --tools, ...;
    `fingerprint`), and under IMPORTS the project-external modules those .py files imported: a
    resume refuses inputs whose content changed since the checkpoint (check_input_files), as it
    refuses a changed flag."""
    hashes, skip = {}, _own_output(args)
    for flag, value in sorted(vars(args).items()):
        if flag in RESUME_FREE or not isinstance(value, str):
            continue
        for part in value.split(","):
            path = part if os.path.exists(part) else part.rpartition(":")[0]  # file.py:function names file.py
            if not path or not (os.path.isfile(path) or os.path.isdir(path)):
                continue
            hashes.setdefault(flag, {})[path] = fingerprint(path, skip)
    imported = {path: fingerprint(path) for path in sorted(basics.USER_IMPORTS) if os.path.isfile(path)}
    if imported:
        hashes[IMPORTS] = imported
    return hashes


_RUN_INPUTS = {"args": None, "hashes": None}  # run_input_hashes' one reading per run


def run_input_hashes(args):
    """input_hashes of this run, read once when its inputs were loaded (maybe_resume, before step
    1) and recorded by every checkpoint: a file edited mid-run is then one a resume refuses, and a
    large --model folder is read once, by rank 0 alone (the ranks' inputs are the same)."""
    if _RUN_INPUTS["args"] is not args:
        _RUN_INPUTS.update(args=args, hashes=input_hashes(args) if parallel.is_main() else {})
    return _RUN_INPUTS["hashes"]


def check_input_files(args, folder):
    """Refuse a resume when a file or folder the flags name, or a module a --reward_fn or --tools
    file imported (input_hashes), changed content since `folder` was saved (a reward function or its
    helper edited mid-run, a dataset rewritten, the --model weights replaced), unless
    --resume_allow_changes."""
    path = os.path.join(folder, "input_hashes.json")
    if not parallel.is_main() or not os.path.isfile(path):  # rank 0 checks for all (no hashes: an older checkpoint)
        return
    try:
        with open(path) as f:
            saved = json.load(f)
        if not (isinstance(saved, dict) and all(isinstance(v, dict) for v in saved.values())):
            raise ValueError("not a JSON object of {flag: {path: sha256}}")
    except (OSError, ValueError) as e:
        basics.fail(f"{path} cannot be read ({e}).{_earlier_checkpoints(folder)}")
    skip = _own_output(args)
    changed = [(flag, file) for flag, files in saved.items() for file, digest in files.items()
               if fingerprint(file, skip) != digest]
    for flag, file in changed:
        what = "the folder" if os.path.isdir(file) else "the file"
        source = "a module a --reward_fn or --tools file imported" if flag == IMPORTS else f"--{flag}"
        if not getattr(args, "resume_allow_changes", False):
            basics.fail(f"{file} ({source}) is not {what} {folder} was trained with (its content "
                        f"{'changed' if os.path.exists(file) else 'is gone'}); the resumed run would not end where the "
                        "interrupted one would. Restore it, or add --resume_allow_changes to continue anyway.")
        print(f"resume: {file} ({source}) changed since {folder} was saved (--resume_allow_changes).")


def check_resume_args(args, folder, step):
    """Refuse a resume whose arguments differ from the checkpoint's args.json in a way that breaks
    "ends where an uninterrupted run ends" (data, batch sizes, seed, model, rewards, optimizer,
    algorithm), naming the flag and both values, unless --resume_allow_changes."""
    path = os.path.join(folder, "args.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        basics.fail(f"{path} cannot be read ({e}).{_earlier_checkpoints(folder)}")
    if args.max_steps < step:
        basics.fail(f"--max_steps {args.max_steps} is below the step of {folder} ({step}): pass --max_steps >= {step}, "
             "or take the checkpoint as it is (eval.py reads it).")
    ours = vars(args)
    if set(saved) - set(ours) and not getattr(args, "resume_allow_changes", False):
        basics.fail(f"{folder} was written by another script (its args.json has {', '.join(sorted(set(saved) - set(ours))[:3])}, "
             f"which {basics.script_name()}.py has not); resume it with that script.")
    changed = [k for k in ours if k in saved and k not in RESUME_FREE and saved[k] != ours[k]]
    if changed and not getattr(args, "resume_allow_changes", False):
        k = changed[0]
        basics.fail(f"--{k} {ours[k]!r} differs from the {saved[k]!r} that {folder} was trained with"
             + (f" (also: {', '.join('--' + c for c in changed[1:])})" if changed[1:] else "")
             + "; the resumed run would not end where the interrupted one would. Pass the same value, or add "
             "--resume_allow_changes to continue anyway.")
    for k in changed:
        print(f"resume: --{k} {ours[k]!r} replaces {saved[k]!r} (--resume_allow_changes).")
    check_input_files(args, folder)
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

    run_input_hashes(args)  # the inputs as this run loaded them, before any step (checkpoints record these)
    folder = args.resume_from_checkpoint or (last_checkpoint(args.output_dir) if args.resume else "")
    if not folder:
        if args.resume:
            print(f"resume: no checkpoint in {args.output_dir} yet; starting from step 0.")
        return 0
    try:
        state = torch.load(os.path.join(folder, "trainer_state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torn/corrupt (a malicious pickle is refused by weights_only too)
        basics.fail(f"{folder}/trainer_state.pt cannot be read ({type(e).__name__}: {basics.brief(e, 200)}).{_earlier_checkpoints(folder)}")
    missing = [k for k in ("step", "optimizer", "scheduler", "rng") if not isinstance(state, dict) or k not in state]
    if missing:
        basics.fail(f"{folder}/trainer_state.pt has no {', '.join(missing)} (not written by save_checkpoint, or edited)."
                    f"{_earlier_checkpoints(folder)}")
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
        if lora.is_peft(obj):
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
        basics.set_seed(args.seed + parallel.rank() + state["step"])
    print(f"resume: continuing from {folder} at step {state['step']}.")
    abandon_newer_checkpoints(args.output_dir, state["step"])
    return state["step"]


def abandon_newer_checkpoints(output_dir, step):
    """Resumed from an older checkpoint (--resume_from_checkpoint): the abandoned run's newer
    checkpoints in --output_dir are renamed checkpoint-<step>.abandoned, kept but never resumed
    from, so a later --resume continues this run, not the abandoned one."""
    if not parallel.is_main():
        return
    for newer in [c for c in checkpoints(output_dir) if int(c.rsplit("-", 1)[1]) > step]:
        shutil.rmtree(newer + ".abandoned", ignore_errors=True)
        with writing(newer, "nothing else was changed."):
            os.replace(newer, newer + ".abandoned")
        print(f"resume: {newer} belongs to the abandoned run: renamed {os.path.basename(newer)}.abandoned "
              "(kept; --resume ignores it).")
