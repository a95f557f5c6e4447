"""The base model: loading it (and its tokenizer) with a LoRA adapter (engine.model.load), and chatting with a
fine-tuned one beside its base (engine.model.chat). Before it is loaded: its config and tokenizer from this computer,
the hub only when asked (engine.model.hub), and its family, size and the planner's verdict (engine.model.info)."""
