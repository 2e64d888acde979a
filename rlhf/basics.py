"""The ground floor: what every module needs and nothing else. Errors, seeds, devices and dtypes,
the script's name, the embedded worlds' names and datasets, and two small tensor guards.

It imports nothing of the project but the worlds, which import nothing above them, so every module
may import it. The README's file table lists the floors (ground, plumbing, kit, scripts): a file
imports only files on its own floor or below, with no loop; tests/test_imports.py checks both.
"""

import contextlib
import math
import os
import random
import sys

import torch

from worlds import world
from worlds import world_arith
from worlds import world_code
from worlds import world_ifeval

# ============================================================================ names
EMBEDDED = "embedded"  # --dataset value (and the default) that selects the embedded world
ARITH = world_arith.SPEC  # --dataset embedded:arith[:LEVELS] selects the arithmetic world (world_arith.py)
ARITH_TOOLS = world_arith.TOOLS_SPEC  # --dataset embedded:arith_tools: the arithmetic world with a calculator tool
CODE = world_code.SPEC  # --dataset embedded:code selects the code world (world_code.py)
IFEVAL = world_ifeval.SPEC  # --dataset embedded:ifeval selects the instruction-following world (world_ifeval.py)
CHAT_TEMPLATE_KWARGS = {}  # --chat_template_kwargs, set by parse_args, passed wherever a chat template renders
SR_BUCKET_NUMEL = 2**26  # parameters per fp32 bucket in common.optimizer_step and parallel's all-reduce (256 MB of fp32 weights)


# ============================================================================ errors, seeds, the script
# files a user may type that moved into worlds/ or rlhf/ (the front-door reorganisation): a path
# that no longer exists gets one sentence naming the new one
MOVED = {f"{m}.py": f"worlds/{m}.py" for m in ("world", "world_arith", "world_code", "scratch", "calculator")}
MOVED.update({f"{m}.py": f"rlhf/{m}.py" for m in (
    "basics", "checkpoints", "data", "lora", "memory", "parallel", "policies", "reports", "reward_contract",
    "sampling", "sandbox", "tools", "tracking", "vllm_rollouts")})


def moved(path):
    """' (it moved to NEW)' where `path` is a file that moved out of the root, else ''."""
    new = MOVED.get(os.path.normpath(path))
    return f" (it moved to {new})" if new and os.path.isfile(new) else ""


# the files of the modules that loading a user's .py file (--reward_fn, --tools) imported from
# outside the standard library, the installed packages and this project: a resume checks them too
USER_IMPORTS = set()
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exec_user_file(module_spec, module):
    """module_spec.loader.exec_module(module), noting in USER_IMPORTS the project-external modules
    it imported (a helper module next to a reward file can change the rewards as the file can)."""
    with noting_user_imports():
        module_spec.loader.exec_module(module)


@contextlib.contextmanager
def noting_user_imports():
    """Note in USER_IMPORTS the project-external modules imported inside (not installed packages,
    not the standard library, not the project's own): what a resume checks besides the flags' files."""
    import sysconfig

    before = set(sys.modules)
    try:
        yield
    finally:
        installed = {os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        ours = {os.path.join(_ROOT, "rlhf") + os.sep, os.path.join(_ROOT, "worlds") + os.sep}
        for name in set(sys.modules) - before:
            file = getattr(sys.modules.get(name), "__file__", None)
            if not isinstance(file, str) or not file.endswith(".py"):
                continue
            real = os.path.realpath(file)
            if not real.startswith(tuple(installed | ours)) and os.path.dirname(real) != _ROOT and "site-packages" not in real:
                USER_IMPORTS.add(real)


def fail(message):
    """Stop the run with a message a person can act on (no traceback for user errors)."""
    sys.exit(f"error: {message}")


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def script_name():
    """The running script's name without .py: a fork (my_grpo.py) gets its own runs/my_grpo."""
    return os.path.splitext(os.path.basename(sys.argv[0]))[0]


def check_hub_id(name, kind):
    """A name that is no local path must be a Hub repo, cached or reachable: say so before anything loads."""
    from huggingface_hub import try_to_load_from_cache

    if kind == "model" and isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    from huggingface_hub import HfApi

    try:
        (HfApi().model_info if kind == "model" else HfApi().dataset_info)(name, timeout=10)
    except Exception as e:  # noqa: BLE001 -- offline, unknown repo, gated: one sentence either way
        fail(f"{name} is not a local {'folder' if kind == 'model' else 'file or folder'} and the Hugging Face Hub "
             f"cannot provide it ({type(e).__name__}: {brief(e)}); check the path (relative to {os.getcwd()}), "
             "or download it while online.")


# ============================================================================ devices and dtypes
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_dtype(name):
    """bf16 on CUDA and fp32 on CPU unless told otherwise."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def free_memory_bytes():
    """Memory this machine can still give a process: Linux's MemAvailable (free memory plus the page
    cache it can drop), else the free pages; 0 where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def freeze(model):
    """A frozen copy in eval mode: no grads, dropout off."""
    model.eval()
    model.requires_grad_(False)
    return model


