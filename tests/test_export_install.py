"""Installing a GGUF export into Ollama and LM Studio, and the one-question check beside TuneDeck's own answer.

Ollama is a stand-in HTTP server (``http.server`` in a thread) that records every call and keeps uploaded blobs
by their real SHA-256, and a stand-in ``ollama`` command on PATH that records how it was run; LM Studio is a
temporary home folder and a stand-in of its OpenAI-compatible server. The export itself and TuneDeck's answer
come from a real (tiny) run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_S
from test_chat import train_tiny_run

from engine.export import export_gguf
from engine.export.install import (
    DEFAULT_QUESTION,
    LMSTUDIO_URL_VARIABLE,
    install_export,
    lmstudio_models_dir,
    ollama_url,
    read_export,
    tunedeck_answer,
)

OLLAMA_ANSWER = "Paris, from the stand-in Ollama."
LMSTUDIO_ANSWER = "Paris, from the stand-in LM Studio."


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("install"))


@pytest.fixture(scope="module")
def exported(run_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_gguf(run_folder, tmp_path_factory.mktemp("export") / "gguf", quant="q8_0")


@pytest.fixture(scope="module")
def ours(run_folder: Path) -> str:
    answer = tunedeck_answer(run_folder, DEFAULT_QUESTION)
    assert answer, "the tiny run answers something, so the side-by-side shows a real answer"
    return answer


class FakeRuntime(BaseHTTPRequestHandler):
    """Ollama's and LM Studio's local APIs, as far as an install and one question use them."""

    server: Any

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def do_HEAD(self) -> None:
        state = self.server.state
        state["calls"].append(("HEAD", self.path, None))
        self._send(200 if self.path.removeprefix("/api/blobs/") in state["blobs"] else 404)

    def do_GET(self) -> None:
        state = self.server.state
        state["calls"].append(("GET", self.path, None))
        if self.path == "/api/version":
            self._send(200, {"version": "0.12.0"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": i, "object": "model"} for i in state["listed"]]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        state, body = self.server.state, self._body()
        if self.path.startswith("/api/blobs/"):
            digest = self.path.removeprefix("/api/blobs/")
            state["calls"].append(("POST", self.path, len(body)))
            if digest != f"sha256:{hashlib.sha256(body).hexdigest()}":
                self._send(400, {"error": "digest mismatch"})
                return
            state["blobs"][digest] = len(body)
            self._send(201)
            return
        request = json.loads(body)
        state["calls"].append(("POST", self.path, request))
        if self.path == "/api/create":
            if state.get("refuse"):
                self._send(500, {"error": state["refuse"]})
                return
            missing = [d for d in request["files"].values() if d not in state["blobs"]]
            if missing:
                self._send(400, {"error": f"blob {missing[0]} not found"})
                return
            state["models"].add(request["model"])
            self._send(200, {"status": "success"})
        elif self.path == "/api/chat":
            if "hold" in state:  # a test holds the answer back until it has looked at the waiting app
                state["hold"].wait(timeout=HANG_S)
            if request["model"] not in state["models"]:
                self._send(404, {"error": f"model '{request['model']}' not found"})
                return
            self._send(200, {"message": {"role": "assistant", "content": OLLAMA_ANSWER}, "done": True})
        elif self.path == "/v1/chat/completions":
            self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": LMSTUDIO_ANSWER}}]})
        else:
            self._send(404, {"error": "not found"})


@pytest.fixture
def runtime() -> Iterator[tuple[str, dict[str, Any]]]:
    """A running stand-in server: its address and its recorded state."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRuntime)
    server.state = {"calls": [], "blobs": {}, "models": set(), "listed": []}  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", server.state  # type: ignore[attr-defined]
    if "hold" in server.state:  # type: ignore[attr-defined]
        server.state["hold"].set()  # type: ignore[attr-defined]  # a failed test must not leave a request waiting
    server.shutdown()
    server.server_close()
    thread.join()


