"""TRL's reward-function contract: what `--reward_fn` loads (a file's function, or the embedded
worlds' verifiers by name), how every function is called (by keyword, as TRL's GRPOTrainer calls
it, async ones awaited together), what it may return (finite numbers, or None where it does not
apply), and the weighted sum over the functions that apply. grpo.py, ppo.py, `dpo.py --online`
and eval.py call it through common.py; a reward that raises or returns something else stops the
run with the prompt and completion that caused it.
"""

import asyncio
import collections.abc
import importlib.util
import inspect
import math
import os
import re
import types

import torch

from rlhf import humaneval
from rlhf import sandbox
from worlds import world
from worlds import world_arith
from worlds import world_ifeval
from worlds import reasoning_gym_tasks
from rlhf.basics import exec_user_file, fail, moved, noting_user_imports, script_name


def load_reward_fn(spec):
    """`file.py:function` or a module's `package.module:function` / `package.module.function` (TRL's
    CLI form: `trl.rewards:accuracy_reward`) -> the function, called as TRL calls it (call_reward_fns: by keyword,
    fn(prompts=, completions=, completion_ids=, **columns, ...) -> floats or None); `gold` -> the embedded world's gold judge; `arith_strict`,
    `arith_lenient` -> the arithmetic world's verifiers; `exec_tests`, `exec_tests_strict` -> the
    execution verifiers (sandbox.py: the completion's code against the `tests` column); `ifeval_strict`,
    `ifeval_<family>` -> the instruction-following world's verifiers (world_ifeval.py); `reasoning_gym`,
    `reasoning_gym_strict` -> a Reasoning Gym task's own score_answer on the row's `entry`
    (reasoning_gym_tasks.py); `humaneval` -> a HumanEval problem's own tests (humaneval.py)."""
    if spec == "gold":
        return world.gold_reward
    if spec in world_arith.VERIFIERS:
        return world_arith.VERIFIERS[spec]
    if spec in sandbox.VERIFIERS:
        return sandbox.VERIFIERS[spec]
    if spec in world_ifeval.VERIFIERS:
        return world_ifeval.VERIFIERS[spec]
    if spec in humaneval.VERIFIERS:
        return humaneval.VERIFIERS[spec]
    if spec in reasoning_gym_tasks.VERIFIERS:
        return reasoning_gym_tasks.VERIFIERS[spec]
    if is_module_spec(spec):
        return load_module_fn(spec)
    path, _, name = spec.rpartition(":")
    if not path or not name:
        fail(f"--reward_fn {spec!r}: expected file.py:function, a module's function (package.module:function or "
             f"package.module.function) or one of gold, {', '.join([*world_arith.VERIFIERS, *sandbox.VERIFIERS, 'ifeval_strict', 'ifeval_<family>', *reasoning_gym_tasks.VERIFIERS, *humaneval.VERIFIERS])}.")
    if not os.path.isfile(path):
        fail(f"--reward_fn {spec!r}: file {path} does not exist{moved(path)}.")
    module_spec = importlib.util.spec_from_file_location(f"reward_fn_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:  # the file is executed, as `python file.py` would: only pass files you trust
        exec_user_file(module_spec, module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the user's file: name it and its error
        fail(f"--reward_fn {spec!r}: importing {path} raised {type(e).__name__}: {str(e)[:300]}; fix the file "
             "(it is executed when loaded) and run again.")
    if not callable(getattr(module, name, None)):
        fail(f"--reward_fn {spec!r}: {path} defines no function {name!r}.")
    return getattr(module, name)


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_module_spec(spec):
    """Whether --reward_fn names a function of an importable module, as TRL's CLI takes it:
    `package.module:function` or `package.module.function` (dotted names, no path, no .py file)."""
    module, colon, name = spec.partition(":")
    if colon:
        return bool(_DOTTED.fullmatch(module)) and name.isidentifier() and not module.endswith(".py")
    return "." in spec and bool(_DOTTED.fullmatch(spec)) and not spec.endswith(".py")


def load_module_fn(spec):
    """`package.module:function` or `package.module.function` -> that function, imported as Python
    imports it (the module runs, as any import does: only name modules you trust)."""
    module_name, colon, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        with noting_user_imports():  # a local module (and what it imports) is checked on resume, as a file is
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        fail(f"--reward_fn {spec!r}: no module {e.name!r} can be imported here; install the package that provides "
             f"{module_name} (e.g. pip install trl math-verify for trl.rewards) or pass file.py:function.")
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the module's own error at import: name it
        fail(f"--reward_fn {spec!r}: importing {module_name} raised {type(e).__name__}: {str(e)[:300]}; fix or "
             "install that module and run again.")
    if not callable(getattr(module, name, None)):
        fail(f"--reward_fn {spec!r}: the module {module_name} defines no function {name!r}.")
    return getattr(module, name)


# the verifiers --reward_fn names (no file): pure functions of their arguments, safe to call ahead of time
EMBEDDED_VERIFIERS = (world.gold_reward, *world_arith.VERIFIERS.values(), *sandbox.VERIFIERS.values())
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the largest reward a (N, K) float32 score holds

# what TRL's GRPOTrainer passes besides prompts, completions, completion_ids and the dataset's columns
REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def call_reward_fns(fns, prompts, completions, completion_ids=None, columns=None, group_size=1, step=0,
                    max_steps=0, logs=None, every_row=True):
    """Score N completions with K reward functions, called exactly as TRL's GRPOTrainer calls them:
    by keyword, fn(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=,
    log_metric=), every column a plain list; `async def` functions awaited together (asyncio.gather).
    Returns (N, K) float32, NaN where a function returned None ("not applicable to this sample").
    Rows come in groups of `group_size` completions of one prompt (errors name both). `logs`
    collects log_metric (name -> values) and log_extra (column -> values); `every_row`: stop when
    every function returned None for a completion (grpo.py passes False: TRL leaves it out)."""
    if not fns:  # grpo.py with reward models only
        return torch.zeros(len(prompts), 0)
    columns = {k: list(v) for k, v in (columns or {}).items()}  # a `datasets` Column is not a list
    clash = [k for k in columns if k in REWARD_KWARGS]
    if clash:
        fail(f"the dataset's column {clash[0]!r} has the name of an argument TRL passes to reward functions "
             f"({', '.join(REWARD_KWARGS)}): rename that column.")
    completion_ids = [None] * len(completions) if completion_ids is None else [list(ids) for ids in completion_ids]
    logs = {"metrics": {}, "extra": {}} if logs is None else logs
    names = [getattr(fn, "__name__", str(fn)) for fn in fns]

    def where(i):  # "completion 1 of prompt 0" where a prompt has several completions
        return f"completion {i % group_size} of prompt {i // group_size}" if group_size > 1 else f"prompt {i}"

    def kwargs(rows):  # TRL's keywords for these rows; trainer_state carries what TRL's state says of the step
        return {"prompts": [prompts[i] for i in rows], "completions": [completions[i] for i in rows],
                "completion_ids": [completion_ids[i] for i in rows], **{k: [v[i] for i in rows] for k, v in columns.items()},
                "trainer_state": types.SimpleNamespace(global_step=step, max_steps=max_steps),
                "log_extra": lambda column, values: logs["extra"].setdefault(column, []).extend(values),
                "log_metric": lambda name, value: logs["metrics"].setdefault(name, []).append(value)}

    def run(fn, rows):  # one function on some rows; an async one is run to completion alone
        out = fn(**kwargs(rows))
        return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out

    def culprit(k, batch_error):  # it raised: find the row that makes it raise and stop with it
        for i in range(len(prompts)):
            try:
                run(fns[k], [i])
            except (Exception, SystemExit) as e:  # noqa: BLE001 -- re-raised below with the culprit (sys.exit too)
                fail(f"reward function {names[k]} raised {type(e).__name__}: {e}\n  on {where(i)}: "
                     f"{str(prompts[i])[:300]!r}\n  completion: {str(completions[i])[:300]!r}")
        fail(f"reward function {names[k]} raised {type(batch_error).__name__}: {batch_error} on a batch of "
             f"{len(prompts)} completions (each alone works); first prompt: {str(prompts[0])[:300]!r}")

    # synchronous functions in turn, then the async ones concurrently (TRL: asyncio.gather)
    rows, outputs, pending = list(range(len(prompts))), [None] * len(fns), {}
    for k, fn in enumerate(fns):
        try:
            out = fn(**kwargs(rows))
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- culprit() re-raises with the row
            culprit(k, e)
        if inspect.isawaitable(out):
            pending[k] = out
        else:
            outputs[k] = out
    if pending:
        results = asyncio.run(_gather(list(pending.values())))
        for k, out in zip(pending, results):
            if isinstance(out, BaseException):
                culprit(k, out)
            outputs[k] = out

    # one finite real number per completion, or None (-> NaN)
    scores = torch.full((len(prompts), len(fns)), float("nan"))  # (N, K)
    for k, out in enumerate(outputs):
        # one value per completion, in order: a dict or a set would give its keys, a string its characters
        if isinstance(out, (collections.abc.Mapping, collections.abc.Set, str, bytes)) or inspect.isasyncgen(out) or (
                out is not None and not isinstance(out, collections.abc.Iterable)):
            fail(f"reward function {names[k]} returned a {type(out).__name__}; it must return a list with one reward "
                 f"per completion (a float, or None where it does not apply), in the order of `completions`"
                 + (" (an async function returns that list; it does not yield)" if inspect.isasyncgen(out) else "") + ".")
        out = list(out) if out is not None else []
        if len(out) != len(completions):
            fail(f"reward function {names[k]} returned {len(out)} values for {len(completions)} completions.")
        for i, r in enumerate(out):
            if r is None:  # TRL: not applicable to this sample, left out of the weighted sum
                continue
            # any real number: Python, numpy (np.float32, ...) or a 0-d tensor; not a bool, string or complex
            try:
                value = float(r) if not isinstance(r, (bool, str, bytes, complex)) else None
            except (TypeError, ValueError, RuntimeError):  # a list, a tensor of several values, ...
                value = None
            # finite, and within float32's range: rewards are held as float32 (1e39 is finite in Python, inf there)
            if value is None or not abs(value) <= FLOAT32_MAX:
                fail(f"reward function {names[k]} returned {r!r} for {where(i)}: {str(prompts[i])[:300]!r}; "
                     f"rewards must be finite real numbers within float32's range (|r| <= {FLOAT32_MAX:.3g}), "
                     "or None where the function does not apply.")
            scores[i, k] = value
    if every_row and len(fns) and scores.isnan().all(1).any():
        i = int(scores.isnan().all(1).nonzero()[0])
        fail(f"every reward function ({', '.join(names)}) returned None for {where(i)}: {str(prompts[i])[:300]!r}, "
             f"completion {str(completions[i])[:300]!r}; {script_name()}.py needs a reward for every completion "
             "(only grpo.py leaves such a completion out, as TRL does): return a number there or add a reward function that does.")
    return scores


async def _awaited(out):
    return await out


async def _gather(coroutines):  # every async reward function at once; exceptions returned, not raised
    return await asyncio.gather(*coroutines, return_exceptions=True)


def weighted_rewards(scores, weights):
    """r = sum_k w_k r_k over the functions that apply (TRL's nansum): (N, K), (K,) -> (N,); NaN
    where none applies (every function returned None)."""
    reward = (scores * weights).nansum(1)  # (N,)
    return torch.where(scores.isnan().all(1), float("nan"), reward)


def load_reward_fns(specs, weights=""):
    """--reward_fn 'a,b,...' and --reward_weights 'w_a,w_b,...' -> (the functions, (K,) weights)."""
    fns = [load_reward_fn(spec) for spec in specs.split(",") if spec]
    if not fns:
        fail("--reward_fn is empty: pass gold, arith_strict, arith_lenient or file.py:function (comma-separated).")
    names = [getattr(fn, "__name__", str(fn)) for fn in fns]
    check_reward_names(names, "--reward_fn", specs)
    return fns, parse_reward_weights(weights, names)


def check_reward_names(names, flag, spec):
    """Every reward has its own name: rewards/<name>/mean logs each under it, and two of one name
    would write into one metric (the last one's values only)."""
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        fail(f"{flag} {spec!r}: two rewards are named {twice!r}, and rewards/{twice}/mean can log only one of them: "
             "rename one of the functions (or pass a function once and give it a weight with --reward_weights).")


def check_reward_data(fns, ds, flag, dataset, trained_columns=()):
    """Before step 1, the data `ds` (a datasets.Dataset that `fns` will score, passed as `flag
    dataset`) holds what each reward function reads: a parameter without a default that is not
    one of TRL's keywords needs a column of its name; one named like a column of the training data
    (`trained_columns`, e.g. exec_tests' `tests`) reads that column, so the --eval_dataset it also
    scores needs it too. The embedded verifiers, which have no side effects, are also called on
    the first row (gold on another world's prompt, a malformed `tests` cell: stopped now)."""
    columns = [c for c in ds.column_names if c != "prompt"]
    for fn in fns:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # no signature to read (a builtin): it takes what it is given
            continue
        for p in params:
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.name in REWARD_KWARGS or p.name in columns:
                continue
            if p.default is p.empty or p.name in trained_columns:
                fail(f"reward function {getattr(fn, '__name__', fn)} reads the column {p.name!r}, which {flag} {dataset} "
                     f"does not have (its columns: {', '.join(['prompt', *columns])}); pass data with that column or "
                     "another reward function (checked before step 1: nothing was trained).")
    ours = [fn for fn in fns if fn in EMBEDDED_VERIFIERS]
    if ours and len(ds):
        row = ds[0]
        completion = [{"role": "assistant", "content": ""}] if isinstance(row["prompt"], list) else ""  # TRL's form
        try:
            call_reward_fns(ours, [row["prompt"]], [completion], columns={c: [row[c]] for c in columns}, every_row=False)
        except SystemExit as e:
            fail(f"{flag} {dataset} cannot be scored (checked on its first row before step 1: nothing was trained): "
                 + str(e.code).removeprefix("error: "))



def check_reward_datasets(fns, eval_fns, ds, eval_ds, args):
    """check_reward_data before step 1 on the training data, and on the --eval_dataset (if any) for
    the training rewards (with the training data's columns) and the --eval_reward_fn ones."""
    check_reward_data(fns, ds, "--dataset", args.dataset)
    if eval_ds is not None:
        check_reward_data(fns, eval_ds, "--eval_dataset", args.eval_dataset, [c for c in ds.column_names if c != "prompt"])
        check_reward_data(eval_fns, eval_ds, "--eval_dataset", args.eval_dataset)


def load_eval_reward_fns(spec, training_names=()):
    """--eval_reward_fn 'a,b,...' -> {name: function}: rewards the run does not train on, which score
    the --eval_dataset completions (eval_rewards/<name>/mean); `gold` is named gold, as grpo.py names
    it. A name among `training_names` (whose eval_rewards/<name>/mean the run logs already) stops."""
    fns = {}
    for one in [s for s in spec.split(",") if s]:
        fn = load_reward_fn(one)
        name = "gold" if one == "gold" else getattr(fn, "__name__", one)
        if name in fns or name in training_names:
            fail(f"--eval_reward_fn {one!r}: a reward named {name!r} is already "
                 f"{'among the training rewards' if name in training_names else 'in --eval_reward_fn'}, and "
                 f"eval_rewards/{name}/mean can log only one of them: drop it or rename the function.")
        fns[name] = fn
    return fns


def parse_reward_weights(spec, names):
    """--reward_weights 'w1,w2,...' -> (K,) weights, one per reward (default: all 1)."""
    if not spec:
        return torch.ones(len(names))
    try:
        weights = [float(w) for w in spec.split(",")]
    except ValueError:
        fail(f"--reward_weights {spec!r}: expected comma-separated numbers.")
    # a NaN weight would make every product NaN, which the weighted sum (nansum) reads as "not applicable"
    if not all(math.isfinite(w) for w in weights):
        fail(f"--reward_weights {spec!r}: every weight must be a finite number (0 to log a reward without training on it).")
    if len(weights) != len(names):
        fail(f"--reward_weights has {len(weights)} values for {len(names)} rewards ({', '.join(names)}).")
    return torch.tensor(weights)
