"""Installing a GGUF export into Ollama or LM Studio, then asking the installed model one question.

Ollama: ``ollama create NAME -f Modelfile`` when the ``ollama`` command is on PATH (what the user would type);
without it, Ollama's local HTTP API when its server answers: the GGUF is uploaded once as a blob
(``POST /api/blobs/sha256:<digest>``, skipped when ``HEAD`` finds it) and ``/api/create`` makes the model from it
with the Modelfile's template and stop tokens. ``OLLAMA_HOST`` is honoured as Ollama's own client honours it.
LM Studio: the file is linked (or copied, across disks) into its models folder as ``tunedeck/<run>/<file>.gguf``,
the publisher/model/file layout LM Studio lists (``~/.lmstudio/models``, or ``~/.cache/lm-studio/models`` of older
versions, or the folder its settings name).

When the runtime's server is up, one question goes to the installed model (Ollama's ``/api/chat``, LM Studio's
OpenAI-compatible ``/v1/chat/completions``), greedy, and TuneDeck answers the same question with the run's own
model, so the two answers sit side by side. Where nothing runs, the report says what was done and the commands
that finish the job. Nothing here starts or stops a runtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import TuneDeckError
from engine.export.gguf import model_slug

RUNTIMES = ("ollama", "lmstudio")
RUNTIME_NAMES = {"ollama": "Ollama", "lmstudio": "LM Studio"}
DEFAULT_QUESTION = "In one sentence, what is the capital of France?"
ANSWER_TOKENS = 64
OLLAMA_PORT = 11434
LMSTUDIO_URL = "http://127.0.0.1:1234"
LMSTUDIO_SITE = "https://lmstudio.ai"
LMSTUDIO_URL_VARIABLE = "TUNEDECK_LMSTUDIO_URL"  # another LM Studio server address (its port is a setting there)
PROBE_SECONDS = 2.0  # "is the server up?": a local server answers at once
ANSWER_SECONDS = 600.0  # the first question also loads the model into the runtime


@dataclass(frozen=True)
class InstallReport:
    """What an install did, what is left to run, and the installed model's answer beside TuneDeck's."""

    runtime: str  # "Ollama" or "LM Studio"
    model: str  # the name the runtime knows the model by (or its file, for LM Studio)
    done: tuple[str, ...]  # what was done, a sentence each
    todo: tuple[str, ...] = ()  # what the user still has to do (commands), empty when installed and checked
    question: str = DEFAULT_QUESTION
    answer: str | None = None  # the installed model's answer; None when it could not be asked
    tunedeck_answer: str | None = None  # TuneDeck's own answer to the same question
    problem: str = ""  # why the install or the check stopped short, when it did
    installed: bool = True

    def lines(self) -> list[str]:
        """The report as lines of text for the terminal."""
        out = [f"{self.runtime}: {sentence}" for sentence in self.done]
        if self.problem:
            out.append(f"{self.runtime}: {self.problem}")
        if self.answer is not None:
            out += [f"Question: {self.question}", f"{self.runtime} answers:  {self.answer}"]
            ours = self.tunedeck_answer if self.tunedeck_answer is not None else "(not asked)"
            out.append(f"TuneDeck answers: {ours}")
        if self.todo:
            out.append("To finish, run:" if self.installed is False else "Then:")
            out += [f"  {command}" for command in self.todo]
        return out


@dataclass
class _Http:
    """A tiny JSON client for a local server; every call fails fast when nothing listens."""

    base: str
    calls: list[str] = field(default_factory=list)

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = PROBE_SECONDS) -> Any:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None and not isinstance(body, bytes):
            request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
        return json.loads(text) if text.strip() else None

    def upload(self, path: str, file: Path, *, timeout: float) -> None:
        with file.open("rb") as handle:
            request = urllib.request.Request(self.base + path, data=handle, method="POST")
            request.add_header("Content-Length", str(file.stat().st_size))
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()

    def up(self, path: str) -> bool:
        try:
            self.request("GET", path)
        except (OSError, ValueError):
            return False
        return True


def _error_text(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        try:
            detail = json.loads(err.read().decode() or "{}").get("error", "")
        except (ValueError, AttributeError):
            detail = ""
        return f"HTTP {err.code}" + (f": {detail}" if detail else "")
    return str(getattr(err, "reason", err))


# ------------------------------------------------------------------------------------------------- export files


@dataclass(frozen=True)
class ExportFiles:
    """What an install needs from a GGUF export folder: the file, and the Modelfile's template and stops."""

    folder: Path
    gguf: Path
    modelfile: Path
    template: str | None
    stops: tuple[str, ...]


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text[1:-1]) if len(text) >= 2 and text[0] == text[-1] == '"' else text