def closed_port() -> str:
    """An address nothing listens on."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRuntime)
    port = server.server_address[1]
    server.server_close()
    return f"127.0.0.1:{port}"


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH with only a folder of our own: no real ollama is found."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


def fake_ollama(folder: Path, exit_code: int = 0, stderr: str = "") -> Path:
    """An ``ollama`` command that records its arguments, folder and the Modelfile it was given."""
    log = folder / "ollama-calls.jsonl"
    script = folder / "ollama"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "modelfile = open(args[args.index('-f') + 1]).read() if '-f' in args else None\n"
        "record = {'args': args, 'cwd': os.getcwd(), 'modelfile': modelfile}\n"
        f"open({str(log)!r}, 'a').write(json.dumps(record) + '\\n')\n"
        f"sys.stderr.write({stderr!r})\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return log


def test_ollama_api_uploads_the_blob_creates_the_model_and_asks_it(
    run_folder: Path, exported: Path, ours: str, runtime: tuple[str, dict[str, Any]], bare_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    address, state = runtime
    monkeypatch.setenv("OLLAMA_HOST", address)
    files = read_export(exported)
    report = install_export(run_folder, exported, "ollama")
    digest = f"sha256:{hashlib.sha256(files.gguf.read_bytes()).hexdigest()}"
    assert [(method, path) for method, path, _ in state["calls"]] == [
        ("GET", "/api/version"),
        ("HEAD", f"/api/blobs/{digest}"),
        ("POST", f"/api/blobs/{digest}"),
        ("POST", "/api/create"),
        ("POST", "/api/chat"),
    ]
    assert state["blobs"] == {digest: files.gguf.stat().st_size}
    create = state["calls"][3][2]
    assert create["model"] == "run" and create["files"] == {files.gguf.name: digest}
    assert create["template"] == files.template and "{{ range .Messages }}" in create["template"]
    assert create["parameters"] == {"stop": ["<|im_end|>"]}
    chat = state["calls"][4][2]
    assert chat["messages"] == [{"role": "user", "content": DEFAULT_QUESTION}]
    assert chat["options"]["temperature"] == 0 and chat["stream"] is False
    assert report.installed and report.answer == OLLAMA_ANSWER and report.tunedeck_answer == ours
    text = "\n".join(report.lines())
    assert f"Ollama answers:  {OLLAMA_ANSWER}" in text and f"TuneDeck answers: {ours}" in text
    assert "uploaded" in text and "created the model run" in text and not report.todo

    state["calls"].clear()  # a second install finds the blob and uploads nothing
    install_export(run_folder, exported, "ollama", question="Why?")
    assert ("HEAD", f"/api/blobs/{digest}") in [(m, p) for m, p, _ in state["calls"]]
    assert not any(m == "POST" and p.startswith("/api/blobs/") for m, p, _ in state["calls"])
    assert state["calls"][-1][2]["messages"][0]["content"] == "Why?"


def test_the_ollama_command_creates_the_model_when_it_is_on_path(
    run_folder: Path, exported: Path, ours: str, runtime: tuple[str, dict[str, Any]], bare_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    address, state = runtime
    monkeypatch.setenv("OLLAMA_HOST", f"http://{address}")
    log = fake_ollama(bare_path)
    state["models"].add("run")  # what the real command would have done to the server
    report = install_export(run_folder, exported, "ollama")
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["args"] == ["create", "run", "-f", str(exported / "Modelfile")]
    assert Path(call["cwd"]) == exported and call["modelfile"] == (exported / "Modelfile").read_text()
    assert not any(path == "/api/create" for _, path, _ in state["calls"]), "the command made the model"
    assert report.answer == OLLAMA_ANSWER and report.tunedeck_answer == ours
    assert "ran `ollama create run -f Modelfile`" in report.done[0]


def test_a_failing_ollama_command_says_what_to_run(
    run_folder: Path, exported: Path, bare_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OLLAMA_HOST", closed_port())
    fake_ollama(bare_path, exit_code=1, stderr="Error: could not connect to ollama app, is it running?\n")
    report = install_export(run_folder, exported, "ollama")
    assert not report.installed and report.answer is None and report.tunedeck_answer is None
    assert "could not connect to ollama app" in report.problem
    assert report.todo == (
        "start Ollama (the app, or `ollama serve`)",
        f'ollama create run -f "{exported / "Modelfile"}"',
    )


def test_a_model_ollama_refuses_is_reported_with_its_reason(
    run_folder: Path, exported: Path, runtime: tuple[str, dict[str, Any]], bare_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    address, state = runtime
    monkeypatch.setenv("OLLAMA_HOST", address)
    state["refuse"] = "unsupported architecture"
    report = install_export(run_folder, exported, "ollama")
    assert not report.installed and report.answer is None
    assert report.problem == "its API refused the model: HTTP 500: unsupported architecture"
    assert report.todo == (f'ollama create run -f "{exported / "Modelfile"}"',)
    assert "Ollama: its API refused the model" in "\n".join(report.lines())
    assert not any(path == "/api/chat" for _, path, _ in state["calls"]), "a model that is not there is not asked"


def test_nothing_running_says_exactly_what_to_run(
    run_folder: Path, exported: Path, bare_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = closed_port()
    monkeypatch.setenv("OLLAMA_HOST", address)
    report = install_export(run_folder, exported, "ollama")
    assert not report.installed and report.answer is None
    assert report.done == (f"found neither the ollama command nor Ollama's server at http://{address}",)
    assert f'ollama create run -f "{exported / "Modelfile"}"' in report.todo and "ollama run run" in report.todo
    assert "To finish, run:" in report.lines()


def test_lmstudio_gets_the_file_in_its_models_layout(
    run_folder: Path, exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".lmstudio").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(LMSTUDIO_URL_VARIABLE, f"http://{closed_port()}")
    report = install_export(run_folder, exported, "lmstudio")
    gguf = read_export(exported).gguf
    placed = home / ".lmstudio" / "models" / "tunedeck" / "run" / gguf.name
    assert placed.read_bytes() == gguf.read_bytes()
    assert report.installed and report.answer is None and "does not answer" in report.problem
    assert report.todo and "lms load tunedeck/run" in report.todo[0]
    assert str(placed) in report.done[0]


def test_lmstudio_folders_old_new_and_chosen(tmp_path: Path) -> None:
    home = tmp_path / "h"
    assert lmstudio_models_dir(home) == home / ".lmstudio" / "models"  # not installed yet: today's layout
    (home / ".cache" / "lm-studio").mkdir(parents=True)
    assert lmstudio_models_dir(home) == home / ".cache" / "lm-studio" / "models"
    (home / ".lmstudio").mkdir()
    assert lmstudio_models_dir(home) == home / ".lmstudio" / "models"
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(tmp_path / "big-disk")}))
    assert lmstudio_models_dir(home) == tmp_path / "big-disk"


def test_lmstudio_server_answers_beside_tunedeck(
    run_folder: Path, exported: Path, ours: str, runtime: tuple[str, dict[str, Any]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    address, state = runtime
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(LMSTUDIO_URL_VARIABLE, f"http://{address}/")
    report = install_export(run_folder, exported, "lmstudio")
    assert report.answer is None and "does not list the new model" in report.problem  # not indexed yet
    state["listed"][:] = ["some-other-model", "tunedeck/run"]
    report = install_export(run_folder, exported, "lmstudio")
    request = state["calls"][-1][2]
    assert request["model"] == "tunedeck/run" and request["temperature"] == 0
    assert report.answer == LMSTUDIO_ANSWER and report.tunedeck_answer == ours and not report.problem


def test_ollama_host_is_read_as_ollama_reads_it() -> None:
    assert ollama_url("") == "http://127.0.0.1:11434"
    assert ollama_url("0.0.0.0") == "http://127.0.0.1:11434"
    assert ollama_url("0.0.0.0:8080") == "http://127.0.0.1:8080"
    assert ollama_url("https://ollama.local:443/") == "https://ollama.local:443"
    assert ollama_url("example.org") == "http://example.org:11434"


def test_cli_exports_and_installs(
    run_folder: Path, ours: str, runtime: tuple[str, dict[str, Any]], bare_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from engine.cli.runs import export_main

    address, state = runtime
    monkeypatch.setenv("OLLAMA_HOST", address)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".lmstudio").mkdir(parents=True)  # LM Studio is installed, its server not started
    monkeypatch.setenv(LMSTUDIO_URL_VARIABLE, f"http://{closed_port()}")
    target = tmp_path / "out"
    args = [str(run_folder), "--to", str(target), "--gguf", "q8_0", "--install", "ollama", "--install", "lmstudio"]
    assert export_main(args) == 0
    out = capsys.readouterr().out
    assert "tensor types: q8_0 requested: " in out
    assert f"Ollama answers:  {OLLAMA_ANSWER}" in out and f"TuneDeck answers: {ours}" in out
    assert "LM Studio: linked" in out and "lms load tunedeck/run" in out
    assert ("POST", "/api/create") in [(m, p) for m, p, _ in state["calls"]]
    assert os.path.samefile(
        read_export(target).gguf, tmp_path / "home" / ".lmstudio" / "models" / "tunedeck" / "run" / "run.gguf"
    )


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--gguf", "f16", "--dtype", "float32"], "--dtype applies to --merged only: a GGUF file's tensor types"),
        (["--dtype", "float16"], "--dtype applies to --merged only: the adapter is exported as it was trained"),
        (["--install", "ollama"], "--install needs a GGUF export (--gguf)"),
        (["--merged", "--install", "lmstudio"], "--install needs a GGUF export (--gguf)"),
        (["--gguf", "--question", "hi"], "--question is asked of an installed model"),
        (["--gguf", "--merged"], "choose one of --merged and --gguf"),
    ],
)
def test_flags_that_do_not_apply_are_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], reason: str
) -> None:
    from engine.cli.runs import export_main

    with pytest.raises(SystemExit) as exit_info:
        export_main(["some-run", "--to", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
