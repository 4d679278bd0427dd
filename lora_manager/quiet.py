"""Third-party output that a start would print and that tells a user nothing, each silenced where it arises, with the
reason beside it. Real warnings and errors still come through."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in str(record.msg) for f in self.fragments)


def silence_import_notices() -> None:
    """transformers notes once per image processor that torchvision is missing: the pipelines here pass PIL images
    and use the PIL processors it falls back to, so torchvision is not installed on purpose."""
    logging.getLogger("transformers.utils.import_utils").addFilter(_DropMessages("requires torchvision"))


@contextlib.contextmanager
def quiet_loads() -> Iterator[None]:
    """Around loads the engine and its benchmarks make themselves (the pipeline, the hotswap template, the baselines'
    LoRAs): no progress bars, and not their notices. The template loads K zero adapters into one model on purpose,
    which PEFT warns about ("Already found a `peft_config` attribute"), transformers reports the other slots' adapter
    keys as missing from each text-encoder load (a zero template has nothing to miss), and diffusers reports a
    template or LoRA without text-encoder modules (when no adapter targets it) as having no keys for it, and a cast
    of a model none of whose modules must stay in float32 as one that has such modules (an empty list)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    bars = [(lib, lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)]
    report = logging.getLogger("transformers.integrations.peft")
    level = report.level
    dropped = [
        (logging.getLogger("diffusers.loaders.lora_base"), _DropMessages("No LoRA keys associated to")),
        (logging.getLogger("diffusers.models.modeling_utils"), _DropMessages("should be kept in float32: []")),
    ]
    for lib, _ in bars:
        lib.disable_progress_bar()
    report.setLevel(logging.ERROR)
    for logger, drop in dropped:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute", category=UserWarning)
            yield
    finally:
        for logger, drop in dropped:
            logger.removeFilter(drop)
        report.setLevel(level)
        for lib, enabled in bars:
            if enabled:
                lib.enable_progress_bar()
