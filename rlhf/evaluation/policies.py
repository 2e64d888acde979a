"""policies.py: the policies eval.py compares, and their responses.

Read by whoever changes which folders eval.py evaluates or when it generates again: the command
line's methods and runs (NAME=PATTERN globs of run folders, names made unique), and each policy's
responses, generated once and cached under a key of its weights' content, the prompts and every
generation setting. The statistics and the judges stay in eval.py.
"""

import collections
import functools
import glob
import hashlib
import json
import os
import re

from rlhf import checkpoints
from rlhf import basics
from rlhf import models
from rlhf import data
from rlhf import lora
from rlhf import real_model
from rlhf import sampling
from rlhf import vllm_rollouts

REFERENCE = "reference"  # name of the dataset's references when they take part in comparisons


def policy_names(paths):
    """Each policy's name: its folder's basename, with as many parent folders as make it unique
    (runs/a/checkpoint-100 vs runs/b/checkpoint-100), then numbered if still equal (the same path twice)."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    names = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(q != p and q[-depth:] == p[-depth:] for q in parts):
            depth += 1
        names.append("/".join(p[-depth:]))
    taken, out = {REFERENCE}, []
    for name in names:
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}-{n}"
        taken.add(unique)
        out.append(unique)
    return out


def parse_methods(specs):
    """The command line's policies as methods [(name, [run paths])].

    NAME=PATTERN[,PATTERN...] is a method whose runs are the folders matching the glob patterns
    (sorted; a pattern without wildcards is one folder or Hub id); a bare folder or Hub id is a
    method of one run, named as policy_names names it."""
    bare = iter(policy_names([s for s in specs if "=" not in s]))
    methods = []
    for spec in specs:
        if "=" not in spec:
            methods.append((next(bare), [real_model.gguf_folder(spec) if spec.endswith(".gguf") else spec]))
            continue
        name, _, patterns = spec.partition("=")
        if not name or not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
            basics.fail(f"{spec!r}: a method's name (before '=') must be letters, digits and . _ + - (e.g. grpo=runs/seed*/grpo).")
        paths = []
        for pattern in patterns.split(","):
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            # a pattern's runs are model folders (config.json, or a LoRA run's adapter_config.json), not the
            # log files or other folders beside them
            found = [m for m in matches if not glob.has_magic(pattern) or is_model_folder(m)]
            if not found:
                basics.fail(f"{spec!r}: {pattern!r} matches no model folder (a folder with config.json)"
                            + (f"; it matches only {', '.join(matches[:3])}{' ...' if len(matches) > 3 else ''}" if matches
                               else "") + "; check the path (and quote the argument, so the shell leaves the pattern "
                            "to eval.py).")
            if len(found) < len(matches):
                skipped = [m for m in matches if m not in found]
                print(f"eval: note: {pattern!r} also matches {len(skipped)} path(s) that are not model folders, left out "
                      f"(e.g. {skipped[0]}).")
            paths += [real_model.gguf_folder(m) if m.endswith(".gguf") else m for m in found]
        methods.append((name, paths))
    names = [name for name, _ in methods]
    for name in names:
        if names.count(name) > 1 or name == REFERENCE:
            basics.fail(f"two methods are named {name!r} (or it is {REFERENCE!r}, the dataset's references): "
                        "rename one with NAME=PATH.")
    return methods


def is_model_folder(path):
    """A folder a policy loads from: config.json (a full or merged model) or adapter_config.json."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json"))


def run_names(methods):
    """A unique name for every run: the method's name for a method of one run, else
    method/<folder>, e.g. grpo/seed0."""
    return [[name] if len(paths) == 1 else [f"{name}/{p}" for p in policy_names(paths)] for name, paths in methods]


