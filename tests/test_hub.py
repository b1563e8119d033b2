"""Hugging Face Hub ids as models, resolved offline from a cache laid out
exactly as huggingface_hub writes one (models--org--name/{blobs, refs,
snapshots/<commit>} with snapshot files linked to blobs): which files a
repository's id stands for, revisions, GGUF tags, the errors a user can
act on, and `baton generate org/name ...` end to end."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from backends.errors import ModelLoadError
from backends.loader import resolve_model
from backends.loader.embedded import embedded_model_path
from backends.loader.hub import choose_files, is_hub_id
from service.engine_factory import model_name_for

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def add_snapshot(cache: Path, repo: str, files: dict[str, Path], commit: str = COMMIT,
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``files`` (name in the repo -> a local file) into ``cache`` as
    huggingface_hub stores a download: content-addressed blobs, a snapshot
    folder of relative symlinks, and refs naming the commit."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for name, source in files.items():
        blob = storage / "blobs" / hashlib.sha256(str(source).encode() + name.encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(source.resolve())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir) -> Path:
    cache = tmp_path_factory.mktemp("hf-hub")
    folder_files = {p.name: p for p in tiny_llama_dir.iterdir() if p.is_file()}
    # what a real repository also holds and Baton must not need
    extra = tmp_path_factory.mktemp("extra") / "pytorch_model.bin"
    extra.write_bytes(b"not loaded")
    add_snapshot(cache, "baton-test/tiny-llama",
                 {**folder_files, "pytorch_model.bin": extra, "original/params.json": extra},
                 refs=("main", "v1"))
    add_snapshot(cache, "baton-test/tiny-llama",
                 {p.name: p for p in tiny_qwen2_dir.iterdir() if p.is_file()},
                 commit=OLD_COMMIT, refs=("old",))
    gguf = embedded_model_path()
    add_snapshot(cache, "baton-test/smollm2-gguf", {
        "SmolLM2-135M-Instruct.Q4_1.gguf": gguf, "SmolLM2-135M-Instruct.Q8_0.gguf": gguf,
        "README.md": extra})
    add_snapshot(cache, "baton-test/one-gguf", {"model-Q4_1.gguf": gguf})
    add_snapshot(cache, "baton-test/nothing", {"README.md": extra})
    return cache


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert is_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")
    assert not is_hub_id("./Qwen/Qwen2.5")
    assert not is_hub_id("/models/qwen")
    assert not is_hub_id("model.gguf")
    assert not is_hub_id("justaname")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")  # a local folder of that name wins
    assert model_name_for("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_name_for("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == "unsloth/Qwen3-0.6B-GGUF"


def test_a_safetensors_repository_resolves_to_its_snapshot(hub_cache):
    path = resolve_model("baton-test/tiny-llama", download_dir=str(hub_cache))
    assert path == hub_cache / "models--baton-test--tiny-llama" / "snapshots" / COMMIT
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert resolve_model("baton-test/tiny-llama", revision="v1",
                         download_dir=str(hub_cache)) == path
    assert resolve_model("baton-test/tiny-llama", revision=COMMIT,
                         download_dir=str(hub_cache)) == path
    old = resolve_model("baton-test/tiny-llama", revision="old", download_dir=str(hub_cache))
    assert old.name == OLD_COMMIT


def test_gguf_repositories_need_a_tag_when_they_hold_several(hub_cache):
    cache = str(hub_cache)
    path = resolve_model("baton-test/smollm2-gguf:Q8_0", download_dir=cache)
    assert path.name == "SmolLM2-135M-Instruct.Q8_0.gguf" and path.is_file()
    assert resolve_model("baton-test/smollm2-gguf:q4_1", download_dir=cache).name == \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ModelLoadError, match=r"several GGUF files.*:TAG.*Q4_1, Q8_0"):
        resolve_model("baton-test/smollm2-gguf", download_dir=cache)
    with pytest.raises(ModelLoadError, match=r"no GGUF file matches 'Q6_K'"):
        resolve_model("baton-test/smollm2-gguf:Q6_K", download_dir=cache)
    assert resolve_model("baton-test/one-gguf", download_dir=cache).name == "model-Q4_1.gguf"


def test_what_cannot_be_resolved_says_why(hub_cache):
    cache = str(hub_cache)
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model("baton-test/absent", download_dir=cache)
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache"):
        resolve_model("baton-test/tiny-llama", revision="v9", download_dir=cache)
    with pytest.raises(ModelLoadError, match=r"neither a config.json with safetensors"):
        resolve_model("baton-test/nothing", download_dir=cache)
    with pytest.raises(ModelLoadError, match=r"does not exist \(nor is it a Hugging Face"):
        resolve_model("./no/such/folder")


def test_only_what_baton_reads_is_chosen():
    files = {"config.json": 1, "generation_config.json": 1, "tokenizer.json": 1,
             "tokenizer_config.json": 1, "model-00001-of-00002.safetensors": 1,
             "model-00002-of-00002.safetensors": 1, "model.safetensors.index.json": 1,
             "pytorch_model.bin": 1, "original/consolidated.00.pth": 1,
             "onnx/model.safetensors": 1, "README.md": 1, "model.Q4_K_M.gguf": 1}
    assert choose_files("o/r", files, None) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors"]
    split = {"m-Q8_0-00001-of-00002.gguf": 1, "m-Q8_0-00002-of-00002.gguf": 1}
    with pytest.raises(ModelLoadError, match="split into several files"):
        choose_files("o/r", split, "Q8_0")


def test_baton_generate_takes_a_hub_id(hub_cache, capsys):
    from service.cli import main

    rc = main(["generate", "baton-test/tiny-llama", "hello", "--download-dir", str(hub_cache),
               "--max-tokens", "4", "--dtype", "float32"])
    assert rc == 0
    assert capsys.readouterr().out.strip()  # four tokens of the tiny model's text
    rc = main(["generate", "baton-test/absent", "hello", "--download-dir", str(hub_cache)])
    assert rc == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err


# ------------------------------------------- downloading from a (fake) Hub

FAKE_HUB = r'''
import hashlib, json, sys, time
from pathlib import Path
from aiohttp import web

files = {p.name: p.read_bytes() for p in Path(sys.argv[1]).iterdir() if p.is_file()}
files["pytorch_model.bin"] = b"never fetched"
commit = "c0ffee" + "0" * 34

def tree(request):
    return web.json_response([{"type": "file", "path": n, "size": len(b),
                               "oid": hashlib.sha1(b).hexdigest()} for n, b in files.items()])

def revision(request):
    return web.json_response({"id": "baton-test/remote", "sha": commit,
                              "siblings": [{"rfilename": n} for n in files]})

async def resolve(request):
    name = request.match_info["path"]
    if name not in files:
        return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
    body = files[name]
    headers = {"X-Repo-Commit": commit, "ETag": '"%s"' % hashlib.sha256(body).hexdigest(),
               "Content-Length": str(len(body)), "Accept-Ranges": "bytes"}
    if request.method == "HEAD":
        return web.Response(headers=headers)
    if name == "model.safetensors":
        time.sleep(0.6)  # slow enough for a progress line
    return web.Response(body=body, headers=headers)

app = web.Application()
app.router.add_get("/api/models/{org}/{name}/tree/{rev}", tree)
app.router.add_get("/api/models/{org}/{name}/revision/{rev}", revision)
app.router.add_get("/{org}/{name}/resolve/{rev}/{path}", resolve)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=lambda *a: print("up", flush=True))
'''

DOWNLOAD = r'''
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
from backends.loader.hub import download_model
print("PATH", download_model("baton-test/remote", download_dir=sys.argv[1], progress=True))
'''


@pytest.mark.slow
def test_a_hub_id_is_downloaded_into_the_cache_with_progress_lines(tmp_path, tiny_llama_dir,
                                                                   monkeypatch):
    import socket
    import subprocess
    import sys
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    hub = subprocess.Popen([sys.executable, "-c", FAKE_HUB, str(tiny_llama_dir), str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert hub.stdout.readline().strip() == "up"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BATON_"))}
        env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HUB_DISABLE_XET="1",
                   BATON_PROGRESS_INTERVAL="0.2", HF_HOME=str(tmp_path / "home"))
        cache = tmp_path / "cache"
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", DOWNLOAD, str(cache)], env=env,
                              capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        hub.terminate()
        hub.wait(timeout=30)
    path = Path(done.stdout.split("PATH ", 1)[1].strip())
    assert path == cache / "models--baton-test--remote" / "snapshots" / ("c0ffee" + "0" * 34)
    assert (path / "model.safetensors").read_bytes() == \
        (tiny_llama_dir / "model.safetensors").read_bytes()
    assert not (path / "pytorch_model.bin").exists()  # only what Baton reads
    assert "baton.progress: downloading baton-test/remote: " in done.stderr
    assert time.monotonic() - started < 120
    # and from now on the cache serves it offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("baton-test/remote", download_dir=str(cache)) == path
