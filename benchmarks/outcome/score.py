"""Task scores for the outcome record: exact match of greedy answers on a test file, for the base model and adapters.

    python benchmarks/outcome/score.py MODEL TEST.jsonl base= NAME=ADAPTER_DIR ...

Prints one JSON object, name -> exact match. The base model loads once (a GGUF model through TuneDeck's own
conversion, as ``tunedeck train`` loads it) and peft switches between the adapters; answers are generated and
scored as the report's short answers are (engine.run.short_answers: greedy, left-padded batches, SQuAD's
normalisation).
"""

from __future__ import annotations

import json
import sys

import torch

from engine.config import ModelConfig
from engine.data.files import load_examples
from engine.data.tokenize import ensure_chat_template, tokenize_examples
from engine.model.load import load_base_model, load_tokenizer
from engine.run.short_answers import answer_text, exact_match, generate_replies, split_answer, stop_token_ids


def main(model_name: str, test_file: str, columns: list[str]) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = ModelConfig(name=model_name)
    tokenizer = load_tokenizer(config)
    ensure_chat_template(tokenizer)
    model = load_base_model(config, device, torch.float32)
    examples, _ = load_examples(test_file, "auto")
    tokenized, _ = tokenize_examples(tokenizer, examples, max_seq_len=4096)
    answers = [answer for answer in map(split_answer, tokenized) if answer is not None]
    stops = stop_token_ids(tokenizer, model)
    references = [answer_text(tokenizer, a.answer, stops) for a in answers]
    scores: dict[str, float] = {}
    peft_model = None
    for column in columns:
        name, _, adapter = column.partition("=")
        if not adapter:
            generator = model
        elif peft_model is None:
            from peft import PeftModel

            peft_model = PeftModel.from_pretrained(model, adapter, adapter_name=name)
            generator = peft_model
        else:
            peft_model.load_adapter(adapter, adapter_name=name)
            peft_model.set_adapter(name)
            generator = peft_model
        with torch.no_grad():
            replies = generate_replies(generator, tokenizer, answers, device, stops)
        scores[name] = sum(exact_match(r, ref) for r, ref in zip(replies, references, strict=True)) / len(answers)
        print(f"{name}: {scores[name]:.0%}  e.g. {replies[:2]}", file=sys.stderr)
    print(json.dumps(scores))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
