"""dflash-train: train DFlash speculative-decoding drafters."""

__version__ = "0.1.0"
