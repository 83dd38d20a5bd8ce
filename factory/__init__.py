"""The factory: LLM traffic in, a fine-tuned LoRA model out. Vocabulary, transforms, lake, CLI."""

__version__ = "0.1.0"
