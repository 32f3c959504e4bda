"""hetpipe: pipelined virtual workers on mixed GPUs, synchronised under WSP."""

__version__ = "0.1.0"