def read_export(folder: str | Path) -> ExportFiles:
    """The GGUF file and Modelfile of an export folder (as ``tunedeck export --gguf`` writes them)."""
    folder = Path(folder)
    modelfile = folder / "Modelfile"
    if any(folder.glob("mmproj-*.gguf")):  # a picture model's export (engine.export.vision_gguf)
        raise TuneDeckError(
            f"{folder} holds a picture model (a language model and its vision projector): TuneDeck installs text "
            "models only into Ollama and LM Studio",
            hint="run it with llama.cpp: llama-mtmd-cli or llama-server with -m and --mmproj (see its README)",
        )
    if not modelfile.exists():
        raise TuneDeckError(f"{folder} is not a GGUF export (it has no Modelfile)", hint="export with --gguf first")
    text = modelfile.read_text(encoding="utf-8")
    source = re.search(r"^FROM\s+(\S+)\s*$", text, re.M)
    gguf = (folder / source.group(1)).resolve() if source else None
    if gguf is None or not gguf.is_file():
        raise TuneDeckError(f"the Modelfile in {folder} names no GGUF file that is there", hint="export again")
    template = re.search(r'^TEMPLATE """(.*?)"""', text, re.M | re.S)
    stops = tuple(_unquote(m.group(1)) for m in re.finditer(r"^PARAMETER stop (.+)$", text, re.M))
    return ExportFiles(folder, gguf, modelfile, template.group(1) if template else None, stops)


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


# ------------------------------------------------------------------------------------------------------ Ollama


def ollama_url(host: str | None = None) -> str:
    """Ollama's server address, from ``host`` or ``OLLAMA_HOST`` as Ollama's own client reads it."""
    text = (host if host is not None else os.environ.get("OLLAMA_HOST", "")).strip() or "127.0.0.1"
    scheme, _, rest = text.rpartition("://")
    rest = rest.rstrip("/")
    name, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        name, port = rest, str(OLLAMA_PORT)
    if name in ("", "0.0.0.0", "::", "[::]"):  # a server listening everywhere is reached locally
        name = "127.0.0.1"
    return f"{scheme or 'http'}://{name}:{port}"


def _ollama_create_command(name: str, files: ExportFiles) -> str:
    return f'ollama create {name} -f "{files.modelfile}"'


