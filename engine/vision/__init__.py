"""Vision-language models: pictures beside text in the chat rows, LoRA on the language model.

A model whose config names a vision tower trains on padded image rows instead of the packed text path. Its family
(:mod:`engine.vision.families`) says which modules are the language model, the vision tower and the projector;
:mod:`engine.vision.model` loads it, its processor and its adapter; its rows (:mod:`engine.vision.data`) hold image
files checked and resized before training (:mod:`engine.vision.images`); its processor turns each row into tokens,
labels and pixels (:mod:`engine.vision.encode`); :mod:`engine.vision.memory` sizes what the pictures add to a step,
:mod:`engine.vision.chat` answers about a picture and :mod:`engine.vision.export` says what can be exported. The run
itself (session, loop, report) lives with the other runs: ``engine.run.vision_session``, ``vision_loop`` and
``vision_report``.
"""
