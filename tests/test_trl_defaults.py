"""Every default that differs from TRL 1.16's is said: the test reads TRL's config classes (in
.venv-bench, where TRL lives) and each script's Args, and every flag whose default differs must
be a row of docs/trl.md's "Defaults that differ from TRL 1.16" table. Skips without .venv-bench."""

import dataclasses
import importlib
import json
import os
import re
import subprocess

import pytest
from conftest import ROOT, trl_python

# script (a second config of the same script after a colon) -> TRL's config class, dotted below `trl`
CONFIGS = {"grpo": "GRPOConfig", "dpo": "DPOConfig", "sft": "SFTConfig", "reward": "RewardConfig", "kto": "KTOConfig",
           "distill": "DistillationConfig", "distill:gkd": "experimental.gkd.GKDConfig"}
DUMP = """
import dataclasses, importlib, json, trl
out = {}
for script, name in %r.items():
    module, _, cls = ("trl." + name).rpartition(".")
    fields = {}
    for f in dataclasses.fields(getattr(importlib.import_module(module), cls)):
        v = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        fields[f.name] = v if isinstance(v, (int, float, str, bool, list, type(None))) else repr(v)
    out[script] = fields
print(json.dumps(out))
"""


def unset(value):
    """The values that mean "not set" or "the same as a one-element list" on either side."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return None if value in (None, "", 0, 0.0, False, "none", "auto") else value


def differing(trl_defaults):
    """{script: [(flag, ours, TRL's)]} for the flags both have, whose defaults differ."""
    out = {}
    for script, fields in trl_defaults.items():
        ours = {f.name: f.default for f in dataclasses.fields(importlib.import_module(script.split(":")[0]).Args)
                if f.default is not dataclasses.MISSING}
        out[script] = [(k, v, fields[k]) for k, v in ours.items() if k in fields and unset(v) != unset(fields[k])]
    return out


def documented():
    """The flags named in the first cell of docs/trl.md's table of differing defaults."""
    text = open(os.path.join(ROOT, "docs", "trl.md")).read()
    table = text[text.index("## Defaults that differ from TRL 1.16"):]
    return {name for row in table.splitlines() if row.startswith("| `") for name in re.findall(r"`(\w+)`", row.split("|")[1])}


def test_every_default_that_differs_from_trls_is_in_docs_trl_md():
    python = trl_python()
    proc = subprocess.run([python, "-c", DUMP % CONFIGS], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trl_defaults = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = [f"{script}: --{flag} {ours!r} (TRL: {trl!r})" for script, rows in differing(trl_defaults).items()
               for flag, ours, trl in rows if flag not in documented()]
    assert not missing, "docs/trl.md's table of differing defaults lacks: " + "; ".join(missing)


def test_the_comparison_sees_a_difference():
    """differing() on made-up TRL defaults: a changed learning rate is found, an unset one is not."""
    diffs = differing({"dpo": {"learning_rate": 3e-3, "warmup_steps": None, "beta": 0.1}})
    assert [d[0] for d in diffs["dpo"]] == ["learning_rate"]
