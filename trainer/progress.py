"""Hugging Face's progress bars, off where no one watches them (a log file, a Dagster run).

Kept apart from ``model.py`` so that code which only quiets the bars (the base-model builders
the CLI imports, the embedding judge) does not import torch for it.
"""

from __future__ import annotations

import os
import sys


def quiet_progress_bars() -> None:
    """Turn off transformers' and huggingface_hub's progress bars ("Loading weights: 0%|...",
    the GGUF reader's) unless stderr is a terminal: in a log file or a Dagster run's captured
    output every redraw is kept. Called before loading a model; an
    ``HF_HUB_DISABLE_PROGRESS_BARS`` set by the user wins."""
    if "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ or (sys.stderr is not None
                                                         and sys.stderr.isatty()):
        return
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # The GGUF reader draws its own tqdm bar ("Converting and de-quantizing GGUF tensors...").
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)  # type: ignore[attr-defined]
