"""App pieces without a training run: A/B arithmetic, the config form, error messages, start-up and layering."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from app_demo import LOAD_TIMEOUT_MS
from hang import HANG_S

from app.background.ab_compare import ABCompare, nothing_to_do, switch_settings
from app.background.worker import describe_error, training_threads
from app.theme import ERROR_COLOR
from engine.config import SpeedConfig
from engine.errors import ConfigError, DataError

pytest_plugins = ["app_fixtures"]

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, home: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (nothing imported yet), with its run history under ``home`` and the hang
    bound (``timeout``) as ``sys.argv[1]``."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(timeout)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=child_env(home))  # fmt: skip


def child_env(home: Path) -> dict[str, str]:
    """A clean environment for a child process: offscreen Qt, no network for models, run history and window
    settings in ``home``."""
    return {"QT_QPA_PLATFORM": "offscreen", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TUNEDECK_HOME": str(home),
            "XDG_CONFIG_HOME": str(home / "config")}  # fmt: skip


def drive(compare: ABCompare, rates: dict[bool, list[float]]) -> list[SpeedConfig]:
    """Feed the measurement like a run would: a SpeedChanged after each request, then steps at given rates."""
    requests, step, setting = [], 10, compare.first_settings()
    while not compare.done:
        on = getattr(setting, compare.switch)
        compare.speed_applied(step)
        for rate in rates[bool(on)]:
            step += 1
            request = compare.step_done(step, rate)
            if request is not None:
                requests.append(request)
                setting = request
                break
    return requests


def test_ab_compare_measures_the_speedup_without_the_first_step_of_each_block() -> None:
    base = SpeedConfig()
    compare = ABCompare(base, "metadata_cache", rounds=3, block_steps=3)
    # the first step after each change is slow (a one-off cost) and must not count
    requests = drive(compare, {True: [100.0, 1200.0, 1200.0], False: [100.0, 1000.0, 1000.0]})
    assert compare.result.speedup == pytest.approx(1.2)
    assert compare.result.spread == pytest.approx(0.0)
    assert len(compare.result.ratios) == 3
    assert requests[-1] == base, "the user's settings come back at the end"
    assert [r.metadata_cache for r in requests[:-1]] == [False, False, True, True, False]  # on/off, off/on, on/off
    assert "20.0% faster ± 0.0% over 3 rounds" in compare.result.summary()


def test_ab_compare_of_step_graphs_leaves_out_the_eager_and_the_capture_step() -> None:
    """After each change step graphs run a row shape eagerly, then capture it: two slow steps that do not count,
    and blocks grow to keep one counted step."""
    compare = ABCompare(SpeedConfig(), "step_graphs", rounds=2, block_steps=2)
    assert compare.block_steps == 3
    drive(compare, {True: [100.0, 50.0, 1300.0], False: [100.0, 1000.0, 1000.0]})
    assert compare.result.speedup == pytest.approx(1.3)


def test_ab_compare_reports_the_spread_and_noise() -> None:
    compare = ABCompare(SpeedConfig(), "metadata_cache", rounds=2, block_steps=2)
    rates = iter([[0, 1000.0], [0, 1000.0], [0, 1100.0], [0, 1000.0]])
    step, setting = 0, compare.first_settings()
    while not compare.done:
        compare.speed_applied(step)
        for rate in next(rates):
            step += 1
            request = compare.step_done(step, rate)
            setting = request or setting
    assert compare.result.ratios == pytest.approx([1.0, 1.0 / 1.1])
    assert compare.result.spread > 0.05
    assert "within the noise" in compare.result.summary()


def test_steps_before_the_change_is_applied_are_not_counted() -> None:
    compare = ABCompare(SpeedConfig(), "checkpointing", rounds=1, block_steps=2)
    assert compare.step_done(5, 1e9) is None  # the request is not applied yet
    compare.speed_applied(7)
    assert compare.step_done(7, 1e9) is None  # still the old setting
    assert compare.step_done(8, 500.0) is None
    assert compare.step_done(9, 500.0).checkpointing == "standard"


def test_switch_settings_and_nothing_to_do() -> None:
    base = SpeedConfig(attention_backend="sdpa")
    assert switch_settings(base, "checkpointing", True).checkpointing == "offloaded"
    assert switch_settings(base, "moe_routing", False).moe_routing == "stock"
    assert switch_settings(base, "metadata_cache", True).attention_backend == "sdpa"
    dense = {"moe_routing": {"mode": "stock", "reason": "no MoE expert layers in this model"}}
    assert nothing_to_do("moe_routing", dense) == "no MoE expert layers in this model"
    off_by_user = {"metadata_cache": {"on": False, "reason": "switched off: transformers' own packed path"}}
    assert nothing_to_do("metadata_cache", off_by_user) is None
    unsupported = {"metadata_cache": {"on": False, "reason": "attention sinks (gpt-oss) have no varlen kernel"}}
    assert "sinks" in nothing_to_do("metadata_cache", unsupported)


def test_errors_become_messages_with_hints() -> None:
    data = describe_error(DataError("missing", path="a.jsonl", row=3, field="messages", hint="fix row 3"))
    assert "row 3" in data.message and data.hint == "fix row 3"
    oom = describe_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert oom.message.startswith("out of memory") and "tokens per batch" in oom.hint
    assert describe_error(ValueError("bad")).message == "ValueError: bad"
    assert training_threads(2) == 1 and training_threads(1) == 1 and training_threads(16) == 15


def test_config_form_round_trips_recipes_and_names_bad_values(qtbot: Any) -> None:
    from app.app_state import AppState
    from app.pages.recipe import SetupPanel, recipe_config
    from engine.hardware.recipes import RECIPES

    state = AppState()
    panel = SetupPanel(state)
    qtbot.addWidget(panel)
    state.data_path = "data.jsonl"
    for recipe in RECIPES:
        panel.buttons[recipe.name].click()
        assert panel.recipe_name() == recipe.name
        built = panel.build_config().to_dict()
        expected = recipe_config(recipe.name).to_dict()
        expected["model"]["name"], expected["data"]["path"] = state.model_name, "data.jsonl"
        assert built == expected, recipe.name
    panel.form.editor("training.learning_rate").setText("fast")
    with pytest.raises(ConfigError, match=r"training\.learning_rate"):
        panel.build_config()
    assert panel.form.editor("lora.rank").toolTip().startswith("LoRA rank r (0: automatic")  # the field's help text
    assert "lora.rank in config.json, --lora-rank" in panel.form.editor("lora.rank").toolTip()


def test_bad_rows_are_listed_and_missing_models_explained(qtbot: Any, window: Any, tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 5
    rows[1] = {"messages": [{"role": "user", "content": "no answer"}]}
    rows[3] = {"messages": "oops"}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    window.data_panel.load(str(path))
    qtbot.waitUntil(lambda: window.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    listed = [window.data_panel.problems.item(i).text() for i in range(window.data_panel.problems.count())]
    assert listed[0].startswith("row 2: messages") and listed[1].startswith("row 4: messages")
    assert window.state.data_report.good_rows == 3

    (tmp_path / "broken.jsonl").write_text("{not json\n", encoding="utf-8")
    window.data_panel.load(str(tmp_path / "broken.jsonl"))
    qtbot.waitUntil(lambda: "broken.jsonl" in window.data_panel.summary.text() and "Reading" not in
                    window.data_panel.summary.text(), timeout=LOAD_TIMEOUT_MS)  # fmt: skip
    assert ERROR_COLOR in window.data_panel.summary.text()

    window.model_panel.choose(str(tmp_path / "no-such-model"))
    qtbot.waitUntil(lambda: "not found" in window.model_panel.status.text(), timeout=LOAD_TIMEOUT_MS)


def test_a_failing_run_shows_a_message_not_a_traceback(qtbot: Any, window: Any, tmp_path: Path) -> None:
    from app.background import run_controller as rc

    window.state.model_name = str(tmp_path / "missing-model")
    window.state.data_path = str(tmp_path / "missing.jsonl")
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FAILED, timeout=LOAD_TIMEOUT_MS)
    assert "not found" in window.run_panel.error.text()
    assert window.run_panel.start_button.isEnabled()
    window.state.data_path = ""
    window.run_panel.start_button.click()
    assert "no dataset chosen" in window.run_panel.error.text() and "Dataset page" in window.run_panel.error.text()


def test_window_appears_quickly_without_torch_and_detects_in_the_background(tmp_path: Path) -> None:
    """Quickly means with nothing heavy imported before the window shows (torch and transformers take seconds);
    the time it took is printed, not judged: that depends on how busy the machine is."""
    result = run_python(
        """
        import sys, time
        started = time.perf_counter()
        from PySide6.QtWidgets import QApplication
        from app.main_window import MainWindow
        app = QApplication([])
        window = MainWindow()
        window.show()
        # before the event loop runs: from then on the background detection may import torch at any moment
        assert "torch" not in sys.modules and "transformers" not in sys.modules, "heavy modules at start"
        app.processEvents()
        shown = time.perf_counter() - started
        deadline = time.monotonic() + float(sys.argv[1])  # the hang bound
        while window.state.hardware is None and time.monotonic() < deadline:
            app.processEvents()
            time.sleep(0.01)
        assert window.state.hardware is not None, "hardware detection did not finish"
        assert window.hardware_panel.table.rowCount() >= 4
        window.close()
        print(f"shown in {shown:.2f} s")
    """,
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_app_modules_do_not_import_torch(tmp_path: Path) -> None:
    result = run_python(
        """
        import importlib, pkgutil, sys
        import app
        names = [m.name for m in pkgutil.walk_packages(app.__path__, "app.") if m.name != "app.__main__"]
        for name in names:
            importlib.import_module(name)
        heavy = sorted(m for m in ("torch", "transformers", "peft", "bitsandbytes", "datasets") if m in sys.modules)
        assert not heavy, heavy
        print(len(names), "modules")
    """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr


def test_command_line_arguments_go_to_the_cli_without_qt(tmp_path: Path) -> None:
    result = run_python(
        """
        import sys
        from app.__main__ import main, wants_cli
        assert not wants_cli([]) and not wants_cli(["-platform", "offscreen"]) and not wants_cli(["--gui"])
        assert wants_cli(["train", "--demo"]) and wants_cli(["--help"]) and wants_cli(["nonsense"])
        try:
            main(["--version"])
        except SystemExit as done:
            assert done.code == 0
        assert "PySide6" not in sys.modules
    """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "tunedeck" in result.stdout


def test_a_hub_model_that_is_not_cached_offline_gets_a_clear_message(
    qtbot: Any, window: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network in tests
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    panel = window.model_panel
    panel.hub.setChecked(True)
    panel.hub_edit.setText("someone/not-a-cached-model")
    panel.choose()
    qtbot.waitUntil(lambda: "not in the local Hugging Face cache" in panel.status.text(), timeout=LOAD_TIMEOUT_MS)
    assert "unset HF_HUB_OFFLINE" in panel.details.toPlainText()
    assert panel.download.isHidden()


def test_download_progress_is_forwarded() -> None:
    from engine.model.hub import progress_bar_class

    seen: list[tuple[str, float, float | None]] = []
    bar = progress_bar_class(lambda *args: seen.append(args))(total=2048, desc="model.safetensors")
    bar.update(1024)
    bar.update(1024)
    bar.close()
    assert seen == [("model.safetensors", 1024.0, 2048.0), ("model.safetensors", 2048.0, 2048.0)]


def test_telemetry_warnings_and_samples_reach_the_run_page(qtbot: Any, window: Any) -> None:
    from engine.hardware.telemetry import TelemetrySample, TelemetryWarning

    sample = TelemetrySample(
        time_s=1.0, gpu_index=0, memory_used_bytes=7 << 30, memory_total_bytes=8 << 30,
        process_gpu_memory_bytes=6 << 30, utilization_pct=97.0, memory_utilization_pct=50.0, temperature_c=86.0,
        power_w=200.0, power_limit_w=220.0, sm_clock_mhz=1500, memory_clock_mhz=9000,
        throttle_reasons=("hw_thermal_slowdown",), process_rss_bytes=1 << 30,
    )  # fmt: skip
    window.controller.telemetry.emit(sample)
    window.controller.telemetry.emit(TelemetryWarning("throttling", "the GPU is throttling: hot (86 °C)", 1.0))
    charts = window.run_panel.charts
    lane = charts.lane_buffers(0)
    assert lane["used"] == [7.0] and lane["total"] == [8.0]
    assert lane["util"] == [97.0] and charts.buffers["throttle_t"] == [1.0]
    assert window.run_panel.warnings.item(0).text() == "⚠ the GPU is throttling: hot (86 °C)"
    assert window.statusBar().currentMessage() == "⚠ the GPU is throttling: hot (86 °C)"  # seen from every page


def test_the_planner_warns_on_setup_before_a_run_that_will_not_fit(qtbot: Any) -> None:
    from app.app_state import AppState
    from app.pages.recipe import SetupPanel
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget
    from engine.hardware.shapes import load_shape
    from engine.model.info import ModelInfo

    state = AppState()
    panel = SetupPanel(state)
    qtbot.addWidget(panel)
    laptop = DeviceTarget.from_spec(gpus.find_gpu("RTX 4060 laptop"))
    state.hardware = laptop
    state.set_model("llama-3.1-8b", ModelInfo("llama-3.1-8b", "llama", 8_000_000_000, False, "needs QLoRA", "",
                                              shape=load_shape("llama-3.1-8b")))  # fmt: skip
    panel.choose_recipe("Balanced")
    assert panel.form.editor("model.qlora").isChecked(), "the planner's QLoRA verdict ticks the box"
    panel.form.editor("model.qlora").setChecked(False)
    panel.form.editor("data.tokens_per_batch").setValue(16384)
    panel.check_fit()
    assert panel.warning.text().startswith("Will not fit on the RTX 4060 Laptop: even 256 tokens need")
    state.set_model("qwen3-0.6b", ModelInfo("qwen3-0.6b", "qwen3", 600_000_000, False, "fits", "",
                                            shape=load_shape("qwen3-0.6b")))  # fmt: skip
    panel.form.editor("data.tokens_per_batch").setValue(2048)
    panel.check_fit()
    assert panel.warning.text() == ""


def test_tunedeck_without_arguments_opens_the_window(tmp_path: Path) -> None:
    app = subprocess.Popen(
        [sys.executable, "-m", "app"], cwd=REPO, env=child_env(tmp_path), stderr=subprocess.PIPE, text=True
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # still showing the window: the event loop is running
            app.wait(timeout=6)  # not a hang bound: the window is expected to outlive it
    finally:
        app.terminate()
        _, errors = app.communicate(timeout=HANG_S)
    assert "Traceback" not in errors, errors


def test_the_guard_fails_a_test_that_leaves_a_qthread_running(tmp_path: Path) -> None:
    test_file = tmp_path / "test_leaky.py"
    test_file.write_text(
        textwrap.dedent("""
        import time
        from PySide6.QtCore import QThread

        pytest_plugins = ["app_fixtures"]

        class Sleeper(QThread):
            def __init__(self, seconds):
                super().__init__()
                self.seconds = seconds

            def run(self):
                time.sleep(self.seconds)

        def test_leaks():  # still running when the guard looks, a moment later, however busy the machine
            global thread
            thread = Sleeper(3)
            thread.start()

        def test_joins():
            thread = Sleeper(0.1)
            thread.start()
            thread.wait()
    """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file), "--rootdir", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
        env={**child_env(tmp_path), "PYTHONPATH": str(REPO / "tests")},
    )  # fmt: skip
    assert "2 passed, 1 error" in result.stdout, result.stdout + result.stderr  # the leak fails at teardown
    assert "ERROR test_leaky.py::test_leaks" in result.stdout and "left 1 QThread(s) running" in result.stdout


def test_a_local_model_folder_is_inspected_and_the_dataset_retokenized(
    qtbot: Any, window: Any, tiny_model_dir: Path, chat_file: Path
) -> None:
    window.data_panel.load(str(chat_file))
    qtbot.waitUntil(lambda: window.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    demo_tokens = window.state.data_report.total_tokens
    panel = window.model_panel
    panel.folder.setChecked(True)
    panel.folder_edit.setText(str(tiny_model_dir))
    panel.choose()
    qtbot.waitUntil(lambda: window.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    info = window.state.model_info
    assert info.family == "llama" and not info.is_moe and info.verdict == "fits"
    assert "Family: llama" in panel.details.toPlainText() and "dense" in panel.details.toPlainText()
    assert "Verdict for this computer (CPU): fits" in panel.details.toPlainText()
    assert "Longest row that trains here: " in panel.details.toPlainText()
    assert "tokens, with LoRA and standard checkpointing" in panel.details.toPlainText()  # no offloading on a CPU
    qtbot.waitUntil(lambda: window.data_panel.report_model == str(tiny_model_dir), timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: window.state.data_report.total_tokens != demo_tokens, timeout=LOAD_TIMEOUT_MS)


def test_an_error_in_a_slot_is_shown_in_the_window(window: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.main_window import install_error_hook

    monkeypatch.setattr(sys, "excepthook", lambda *args: None)
    install_error_hook(window)
    try:
        raise FileNotFoundError(2, "No such file", "/data/missing.jsonl")
    except FileNotFoundError as err:
        sys.excepthook(type(err), err, err.__traceback__)
    assert window.statusBar().currentMessage() == (
        "Something went wrong: file not found: /data/missing.jsonl — check the path and pick the file again"
    )


def test_the_verdict_names_the_gpu_or_the_computer() -> None:
    from types import SimpleNamespace

    from app.widgets.model_words import verdict_target
    from engine.model.info import ModelInfo

    def info(profile: object) -> ModelInfo:
        return ModelInfo("m", "llama", 1, False, "fits", "", profile=profile)

    assert verdict_target(info(SimpleNamespace(device="cuda", gpu_name="NVIDIA GeForce RTX 4060"))) == (
        "this GPU (NVIDIA GeForce RTX 4060)"
    )
    assert verdict_target(info(SimpleNamespace(device="cuda", gpu_name=None))) == "this GPU"
    assert verdict_target(info(SimpleNamespace(device="cpu", gpu_name=None))) == "this computer (CPU)"
    assert verdict_target(info(None)) == "this computer (CPU)"


def test_the_model_page_names_the_layers_that_skip_the_recompute_on_this_gpu() -> None:
    from app.widgets.model_words import resident_layers_html
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget, build_profile
    from engine.hardware.shapes import load_shape
    from engine.model.info import ModelInfo

    card = DeviceTarget.from_spec(gpus.find_gpu("NVIDIA GeForce RTX 4090"))  # type: ignore[arg-type]
    shape = load_shape("llama-3.1-8b")
    roomy = build_profile(card, shape, overrides={"qlora": True, "tokens_per_batch": 4096})
    html = resident_layers_html(ModelInfo("m", "llama", 1, False, "fits", "", profile=roomy))
    assert html.startswith("<p>Faster in the memory left: ") and "of 32 layers keep their activations" in html
    full = build_profile(card, shape, overrides={"qlora": True, "checkpointing": "none"})
    assert resident_layers_html(ModelInfo("m", "llama", 1, False, "fits", "", profile=full)) == ""
    assert resident_layers_html(ModelInfo("m", "llama", 1, False, "fits", "", profile=None)) == ""


def test_the_model_page_shows_the_plans_notes() -> None:
    from app.widgets.model_words import plan_notes_html
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget, build_profile
    from engine.hardware.shapes import load_shape
    from engine.model.info import ModelInfo

    card = DeviceTarget.from_spec(gpus.find_gpu("NVIDIA GeForce RTX 4090"))  # type: ignore[arg-type]
    profile = build_profile(card, load_shape("llama-3.1-8b"), overrides={"qlora": True}, lora_rank=32)
    html = plan_notes_html(ModelInfo("m", "llama", 1, False, "fits", "", profile=profile))
    assert html.count("<p>Note: ") == len(profile.notes) == 2
    # 1.3x: the 16,384-token rows are planned unchunked, as the engine runs them with 17 GiB free, with 5 layers
    # resident in what they leave (chunked, they kept none and the shorter rows looked 1.4x faster)
    assert "fp8 tensor cores" in html and "<p>Note: rows of 4,096 tokens would train about 1.3x faster" in html
    assert plan_notes_html(ModelInfo("m", "llama", 1, False, "fits", "", profile=None)) == ""


def test_a_switch_the_engine_cannot_apply_is_reported_not_measured() -> None:
    compare = ABCompare(SpeedConfig(), "checkpointing", rounds=2, block_steps=2)
    restore = compare.abandon("offloaded requested but the GPU shares memory with the CPU; plain recompute instead")
    assert restore == SpeedConfig() and compare.done
    assert compare.result.summary().startswith("nothing to do: offloaded requested but")
    integrated = {"checkpointing": {"mode": "standard", "reason": "offloaded requested but GB10 shares memory"}}
    assert nothing_to_do("checkpointing", integrated)


def test_the_demo_data_button_finds_the_demo_dataset() -> None:
    from app.pages.data import demo_data_file
    from engine.demo import DEMO_TRAIN_FILE

    assert demo_data_file() == Path(DEMO_TRAIN_FILE) and demo_data_file().exists()


def test_without_a_display_tunedeck_shows_the_command_line(tmp_path: Path) -> None:
    env = {key: value for key, value in child_env(tmp_path).items() if key != "QT_QPA_PLATFORM"}
    command = [sys.executable, "-m", "app"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    assert "No display found" in result.stderr and "tunedeck train" in result.stdout
