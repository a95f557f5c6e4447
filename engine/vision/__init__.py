"""Vision-language models: pictures beside text in the chat rows, LoRA on the language model.

A model whose config names a vision tower trains here instead of on the packed text path: its family
(:mod:`engine.vision.families`) says which modules are the language model, the vision tower and the projector;
its rows (:mod:`engine.vision.data`) hold image files checked and resized before training
(:mod:`engine.vision.images`); its processor turns each row into tokens, labels and pixels
(:mod:`engine.vision.encode`); and :mod:`engine.vision.run` trains it with the run folder, checkpoints and events
of a text run.
"""