@functools.lru_cache(maxsize=None)
def weights_fingerprint(path):
    """What identifies a policy's weights: a SHA-256 of the content of the folder's model files
    (weights swapped in place with the same size and mtime still change it), computed once per
    policy and run; for a Hub id, the commit of its cached snapshot. An adapter folder's includes
    its base's (lora.adapter_base, recursively): the adapters alone do not make the policy."""
    if os.path.isdir(path):
        digest = hashlib.sha256()
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            digest.update(weights_fingerprint(lora.adapter_base(path)).encode())
        for f in sorted(os.listdir(path)):
            if f.endswith((".safetensors", ".json", ".jinja", ".model")) and os.path.isfile(os.path.join(path, f)):
                digest.update(f.encode() + b"\0")
                with open(os.path.join(path, f), "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 24), b""):
                        digest.update(block)
        return digest.hexdigest()
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(path, "config.json")
    return os.path.basename(os.path.dirname(found)) if isinstance(found, str) else "not cached"


def generation_settings(args):
    """Everything besides the policy and the prompts that can change a generation."""
    return {"max_completion_length": args.max_completion_length, "do_sample": args.do_sample,
            "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            "eval_batch_size": args.eval_batch_size, "dtype": args.dtype, "attn_implementation": args.attn_implementation,
            **({"use_vllm": True, "vllm_dtype": args.vllm_dtype} if args.use_vllm else {})}  # vLLM draws other samples


def policy_key(path, args):
    """What identifies a policy's generations besides the prompts: its path, its weights' content
    and every generation setting."""
    return [os.path.abspath(path) if os.path.isdir(path) else path, weights_fingerprint(path), generation_settings(args)]


def cache_file(path, prompts, args):
    where, weights, settings = policy_key(path, args)
    key = json.dumps([where, weights, prompts, settings])  # as before the subset lookup: old caches still match
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(args.cache_dir, f"{readable_name(path)}-{digest}.json")


def readable_name(path):
    return re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(os.path.normpath(path)))


def _read_cache(file):
    """A cache file's content, or None when it cannot be read (torn, not JSON, not a cache): then
    it is named, moved aside to FILE.unreadable and the responses are generated again."""
    try:
        with open(file, encoding="utf-8") as f:
            out = json.load(f)
        lists = ("prompts", "responses", "truncated") + (("completion_ids",) if "completion_ids" in out else ())
        if not (isinstance(out, dict) and all(isinstance(out.get(k), list) and len(out[k]) == len(out["prompts"])
                                              for k in lists)):
            raise ValueError("it does not hold lists of prompts, responses and truncated flags of one length")
        return out
    except (OSError, UnicodeDecodeError, ValueError) as e:
        try:
            os.replace(file, file + ".unreadable")
            aside = f"it was moved to {file}.unreadable"
        except OSError as moving:
            aside = f"it could not be moved aside ({moving.strerror})"
        print(f"eval: the generation cache file {file} cannot be read ({str(e)[:120]}); {aside} and these responses "
              "are generated again.")
        return None


COLUMNS = ("responses", "truncated", "completion_ids")  # a cache file's per-prompt lists


