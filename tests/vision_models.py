"""Tiny random vision-language models of each family, with a processor built from a small local tokenizer.

Each folder holds what a downloaded model holds: config.json, safetensors weights, the tokenizer with the family's
image tokens, the image processor (the PIL one, sized for tiny images) and a chat template in the family's shape.
Qwen-VL's processor also wants a video processor, which transformers builds only with torchvision; the folder is
written without one, as TuneDeck reads it (engine.vision.model.load_processor).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import CORPUS

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IDEFICS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
MLLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|image|>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tokenizer_with(specials: list[str], corpus: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """A small byte-level BPE tokenizer whose special tokens include the family's image tokens (``corpus``: more
    text to learn its merges from, so that a task's words become single tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([*CORPUS, *corpus] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)


def qwen_tokenizer() -> tuple[Any, dict[str, int]]:
    """Qwen-VL's tokenizer (chat template included) and the ids of its picture tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tokenizer = tokenizer_with([*specials, "<|video_pad|>"], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer, {token: tokenizer.convert_tokens_to_ids(token) for token in [*specials, "<|video_pad|>"]}


def qwen_ids(ids: dict[str, int]) -> dict[str, int]:
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def qwen2_vl(**text: Any) -> tuple[Any, Any, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = qwen_tokenizer()
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16})
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            **{**TEXT, **text},
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2),
        tie_word_embeddings=False,
        **qwen_ids(ids),
    )
    return Qwen2VLForConditionalGeneration(config), tokenizer, images


def qwen2_5_vl(
    depth: int = 1, full_attention: tuple[int, ...] = (0,), max_pixels: int = 28 * 28 * 16, **text: Any
) -> tuple[Any, Any, Any]:
    """``full_attention``: the tower's layers that attend over the whole picture (the others attend within 112-pixel
    windows); ``max_pixels``: the processor's pixel budget of a picture (16 tokens); ``text``: the language model's
    settings."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = qwen_tokenizer()
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": max_pixels})
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            **{**TEXT, **text},
        ),
        vision_config=dict(
            depth=depth,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=list(full_attention),
        ),
        tie_word_embeddings=False,
        **qwen_ids(ids),
    )
    return Qwen2_5_VLForConditionalGeneration(config), tokenizer, images


def qwen3_vl() -> tuple[Any, Any, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = qwen_tokenizer()
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 16}, patch_size=16, merge_size=2
    )
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            **TEXT,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        tie_word_embeddings=False,
        **qwen_ids(ids),
    )
    return Qwen3VLForConditionalGeneration(config), tokenizer, images


def gemma3(projector_std: float = 0.0) -> tuple[Any, Any, Any]:
    """``projector_std``: the spread of the projector's random weights (transformers starts the projection and its
    norm at zero, so that the language model sees every picture as zeros until trained)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", *images.values()]
    tokenizer = tokenizer_with(
        specials, eos_token="<end_of_turn>", pad_token="<pad>", bos_token="<bos>", extra_special_tokens=images
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        chat_template=GEMMA_TEMPLATE,
        image_seq_length=4,
    )
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in images.items()}
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            head_dim=16,
            query_pre_attn_scalar=16,  # the head size, as in Gemma 3's own models (llama.cpp assumes it)
            max_position_embeddings=512,
            sliding_window=64,
            **TEXT,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
    )
    model = Gemma3ForConditionalGeneration(config)
    projector = model.model.multi_modal_projector
    if projector_std:
        with torch.no_grad():
            projector.mm_input_projection_weight.normal_(0.0, projector_std)
            projector.mm_soft_emb_norm.weight.normal_(0.0, projector_std)
    return model, processor, None


def idefics3(corpus: tuple[str, ...] = (), scale_factor: int = 1, **text: Any) -> tuple[Any, Any, Any]:
    """``scale_factor``: the connector's pixel shuffle (SmolVLM's own models use 2 to 4; llama.cpp needs 2 or more)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    grid = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = ["<|endoftext|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>", *grid]
    tokenizer = tokenizer_with(specials, corpus, eos_token="<end_of_utterance>", pad_token="<|endoftext|>")
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
        tokenizer=tokenizer,
        chat_template=IDEFICS_TEMPLATE,
        image_seq_len=16 // scale_factor**2,  # (32 / 8 patches) squared, shuffled into scale_factor**2 fewer
    )
    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            pad_token_id=0,
            **{**TEXT, **text},
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    return Idefics3ForConditionalGeneration(config), processor, None


def smolvlm() -> tuple[Any, Any, Any]:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    grid = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = ["<|endoftext|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>", *grid]
    tokenizer = tokenizer_with(specials, eos_token="<end_of_utterance>", pad_token="<|endoftext|>")
    tokenizer.chat_template = IDEFICS_TEMPLATE
    images = SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    config = SmolVLMConfig(
        text_config=dict(
            model_type="llama", vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=0, **TEXT
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        scale_factor=1,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    return SmolVLMForConditionalGeneration(config), tokenizer, images


def mllama() -> tuple[Any, Any, Any]:
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    specials += ["<|image|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
    tokenizer = tokenizer_with(
        specials, eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>", bos_token="<|begin_of_text|>"
    )
    processor = MllamaProcessor(
        image_processor=MllamaImageProcessorPil(size={"height": 16, "width": 16}, max_image_tiles=4),
        tokenizer=tokenizer,
        chat_template=MLLAMA_TEMPLATE,
    )
    config = MllamaConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            cross_attention_layers=[1],
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            **TEXT,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_global_layers=1,
            attention_heads=2,
            image_size=16,
            patch_size=8,
            max_num_tiles=4,
            vision_output_dim=64,
            intermediate_layers_indices=[0],
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"),
    )
    return MllamaForConditionalGeneration(config), processor, None


PROCESSOR_SETTINGS = {"smolvlm": {"image_seq_len": 16}}
"""Settings of the processor itself, in processor_config.json: SmolVLM's image tokens a tile (32/8 patches squared)."""

BUILDERS: dict[str, Callable[..., tuple[Any, Any, Any]]] = {
    "qwen2_5_vl": qwen2_5_vl,
    "qwen3_vl": qwen3_vl,
    "gemma3": gemma3,
    "idefics3": idefics3,
    "mllama": mllama,
    "smolvlm": smolvlm,
}
"""The families every vision test covers."""
MORE_BUILDERS: dict[str, Callable[..., tuple[Any, Any, Any]]] = {"qwen2_vl": qwen2_vl}
"""Families built for some tests only (Qwen2-VL, whose tower Qwen2.5-VL's replaced: the GGUF export's tests)."""


def build_vision_model(folder: Path, family: str, seed: int = 0, **settings: Any) -> Path:
    """A tiny random ``family`` model with its processor (``settings``: the builder's own), saved as a local model
    folder."""
    import torch

    torch.manual_seed(seed)
    model, processor, image_processor = {**BUILDERS, **MORE_BUILDERS}[family](**settings)
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    if image_processor is not None:  # a tokenizer and an image processor, no video processor (it needs torchvision)
        image_processor.save_pretrained(folder)
    if family in PROCESSOR_SETTINGS:
        settings = {"processor_class": "SmolVLMProcessor", **PROCESSOR_SETTINGS[family]}
        (folder / "processor_config.json").write_text(json.dumps(settings))
    return folder


def draw(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (40, 32), shape: str = "square") -> Path:
    """A small PNG: a ``colour`` shape on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    canvas = ImageDraw.Draw(image)
    box = (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4)
    (canvas.ellipse if shape == "circle" else canvas.rectangle)(box, fill=colour)
    image.save(path)
    return path
