"""The engine layout the Space runs (hotswap slots, requests per pipeline call) and its command-line options, shared
by `app.py`, `python -m lora_manager compile-cache` and `gpu-check`: a compile bundle's key depends on the layout, so
one built for another layout is skipped."""

from __future__ import annotations

import argparse
import os

APP_SLOTS = 2  # LoRAs one request can combine, one hotswap slot each
APP_MAX_BATCH = 4  # requests one pipeline call holds, whatever their LoRAs


def add_layout_options(parser: argparse.ArgumentParser) -> None:
    """`--slots` and `--max-batch`, defaulting to LORA_SLOTS / LORA_MAX_BATCH, else the app's layout."""
    parser.add_argument(
        "--slots",
        type=int,
        default=int(os.environ.get("LORA_SLOTS", APP_SLOTS)),
        help=f"hotswap slots: LoRAs one request can combine (env LORA_SLOTS; default {APP_SLOTS})",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=int(os.environ.get("LORA_MAX_BATCH", APP_MAX_BATCH)),
        help=f"requests run in one pipeline call, whatever their LoRAs (env LORA_MAX_BATCH; default {APP_MAX_BATCH})",
    )
