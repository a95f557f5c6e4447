"""Models and datasets come from strangers: repository code and pickle weights need the user's consent, the
Hugging Face token never reaches anything a run writes or reports, and nothing is fetched unless asked for."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig, RunConfig
from engine.errors import ModelLoadError
from engine.events import Notice, RunFailed, RunFinished
from engine.model import load as models
from engine.redact import MASK, redact
from engine.run import step as step_module
from engine.run.session import PICKLE_WARNING
from engine.train import run

ENGINE = Path(models.__file__).parent
TOKEN = "hf_" + "MarkerTokenFromEnvironment0123456789"
CACHED_TOKEN = "hf_" + "MarkerTokenFromTheCacheFile9876543210"


def make_config(model_dir: Path, data: Path, out: Path, **model: object) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir), **model},
            "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.1},
            "lora": {"rank": 4, "alpha": 8.0},
            "training": {"max_steps": 2, "warmup_steps": 1, "save_every": 1, "eval_every": 1},
            "output": {"dir": str(out), "name": "run"},
        }
    )


# --- repository code ----------------------------------------------------------------------------------------


def record_kwargs(monkeypatch: pytest.MonkeyPatch, owner: type, seen: list[dict]) -> None:
    real = owner.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, "from_pretrained", recording)


@pytest.mark.parametrize("consent", [False, True])
def test_repository_code_runs_only_with_consent(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, consent: bool
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen: list[dict] = []
    record_kwargs(monkeypatch, AutoTokenizer, seen)
    record_kwargs(monkeypatch, AutoModelForCausalLM, seen)
    config = ModelConfig(name=str(tiny_model_dir), trust_remote_code=consent)
    models.load_tokenizer(config)
    models.load_base_model(config, torch.device("cpu"), torch.float32)
    assert [kwargs["trust_remote_code"] for kwargs in seen] == [consent, consent]


def test_nothing_else_in_the_product_turns_repository_code_on() -> None:
    sources = [*ENGINE.rglob("*.py"), *(ENGINE.parent / "app").rglob("*.py")]
    offenders = [
        str(path)
        for path in sources
        if re.search(r"trust_remote_code\s*[=:]\s*True|\"trust_remote_code\":\s*True", path.read_text(encoding="utf-8"))
    ]
    assert offenders == []
    assert ModelConfig().trust_remote_code is False


# --- pickle weights -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pickle_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its weights as a pickle-based pytorch_model.bin instead of safetensors."""
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("pickled") / "model"
    shutil.copytree(tiny_model_dir, folder)
    for weights in folder.glob("*.safetensors"):
        torch.save(load_file(weights), folder / "pytorch_model.bin")
        weights.unlink()
    return folder


def test_pickle_weights_are_refused_by_default(pickle_model_dir: Path) -> None:
    config = ModelConfig(name=str(pickle_model_dir))
    with pytest.raises(ModelLoadError) as caught:
        models.load_base_model(config, torch.device("cpu"), torch.float32)
    assert "no *.safetensors weights" in caught.value.message
    assert caught.value.hint and "allow-pickle-weights" in caught.value.hint and "run code" in caught.value.hint


def test_pickle_weights_load_with_the_opt_in_and_a_warning(
    pickle_model_dir: Path, tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    config = ModelConfig(name=str(pickle_model_dir), allow_pickle_weights=True)
    loaded = models.load_base_model(config, torch.device("cpu"), torch.float32)
    reference = models.load_base_model(ModelConfig(name=str(tiny_model_dir)), torch.device("cpu"), torch.float32)
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
    events = list(run(make_config(pickle_model_dir, chat_file, tmp_path, allow_pickle_weights=True)))
    assert isinstance(events[-1], RunFinished), events[-1]
    assert PICKLE_WARNING in [e.message for e in events if isinstance(e, Notice)]
    refused = list(run(make_config(pickle_model_dir, chat_file, tmp_path / "refused")))
    assert isinstance(refused[-1], RunFailed) and "safetensors" in refused[-1].message


# --- the Hugging Face token ---------------------------------------------------------------------------------


@pytest.fixture
def tokens_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A token in the environment and another in the standard cache file, as a logged-in user has."""
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "token").write_text(CACHED_TOKEN + "\n")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", TOKEN)


def assert_no_token_in(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert TOKEN.encode() not in data and CACHED_TOKEN.encode() not in data, path


def test_redact_masks_the_users_tokens_and_token_shaped_text(tokens_set: None) -> None:
    text = f"GET /api (Authorization: Bearer {TOKEN}) cached={CACHED_TOKEN} other=hf_{'x' * 34}"
    assert redact(text) == f"GET /api (Authorization: Bearer {MASK}) cached={MASK} other={MASK}"


def test_the_token_never_reaches_the_run_folder_or_the_events(
    tokens_set: None, tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "ok")))
    assert isinstance(ok[-1], RunFinished)

    def leaky_failure(session, batch, num_items):  # an HTTP library that echoes the request headers
        raise RuntimeError(f"401 Unauthorized: Authorization: Bearer {TOKEN} (cached {CACHED_TOKEN})")

    monkeypatch.setattr(step_module, "_forward_loss", leaky_failure)
    failed = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "failed")))
    assert isinstance(failed[-1], RunFailed) and "401 Unauthorized" in failed[-1].message
    error_log = tmp_path / "failed" / "run" / "error.log"
    assert "Bearer hf_***" in error_log.read_text()
    for events, folder in ((ok, tmp_path / "ok"), (failed, tmp_path / "failed")):
        assert_no_token_in(folder)
        text = repr([e.to_dict() for e in events])
        assert TOKEN not in text and CACHED_TOKEN not in text


# --- the network --------------------------------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every attempt to open a connection is recorded and refused."""
    attempts: list[object] = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError("network use in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_offline_mode_is_honoured_for_hub_models(monkeypatch: pytest.MonkeyPatch, no_network: list) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as caught:
        models.load_tokenizer(ModelConfig(name="someone/not-in-the-cache-model"))
    assert "offline mode is on" in caught.value.message
    assert no_network == []


def test_a_local_run_touches_no_network_even_when_online(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: list
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path)))
    assert isinstance(events[-1], RunFinished), events[-1]
    assert no_network == []
