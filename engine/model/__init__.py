"""The base model: loading it (and its tokenizer) with a LoRA adapter (engine.model.load), and chatting with a
fine-tuned one beside its base (engine.model.chat)."""