def nonfinite_tensor(tensors):
    """The name of the first tensor of a {name: tensor} dict that holds NaN or inf, else None."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


# ============================================================================ the embedded worlds
_WORLD_CACHE = {}


def brief(error, limit=300):
    """An exception's text for a one-sentence error: on one line, and when longer than `limit`
    characters cut at a word boundary with " ..." (a cut mid-word read as a typo)."""
    text = " ".join(str(error).split())
    if len(text) <= limit:
        return text
    return text[:limit + 1].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


def finite_json(obj):
    """`obj` with every NaN and +-inf float as None, for json.dump: JSON has no NaN (Python writes a
    bare NaN that JSON.parse and jq reject; null is JSON's "no number"). Dicts, lists and tuples
    are walked; numpy's float64 is a float."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def embedded_world(seed=0):
    """The world's datasets (built once per process; deterministic in the seed)."""
    if seed not in _WORLD_CACHE:
        _WORLD_CACHE[seed] = world.build_world(seed)
    return _WORLD_CACHE[seed]


def arith_split(spec, split, seed=0):
    """A split of the arithmetic world named by --dataset embedded:arith[:LEVELS] (sft, rl, test, or
    prefs: the demonstrator's preference pairs), or of the world with a calculator tool,
    embedded:arith_tools (no prefs) (built once per process)."""
    try:
        levels = (1,) if spec == ARITH_TOOLS else world_arith.parse_spec(spec)
    except ValueError as e:
        fail(str(e))
    if levels is None:
        fail(f"--dataset {spec}: the arithmetic world is {ARITH}, {ARITH}:2 (three-number chains), {ARITH}:3 "
             f"(four), {ARITH}:1,2 (several levels) or {ARITH_TOOLS} (with a calculator tool).")
    splits = ("sft", "rl", "test") if spec == ARITH_TOOLS else ("sft", "prefs", "rl", "test")
    if split not in splits:
        fail(f"--dataset {spec}: the arithmetic world has no {split!r} split (only {', '.join(splits)})"
             + (f"; its preference pairs (prefs) are {ARITH}'s, without the calculator." if split == "prefs" else "."))
    if (spec, seed) not in _WORLD_CACHE:
        _WORLD_CACHE[spec, seed] = world_arith.build_world(seed, levels, tools=spec == ARITH_TOOLS)
    return _WORLD_CACHE[spec, seed][split]


def code_split(split, seed=0):
    """A split of the code world, --dataset embedded:code (built once per process)."""
    if split not in ("sft", "rl", "test"):
        fail(f"--dataset {CODE}: the code world has no {split!r} split (only sft, rl, test): it is a world "
             "for SFT and RL with an execution verifier, not for preference pairs.")
    if (CODE, seed) not in _WORLD_CACHE:
        _WORLD_CACHE[CODE, seed] = world_code.build_world(seed)
    return _WORLD_CACHE[CODE, seed][split]


def ifeval_split(split, seed=0):
    """A split of the instruction-following world, --dataset embedded:ifeval (built once per process)."""
    if split not in ("rl", "test"):
        fail(f"--dataset {IFEVAL}: the instruction-following world has no {split!r} split (only rl, test): it is a "
             "world for RL with verifiers; build DPO pairs from a policy's own samples (python -m worlds.world_ifeval pairs).")
    if (IFEVAL, seed) not in _WORLD_CACHE:
        _WORLD_CACHE[IFEVAL, seed] = world_ifeval.build_world(seed)
    return _WORLD_CACHE[IFEVAL, seed][split]


def passed(name):
    """Whether --name (or --name=..., --name-with-dashes) is on the command line."""
    return any(a.startswith("--") and a[2:].split("=")[0].replace("-", "_") == name for a in sys.argv[1:])


_HASHES = {}  # (real path, size, mtime) -> sha256: a file is read once per process while it is unchanged


def file_sha256(path):
    """The SHA-256 of a file's content, read once per process while its size and mtime stay."""
    import hashlib

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]
