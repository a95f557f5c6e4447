"""The knowledge anchor: a penalty that pulls the tuned model's answers to general prompts back toward its base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import RunConfig
from engine.events import Notice, RunFinished
from engine.run.anchor import AnchorRow, KnowledgeAnchor, kl_from_base, padded
from engine.train import run


def test_the_divergence_is_zero_for_the_same_distribution_and_counts_only_answer_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    answer = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    assert kl_from_base(logits, logits, answer).item() == pytest.approx(0.0, abs=1e-6)
    other = logits.clone()
    other[0, 0] += 5.0  # a position outside the answers changes nothing
    assert kl_from_base(logits, other, answer).item() == pytest.approx(0.0, abs=1e-6)
    other[0, 2] += torch.randn(11) * 3  # one inside does
    assert kl_from_base(logits, other, answer).item() > 0.01


def test_rows_are_right_padded_with_their_answers_marked() -> None:
    ids, attention, answer = padded([AnchorRow((5, 6, 7, 8), 2), AnchorRow((9, 10), 1)], 0, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert answer.tolist() == [[False, False, True, True], [False, True, False, False]]


class _Adapted(torch.nn.Module):
    """A tiny 'model' with an adapter that can be switched off, as peft's disable_adapter() does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(12, 8)
        self.head = torch.nn.Linear(8, 12)
        self.delta = torch.nn.Parameter(torch.randn(8, 12) * 0.5)
        self.off = False
        for p in (*self.embed.parameters(), *self.head.parameters()):
            p.requires_grad_(False)

    def disable_adapter(self) -> object:
        model = self

        class Off:
            def __enter__(self) -> None:
                model.off = True

            def __exit__(self, *args: object) -> None:
                model.off = False

        return Off()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 0) -> object:
        hidden = self.embed(input_ids)[:, -logits_to_keep:]  # as transformers slices: 0 keeps every position
        logits = self.head(hidden) if self.off else self.head(hidden) + hidden @ self.delta

        class Out:
            pass

        out = Out()
        out.logits = logits  # type: ignore[attr-defined]
        return out


def test_steps_on_the_penalty_alone_bring_the_tuned_model_back_to_its_base() -> None:
    model = _Adapted()
    rows = [AnchorRow((1, 2, 3, 4, 5), 2), AnchorRow((6, 7, 8), 1), AnchorRow((9, 10, 11, 3), 2)]
    anchor = KnowledgeAnchor(rows, 1.0, 0, torch.device("cpu"))
    optimizer = torch.optim.SGD([model.delta], lr=0.5)
    first = float(anchor.backward(model))
    for _ in range(60):
        optimizer.zero_grad()
        anchor.backward(model)
        optimizer.step()
    assert first > 0.05 and float(anchor.backward(model)) < first / 10
    assert model.training  # the penalty puts the model back in the mode it found it in


def test_a_run_with_the_penalty_trains_and_says_so(tmp_path: Path) -> None:
    from engine.demo import DEMO_EVAL_FILE

    config = RunConfig.from_dict(
        {
            "model": {"name": "demo"},
            "data": {"path": str(DEMO_EVAL_FILE), "eval_fraction": 0.0},
            "training": {"max_steps": 3, "keep_knowledge": True, "knowledge_penalty": 2.0},
            "output": {"dir": str(tmp_path / "runs"), "name": "anchored"},
        }
    )
    events = list(run(config))
    notes = [e.message for e in events if isinstance(e, Notice)]
    assert any(n.startswith("knowledge penalty 2:") for n in notes)
    assert any(isinstance(e, RunFinished) and e.step == 3 for e in events)


def test_a_step_reads_the_anchor_rows_padded_to_the_longest_of_each_batch() -> None:
    rows = [AnchorRow(tuple(range(n)), 1) for n in (3, 5, 2, 4, 6)]  # batches of 4: [3, 5, 2, 4] and [6, 3, 5, 2]
    anchor = KnowledgeAnchor(rows, 1.0, 0, torch.device("cpu"))
    assert anchor.tokens_per_step() == pytest.approx((4 * 5 + 4 * 6) / 2)
    assert KnowledgeAnchor([], 1.0, 0, torch.device("cpu")).tokens_per_step() == 0.0


def test_the_time_a_cpu_run_expects_counts_the_anchor_passes() -> None:
    from engine.run.estimate import EVAL_SHARE, cpu_run_seconds

    plain = cpu_run_seconds(2.0, 10, 1, eval_rows=3, eval_every=5)
    assert plain == pytest.approx(2.0 * (10 + 3 * 3 * EVAL_SHARE))
    anchored = cpu_run_seconds(2.0, 10, 1, eval_rows=3, eval_every=5, anchor_step_s=1.5)
    assert anchored - plain == pytest.approx(10 * 1.5 * (1 + EVAL_SHARE))


def test_the_penalty_reads_only_the_answer_logits_and_equals_the_whole_sequence_divergence() -> None:
    """The logits of the prompts are not computed (``logits_to_keep``), and the penalty is the divergence over the
    answer tokens all the same, on a real causal LM with a LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    rows = [AnchorRow((1, 2, 3, 4, 5, 6, 7), 4), AnchorRow((8, 9, 10, 11, 12), 3), AnchorRow((13, 14, 15, 16), 2)]
    anchor = KnowledgeAnchor(rows, 2.0, 0, torch.device("cpu"))
    ids, attention, answer = padded(rows, 0, torch.device("cpu"))
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        whole = 2.0 * kl_from_base(base, model(input_ids=ids, attention_mask=attention).logits[:, :-1], answer[:, 1:])
    assert float(whole) > 1e-4
    read: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: read.append(args[0].shape[1]))
    assert float(anchor.backward(model)) == pytest.approx(float(whole), rel=1e-5)
    assert read == [ids.shape[1] - 1, ids.shape[1] - 1]  # base and tuned: from the first answer token's predictor