def _ollama_by_command(ollama: str, name: str, files: ExportFiles) -> tuple[list[str], str]:
    result = subprocess.run(
        [ollama, "create", name, "-f", str(files.modelfile)],
        cwd=files.folder,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode == 0:
        return [f"ran `ollama create {name} -f Modelfile` in {files.folder}"], ""
    lines = (result.stderr or result.stdout).strip().splitlines()
    return [], f"`ollama create` failed: {lines[-1] if lines else f'exit status {result.returncode}'}"


def _ollama_by_api(http: _Http, name: str, files: ExportFiles) -> tuple[list[str], str]:
    digest = f"sha256:{_digest(files.gguf)}"
    done = []
    try:
        try:
            http.request("HEAD", f"/api/blobs/{digest}")
            done.append(f"found {files.gguf.name} already among Ollama's blobs")
        except urllib.error.HTTPError as err:
            if err.code != 404:
                raise
            http.upload(f"/api/blobs/{digest}", files.gguf, timeout=ANSWER_SECONDS)
            done.append(f"uploaded {files.gguf.name} to Ollama ({http.base})")
        body: dict[str, Any] = {"model": name, "files": {files.gguf.name: digest}, "stream": False}
        if files.template is not None:
            body["template"] = files.template
        if files.stops:
            body["parameters"] = {"stop": list(files.stops)}
        reply = http.request("POST", "/api/create", body, timeout=ANSWER_SECONDS)
    except (OSError, ValueError) as err:
        return done, f"its API refused the model: {_error_text(err)}"
    if isinstance(reply, dict) and reply.get("error"):
        return done, f"its API refused the model: {reply['error']}"
    done.append(f"created the model {name} through Ollama's API with the Modelfile's template and stop tokens")
    return done, ""


def _ask_ollama(http: _Http, name: str, question: str) -> tuple[str | None, str]:
    body = {
        "model": name,
        "messages": [{"role": "user", "content": question}],
        "stream": False,
        "options": {"temperature": 0, "num_predict": ANSWER_TOKENS},
    }
    try:
        reply = http.request("POST", "/api/chat", body, timeout=ANSWER_SECONDS)
        return str(reply["message"]["content"]).strip(), ""
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"the installed model did not answer: {_error_text(err)}"


def install_ollama(
    folder: str | Path, name: str, *, question: str = DEFAULT_QUESTION, host: str | None = None
) -> InstallReport:
    """Make the export in ``folder`` an Ollama model called ``name`` and ask it ``question`` if Ollama runs."""
    files = read_export(folder)
    http = _Http(ollama_url(host))
    running = http.up("/api/version")
    ollama = shutil.which("ollama")
    create = _ollama_create_command(name, files)
    if ollama is not None:
        done, problem = _ollama_by_command(ollama, name, files)
    elif running:
        done, problem = _ollama_by_api(http, name, files)
    else:
        return InstallReport(
            "Ollama", name, (f"found neither the ollama command nor Ollama's server at {http.base}",),
            todo=("start Ollama (the app, or `ollama serve`)", create, f"ollama run {name}"),
            question=question, installed=False,
        )  # fmt: skip
    if problem:
        start = () if running else ("start Ollama (the app, or `ollama serve`)",)
        return InstallReport(
            "Ollama", name, tuple(done), todo=(*start, create), question=question, problem=problem, installed=False
        )
    if not running:
        return InstallReport(
            "Ollama", name, tuple(done), todo=(f"ollama run {name}",), question=question,
            problem=f"its server does not answer at {http.base}, so the model was not asked a question",
        )  # fmt: skip
    answer, problem = _ask_ollama(http, name, question)
    return InstallReport("Ollama", name, tuple(done), question=question, answer=answer, problem=problem)


# --------------------------------------------------------------------------------------------------- LM Studio


def lmstudio_models_dir(home: Path | None = None) -> Path:
    """LM Studio's models folder: the one its settings name, else ``~/.lmstudio/models`` (or the older
    ``~/.cache/lm-studio/models`` where only that exists)."""
    home = home or Path.home()
    settings = home / ".lmstudio" / "settings.json"
    try:
        chosen = json.loads(settings.read_text(encoding="utf-8")).get("downloadsFolder")
        if chosen:
            return Path(chosen).expanduser()
    except (OSError, ValueError, AttributeError):
        pass
    older = home / ".cache" / "lm-studio"
    if older.is_dir() and not (home / ".lmstudio").is_dir():
        return older / "models"
    return home / ".lmstudio" / "models"


def lmstudio_installed(home: Path | None = None) -> bool:
    """Whether LM Studio looks installed here: its folder (today's or the older one) or its ``lms`` command."""
    home = home or Path.home()
    return (home / ".lmstudio").is_dir() or (home / ".cache" / "lm-studio").is_dir() or bool(shutil.which("lms"))


def _place(source: Path, target: Path) -> str:
    """A hard link to ``source`` at ``target`` (no second copy on the disk), or a copy across disks."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        target.unlink()
    try:
        os.link(source, target)
        return "linked"
    except OSError:
        shutil.copy2(source, target)
        return "copied"


def lmstudio_url(url: str | None = None) -> str:
    return (url or os.environ.get(LMSTUDIO_URL_VARIABLE) or LMSTUDIO_URL).rstrip("/")


def _ask_lmstudio(http: _Http, model: str, question: str) -> tuple[str | None, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": ANSWER_TOKENS,
        "stream": False,
    }
    try:
        reply = http.request("POST", "/v1/chat/completions", body, timeout=ANSWER_SECONDS)
        return str(reply["choices"][0]["message"]["content"]).strip(), ""
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        return None, f"the installed model did not answer: {_error_text(err)}"


def _listed_model(http: _Http, key: str, gguf: Path) -> str | None:
    """The id LM Studio's server lists for the installed file, if it lists it."""
    listed = http.request("GET", "/v1/models")
    ids = [str(item.get("id", "")) for item in (listed or {}).get("data", []) if isinstance(item, dict)]
    wanted = {key.lower(), f"{key}/{gguf.name}".lower(), gguf.stem.lower()}
    return next((i for i in ids if i.lower() in wanted or i.lower().removesuffix(".gguf") in wanted), None)


def install_lmstudio(
    folder: str | Path,
    name: str,
    *,
    question: str = DEFAULT_QUESTION,
    models_dir: str | Path | None = None,
    url: str | None = None,
) -> InstallReport:
    """Put the export's GGUF file in LM Studio's models folder as ``tunedeck/<name>/`` and ask it ``question``
    through LM Studio's server when that runs and lists it."""
    files = read_export(folder)
    root = Path(models_dir) if models_dir is not None else lmstudio_models_dir()
    key = f"tunedeck/{name}"
    http = _Http(lmstudio_url(url))
    up = http.up("/v1/models")
    if not up and models_dir is None and not lmstudio_installed():  # no folder of LM Studio's made for nothing
        return InstallReport(
            "LM Studio", key, (), question=question, installed=False,
            todo=(f"install LM Studio from {LMSTUDIO_SITE}, open it once, then install the export again",),
            problem=f"LM Studio is not installed on this computer (no {root.parent} folder, no lms command, no "
            f"server at {http.base}), so nothing was put in its models folder",
        )  # fmt: skip
    target = root / "tunedeck" / name / files.gguf.name
    how = _place(files.gguf, target)
    done = (f"{how} {files.gguf.name} into LM Studio's models folder as {target}",)
    if not up:
        return InstallReport(
            "LM Studio", key, done, question=question,
            todo=(f"open LM Studio: My Models lists {key}; load it (or `lms load {key}`) to chat with it",),
            problem=f"its server does not answer at {http.base}, so the model was not asked a question",
        )  # fmt: skip
    try:
        model = _listed_model(http, key, files.gguf)
    except (OSError, ValueError, AttributeError):
        model = None
    if model is None:
        return InstallReport(
            "LM Studio", key, done, question=question,
            todo=(f"lms load {key}   (or load it in LM Studio's My Models), then ask it again",),
            problem="its server runs but does not list the new model yet (it lists models it has loaded "
            "or indexed)",
        )  # fmt: skip
    answer, problem = _ask_lmstudio(http, model, question)
    return InstallReport("LM Studio", key, done, question=question, answer=answer, problem=problem)


# ------------------------------------------------------------------------------------------------------ both


def held_out_question(run_folder: str | Path, longest: int = 300) -> str | None:
    """The first of the run's held-out questions no longer than ``longest`` characters, as the run held them out
    (its data, fraction and seed from ``config.json``): what to ask an installed model, rather than a question the
    run never trained for. None when the run held nothing out or its data cannot be read."""
    from engine.config import RunConfig
    from engine.data.files import load_examples
    from engine.data.split import first_question, split_examples

    try:
        config = RunConfig.load(Path(run_folder) / "config.json")
        data = config.data
        if data.eval_path:
            held_out, _ = load_examples(data.eval_path, data.format)
        else:
            examples, _ = load_examples(data.path, data.format)
            held_out = split_examples(examples, data.eval_fraction, config.training.seed)[1]
    except (TuneDeckError, OSError, ValueError):
        return None
    questions = (first_question(example) for example in held_out)
    return next((question for question in questions if question and len(question) <= longest), None)


def tunedeck_answer(run_folder: str | Path, question: str, adapter: str = "best") -> str:
    """TuneDeck's own answer to ``question``: the run's model (base + ``adapter``, best or last, as exported),
    greedy, as the Chat page runs it."""
    from engine.model.chat import GenerationSettings, load_chat_model, reply

    chat = load_chat_model(run_folder, adapter=adapter)
    settings = GenerationSettings(temperature=0.0, max_new_tokens=ANSWER_TOKENS)
    return reply(chat, [{"role": "user", "content": question}], settings).strip()


def install_export(
    run_folder: str | Path,
    folder: str | Path,
    runtime: str,
    *,
    name: str | None = None,
    question: str = DEFAULT_QUESTION,
    adapter: str = "best",
) -> InstallReport:
    """Install the GGUF export in ``folder`` into ``runtime`` ("ollama" or "lmstudio"); where the installed model
    answered, TuneDeck answers the same question beside it with the ``adapter`` the export was made from."""
    if runtime not in RUNTIMES:
        raise TuneDeckError(f"unknown runtime {runtime!r}", hint=f"use one of {', '.join(RUNTIMES)}")
    model_name = model_slug(name or Path(run_folder).name)
    if runtime == "ollama":
        report = install_ollama(folder, model_name, question=question)
    else:
        report = install_lmstudio(folder, model_name, question=question)
    if report.answer is None:
        return report
    return _with_tunedeck_answer(report, run_folder, adapter)


def _with_tunedeck_answer(report: InstallReport, run_folder: str | Path, adapter: str) -> InstallReport:
    return dataclasses.replace(report, tunedeck_answer=tunedeck_answer(run_folder, report.question, adapter))