def cached_rows(path, prompts, args):
    """(file, rows) from the cache: rows[i] the cached row answering prompts[i], or None where no
    cached row does. The file of exactly these prompts answers all; otherwise the file of this
    policy and these settings that answers most of them (--num_prompts 10 after a run on 30 reuses
    the first 10; a run on 523 after one on 300 generates only the other 223; with --do_sample, the
    samples drawn then, which another number of prompts would have drawn differently: every one is
    still a sample of this policy at these settings). A prompt asked k times (--num_samples k) takes
    the first k of its cached samples, never one sample k times. (None, [None, ...]) without a file."""
    exact = cache_file(path, prompts, args)
    key = json.loads(json.dumps(policy_key(path, args)))  # as a file stores it (tuples become lists)
    candidates = [exact] + sorted(glob.glob(os.path.join(glob.escape(args.cache_dir), f"{readable_name(path)}-*.json")))
    best = (None, [None] * len(prompts))
    for file in candidates:
        if not os.path.isfile(file):
            continue
        out = _read_cache(file)
        if out is None or "completion_ids" not in out:  # a cache from before completion_ids were kept is generated again
            continue
        if file == exact:
            return file, [tuple(out[k][i] for k in COLUMNS) for i in range(len(prompts))]
        if out.get("key") != key:
            continue
        cached = collections.defaultdict(list)  # a prompt's rows in the cached set, in order
        for i, p in enumerate(out["prompts"]):
            cached[p].append(i)
        taken = collections.Counter()  # the j-th ask of a prompt takes its j-th cached row
        rows = []
        for p in prompts:
            j = cached[p][taken[p]] if taken[p] < len(cached[p]) else None
            taken[p] += 1
            rows.append(None if j is None else tuple(out[k][j] for k in COLUMNS))
        if sum(r is not None for r in rows) > sum(r is not None for r in best[1]):
            best = (file, rows)
    return best


def cached_generations(path, prompts, args):
    """(file, responses, truncated, completion_ids) when the cache answers every prompt (cached_rows), else None."""
    file, rows = cached_rows(path, prompts, args)
    if file is None or any(r is None for r in rows):
        return None
    return file, *(list(column) for column in zip(*rows))


def generate_responses(path, name, raw_prompts, args):
    """The policy's responses to every prompt (from the cache when this run, or one on more
    prompts, was done)."""
    tokenizer = models.load_tokenizer(path, args.trust_remote_code)
    prompts = [data.render_prompt(tokenizer, p) for p in raw_prompts]
    data.check_readable(tokenizer, prompts, path, args.dataset)
    file, rows = cached_rows(path, prompts, args)
    todo = [i for i, r in enumerate(rows) if r is None]
    if not todo:
        print(f"eval: {name}: {len(prompts)} responses from the cache {file}")
        return tuple(list(column) for column in zip(*rows))
    if file is not None:
        print(f"eval: {name}: {len(prompts) - len(todo)} of {len(prompts)} responses from the cache {file}; "
              f"generating the other {len(todo)}")
    new = generate_new(path, name, tokenizer, [prompts[i] for i in todo], args)
    for i, row in zip(todo, zip(*new)):
        rows[i] = row
    responses, truncated, completion_ids = (list(column) for column in zip(*rows))
    cached = cache_file(path, prompts, args)  # a Hub model's snapshot is known now that it is loaded
    checkpoints.write_json(cached, {"policy": path, "settings": generation_settings(args), "key": policy_key(path, args),
                                    "prompts": prompts, "responses": responses, "truncated": truncated,
                                    "completion_ids": completion_ids})
    print(f"eval: {name}: generated {len(todo)} responses (all {len(prompts)} cached in {cached})")
    return responses, truncated, completion_ids


def generate_new(path, name, tokenizer, prompts, args):
    """The policy's responses to the rendered `prompts`, from its weights: (responses, truncated, completion_ids)."""
    model = basics.freeze(models.load_model(path, args))
    basics.set_seed(args.seed)  # every policy samples from the same seed
    settings = dict(do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.use_vllm:  # an engine for this policy (vllm_rollouts.py); every prompt its own request, seeded by --seed
        longest = data.encode_prompts(tokenizer, prompts)[0].shape[1]
        llm = vllm_rollouts.start_engine(model, tokenizer, args, longest + args.max_completion_length)
        responses, truncated, completion_ids = vllm_rollouts.sample_texts(llm, model, tokenizer, prompts,
                                                                          args.max_completion_length, args.seed, **settings)
        vllm_rollouts.shutdown(llm)
    else:
        responses, truncated, completion_ids = sampling.sample_texts(model, tokenizer, prompts, args.max_completion_length,
                                                                     args.eval_batch_size, desc=f"eval: {name}", **settings)
    del model
    return responses, truncated, completion_ids
