"""The adapter's AdamW: fused on NVIDIA GPUs, foreach elsewhere, the same updates either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import finish, losses, make_config

from engine.config import ConfigError, RunConfig
from engine.run.optimizer import adamw, resolve
from engine.train import run


@pytest.mark.parametrize(
    ("choice", "device", "fused", "words"),
    [
        ("auto", "cuda", True, "automatic on an NVIDIA GPU"),
        ("auto", "cpu", False, "automatic on cpu"),
        ("auto", "mps", False, "automatic on mps"),
        ("fused", "cpu", True, "as asked"),
        ("foreach", "cuda", False, "as asked"),
    ],
)
def test_the_choice_by_device(choice: str, device: str, fused: bool, words: str) -> None:
    on, reason = resolve(choice, torch.device(device))
    assert on is fused and words in reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_foreach_make_the_same_updates(dtype: torch.dtype) -> None:
    """Five steps with weight decay and changing gradients; the fused kernel may round differently in the last bit."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator).to(dtype) for shape in [(8, 16), (16,), (3, 5)]]
    gradients = [[torch.randn(p.shape, generator=generator).to(dtype) for p in start] for _ in range(5)]
    finals = []
    for choice in ("fused", "foreach"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = adamw(params, 1e-2, 0.1, choice, torch.device("cpu"))
        assert optimizer.defaults["fused"] is (True if choice == "fused" else None)
        for step in gradients:
            for param, grad in zip(params, step, strict=True):
                param.grad = grad.clone()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finals.append([p.detach() for p in params])
    moved = [float((f - s).abs().max()) for f, s in zip(finals[1], start, strict=True)]
    assert min(moved) > 1e-3  # the steps did something
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for fused, foreach in zip(*finals, strict=True):
        torch.testing.assert_close(fused, foreach, rtol=tolerance, atol=tolerance)


def test_a_run_with_the_fused_optimizer_follows_the_foreach_curve(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    curves = {}
    for choice in ("fused", "foreach"):
        finished = finish(run(make_config(tiny_model_dir, chat_file, tmp_path / choice, optimizer=choice)))[-1]
        run_dir = Path(finished.run_dir)
        assert RunConfig.load(run_dir / "config.json").training.optimizer == choice
        curves[choice] = losses(run_dir)
    assert [s for s, _ in curves["fused"]] == [s for s, _ in curves["foreach"]]
    assert [v for _, v in curves["fused"]] == pytest.approx([v for _, v in curves["foreach"]], rel=1e-4)


def test_an_unknown_optimizer_is_refused(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="optimizer"):
        make_config(tiny_model_dir, chat_file, tmp_path, optimizer="sgd")


def test_a_checkpoint_of_one_kernel_resumes_under_the_other() -> None:
    """Runs resumed after changing ``--adamw`` (or moving between a GPU and the CPU) keep their moments and steps."""
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(6, 4, generator=generator)
    gradients = [torch.randn(6, 4, generator=generator) for _ in range(4)]

    def steps(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()

    reference = torch.nn.Parameter(start.clone())
    steps(adamw([reference], 1e-2, 0.0, "foreach", torch.device("cpu")), reference, gradients)
    for first, then in (("foreach", "fused"), ("fused", "foreach")):
        param = torch.nn.Parameter(start.clone())
        before = adamw([param], 1e-2, 0.0, first, torch.device("cpu"))
        steps(before, param, gradients[:2])
        after = adamw([param], 1e-2, 0.0, then, torch.device("cpu"))
        after.load_state_dict(before.state_dict())
        steps(after, param, gradients[2:])
        assert float(after.state[param]["step"]) == 4
        torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-6, atol=1e-6)
